"""Upload and download throughput of a commit through the S3 backend, against plain s3fs.

Not a test. Starts a moto S3 server on 127.0.0.1 (the same server the tests use) in a process
of its own (``_moto_process``), saves
one commit of float32 tensors (a mix of 1, 4 and 16 MiB tensors; the 16 MiB ones are
stored as 4 MiB blocks, SPEC.md §5.1) to a local store, then measures, on the same bytes
and in the same run:

- shardstore upload: ``open_store(s3://…)`` of a fresh prefix + ``copy_commit(local, s3,
  ref="main")`` (create-only conditional puts, every object re-hashed before it is
  written, the commit protocol's barriers, the gc fence and the ref's compare-and-swap);
- plain s3fs put: ``S3FileSystem.put`` of the local store's object files (the same
  objects, the same bytes), recursively, to a fresh prefix;
- shardstore download: ``copy_commit(s3, fresh local store)`` (every object hashed as it
  arrives, fsynced into the local store);
- plain s3fs get: ``S3FileSystem.get`` of the same keys to a fresh directory; and, as a
  reference row, the same followed by an fsync of every file and directory (``--threads``
  at a time): the durability the store's download gives every object before a manifest
  names it, which plain get does not.

Same concurrency on both sides: ``--threads`` objects at a time (copy's thread pool and
the S3 backend's requests in flight; s3fs's ``batch_size``, the files it moves at once).
No object here is large enough for either side's multipart or ranged transfers.

Each repetition runs both sides back to back, alternating which goes first, after one
untimed warm-up of each (connections; the probe of the server's request conditions, which a
process runs once per bucket). What a repetition wrote is removed after it, untimed, on both
sides (the uploads' prefixes, the downloads' directories): removing is not transferring, and
removing a store's durable files (blocks allocated and written) costs more than removing files
the kernel has not yet written back, so timing it would charge each download with the other
side's durability. A ratio is shardstore's speed over s3fs's in the
same repetition; the table gives the median ratio with its range (of wall time, and of
the whole process's CPU time, which a loaded machine disturbs less), the median speeds,
and the HTTP requests each side sent per operation (counted on each client's botocore
``before-send`` event, retries included). Numbers against moto measure client and server
overhead in one Python process, not S3 itself.

    python benchmarks/bench_s3.py [--mib 96] [--repeat 5] [--threads 16] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import s3fs
import torch
from _moto_process import MotoProcess

import shardstore as ss
from shardstore.ops.transfer import copy_commit

BUCKET = "bench"
MiB = 1024 * 1024


def make_state(total_mib: int) -> dict[str, torch.Tensor]:
    """Tensors of 1, 4 and 16 MiB (float32) adding up to about ``total_mib``."""
    g = torch.Generator().manual_seed(0)
    sizes = [16, 4, 4, 1, 1, 1, 1]
    out: dict[str, torch.Tensor] = {}
    left, i = total_mib, 0
    while left > 0:
        mib = min(sizes[i % len(sizes)], left)
        out[f"layers.{i}.weight"] = torch.randn(mib * MiB // 4, generator=g)
        left -= mib
        i += 1
    return out


class Requests:
    """HTTP requests a botocore client sends, by operation (its ``before-send`` event: one per attempt)."""

    def __init__(self, server: MotoProcess) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.server = server

    def attach(self, client: Any) -> None:
        client.meta.events.register("before-send.s3", self._count)

    def _count(self, request: Any = None, **kwargs: Any) -> None:
        op = str(kwargs.get("event_name", "")).rsplit(".", 1)[-1]
        self.counts[op] += 1

    def during(self, fn: Callable[[], None]) -> tuple[float, float, float, collections.Counter[str], int]:
        """(seconds, CPU seconds of this client process (the side's threads; the other side is
        idle), CPU seconds of the server process, requests sent, requests the server answered)."""
        before = collections.Counter(self.counts)
        server_cpu, server_seen = self.server.stat()
        t, c = time.perf_counter(), time.process_time()
        fn()
        took, cpu = time.perf_counter() - t, time.process_time() - c
        server_cpu_after, server_seen_after = self.server.stat()
        answered = sum((server_seen_after - server_seen).values())
        return took, cpu, server_cpu_after - server_cpu, self.counts - before, answered


def _client(fs: Any) -> Any:
    """The aiobotocore client s3fs made for ``fs`` (made now if it was not yet)."""
    from fsspec.asyn import sync

    return sync(fs.loop, fs.set_session)


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def _show(counts: collections.Counter[str], answered: int) -> str:
    """Requests a client sent, by operation, and how many the server answered meanwhile."""
    sent = sum(counts.values())
    seen = "" if answered == sent else f"; the server answered {answered}"
    return f"{sent} (" + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + seen + ")"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=96, help="payload size in MiB (default 96)")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved repetitions (default 5)")
    ap.add_argument("--threads", type=int, default=16, help="objects in flight on each side (default 16)")
    ap.add_argument("--results", help="write the table into this RESULTS.md (its bench_s3 block)")
    args = ap.parse_args()

    server = MotoProcess()  # the same server for both sides, in a process of its own
    work = tempfile.mkdtemp(prefix="bench-s3-")
    load_before = _load()
    times: dict[str, list[float]] = collections.defaultdict(list)
    cpus: dict[str, list[float]] = collections.defaultdict(list)
    server_cpus: dict[str, list[float]] = collections.defaultdict(list)
    requests: dict[str, collections.Counter[str]] = {}
    answered: dict[str, int] = {}
    try:
        opts: dict[str, Any] = {
            "endpoint_url": server.endpoint,
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"},
        }
        ss_opts = {**opts, "concurrency": args.threads}
        fs = s3fs.S3FileSystem(**opts)
        fs.call_s3("create_bucket", Bucket=BUCKET)
        fs_count, ss_count = Requests(server), Requests(server)
        fs_count.attach(_client(fs))

        local = ss.open_store(os.path.join(work, "src"))
        cid = ss.save(local, make_state(args.mib), step=0, rng=False)
        nbytes = sum(local.object_size(o) or 0 for o in local.objects())
        objects_dir = os.path.join(work, "src", "objects")
        n_objects = len(list(local.objects()))

        uploaded: list[str] = []

        def ss_upload() -> None:
            url = f"s3://{BUCKET}/ss-{uuid.uuid4().hex[:8]}"
            copy_commit(local, ss.open_store(url, **ss_opts), cid, ref="main", threads=args.threads)
            uploaded.append(url)

        def fs_put() -> None:
            prefix = f"{BUCKET}/fs-{uuid.uuid4().hex[:8]}"
            fs.put(objects_dir, f"{prefix}/objects", recursive=True, batch_size=args.threads)
            uploaded.append(f"s3://{prefix}")

        first = ss.open_store(f"s3://{BUCKET}/warm-{uuid.uuid4().hex[:8]}", **ss_opts)
        ss_count.attach(_client(first.storage.fs))  # type: ignore[attr-defined]
        ss_upload()  # warm-up (untimed): connections on both sides; the probe ran as ``first`` was opened
        fs_put()
        remote = ss.open_store(uploaded[0], **ss_opts)  # what the downloads read
        remote_keys = uploaded[0][len("s3://") :] + "/objects"
        keep = set(uploaded[:1])

        downloaded: list[str] = []

        def drop_copies() -> None:
            # untimed, after each repetition: the server holds each size once or twice, not once per
            # repetition, and neither side's download is charged with removing what it wrote
            for url in uploaded:
                if url not in keep:
                    fs.rm(url[len("s3://") :], recursive=True)
            uploaded[:] = [u for u in uploaded if u in keep]
            for dst in downloaded:
                shutil.rmtree(dst)
            downloaded.clear()

        def ss_download() -> None:
            dst = os.path.join(work, f"dl-{uuid.uuid4().hex[:8]}")
            downloaded.append(dst)
            copy_commit(remote, ss.open_store(dst), cid, threads=args.threads)

        def fs_get() -> None:
            dst = os.path.join(work, f"get-{uuid.uuid4().hex[:8]}")
            downloaded.append(dst)
            fs.get(remote_keys, dst, recursive=True, batch_size=args.threads)

        def fs_get_fsync() -> None:
            # the durability a store's download owes its readers: every file and directory fsynced
            dst = os.path.join(work, f"getf-{uuid.uuid4().hex[:8]}")
            downloaded.append(dst)
            fs.get(remote_keys, dst, recursive=True, batch_size=args.threads)
            files = [os.path.join(d, f) for d, _, names in os.walk(dst) for f in names]
            dirs = [d for d, _, _ in os.walk(dst)]
            with ThreadPoolExecutor(max_workers=args.threads) as pool:
                list(pool.map(_fsync, files))
                list(pool.map(_fsync, dirs))

        ss_download()
        fs_get()
        drop_copies()
        cases = (
            ("upload", ("shardstore", ss_count, ss_upload), ("s3fs", fs_count, fs_put)),
            ("download", ("shardstore", ss_count, ss_download), ("s3fs", fs_count, fs_get)),
            ("download", ("shardstore", ss_count, ss_download), ("s3fs + fsync", fs_count, fs_get_fsync)),
        )
        for op, *sides in cases:
            peer = sides[1][0]
            for i in range(args.repeat):
                for who, counter, fn in sides if i % 2 == 0 else sides[::-1]:
                    took, cpu, server_cpu, sent, seen = counter.during(fn)
                    times[f"{op} {who} vs {peer}"].append(took)
                    cpus[f"{op} {who} vs {peer}"].append(cpu)
                    server_cpus[f"{op} {who} vs {peer}"].append(server_cpu)
                    requests[f"{op} {who}"] = sent
                    answered[f"{op} {who}"] = seen
                drop_copies()

        # not timed: the round trip is whole (every object re-hashed from a fresh local copy)
        back = ss.open_store(os.path.join(work, "check"))
        copy_commit(remote, back, cid, ref="main")
        report = ss.verify(back, [cid])
        if not report.ok or report.bytes_hashed < nbytes - 65536:
            raise SystemExit(f"round trip through S3 failed verification: {report.problems[:3]}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    mb = nbytes / 1e6
    server_pid = server.pid
    lines = [
        f"`python benchmarks/bench_s3.py --mib {args.mib} --repeat {args.repeat} --threads {args.threads}`",
        "",
        f"commit {_commit()}; {n_objects} objects, {nbytes / MiB:.1f} MiB; moto {_version('moto')} on 127.0.0.1 "
        f"(a process of its own, pid {server_pid}), s3fs {s3fs.__version__}, aiobotocore {_version('aiobotocore')}, python "
        f"{platform.python_version()}, {os.cpu_count()} cpus; load average (1/5 min) {load_before} at the start, "
        f"{_load()} at the end; {args.repeat} interleaved repetitions, {args.threads} objects in flight on each side.",
        "",
        "| operation | shardstore MB/s (median) | s3fs MB/s (median) | speed ratio, median (min–max) "
        "| client CPU ratio, median (min–max) | client CPU s: shardstore / s3fs (medians) "
        "| server CPU s: shardstore / s3fs (medians) | requests: shardstore | requests: s3fs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for op, peer, label in (
        ("upload", "s3fs", "upload"),
        ("download", "s3fs", "download"),
        ("download", "s3fs + fsync", "download vs s3fs get + fsync of each file"),
    ):
        mine, theirs = f"{op} shardstore vs {peer}", f"{op} {peer} vs {peer}"
        a, b = times[mine], times[theirs]
        ratios = [y / x for x, y in zip(a, b)]
        work = [y / x for x, y in zip(cpus[mine], cpus[theirs])]
        lines.append(
            f"| {label} | {mb / statistics.median(a):.1f} | {mb / statistics.median(b):.1f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) | "
            f"{statistics.median(work):.2f} ({min(work):.2f}–{max(work):.2f}) | "
            f"{statistics.median(cpus[mine]):.3f} / {statistics.median(cpus[theirs]):.3f} | "
            f"{statistics.median(server_cpus[mine]):.3f} / {statistics.median(server_cpus[theirs]):.3f} | "
            f"{_show(requests[f'{op} shardstore'], answered[f'{op} shardstore'])} | "
            f"{_show(requests[f'{op} {peer}'], answered[f'{op} {peer}'])} |"
        )
    lines += [
        "",
        "Ratios are s3fs's time over shardstore's in the same repetition (above 1: shardstore faster); the "
        "client CPU ratio is the same for the CPU time of the benchmark's process (the clients; the server runs "
        "in a process of its own, as S3 is never in its client's process), which a loaded machine disturbs less "
        "than wall time. Server CPU: the moto process's CPU time during each operation. Requests: as each client "
        "sent them (one per attempt), checked against the requests the server answered in the same interval (named "
        "only where the two differ). The last row is a reference, not the target: a "
        "download into a store makes every object durable (fsync) before a manifest names it, plain s3fs get "
        "does not. What each repetition wrote is removed after it, untimed, on both sides.",
    ]
    text = "\n".join(lines)
    print(f"# shardstore imported from {os.path.dirname(ss.__file__)}")
    print(text)
    if args.results:
        from _results import write_block

        write_block(
            args.results,
            "<!-- bench_s3:begin -->",
            "<!-- bench_s3:end -->",
            "## S3 throughput (moto server on 127.0.0.1)",
            text,
        )


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
