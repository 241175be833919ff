"""Upload and download throughput of a commit through the S3 backend, against plain s3fs.

Not a test. Starts a moto S3 server on 127.0.0.1 (the same server the tests use), saves
one commit of float32 tensors (a mix of small, medium and multipart-sized objects) to a
local store, then measures, on the same bytes and in the same run:

- shardstore upload: ``copy_commit(local, s3)`` (create-only conditional puts, multipart
  above the part size, every object re-hashed before it is written);
- plain s3fs put: ``S3FileSystem.put`` of the local store's object files, recursively;
- shardstore download: ``copy_commit(s3, fresh local)`` (concurrent ranged GETs, hashed in
  order as the ranges stream in);
- plain s3fs get: ``S3FileSystem.get`` of the same keys to a fresh directory.

Each cell is the best of ``--repeat`` runs, each into a fresh prefix or directory.
Prints one table; the server is stopped at the end. Numbers against moto measure client
overhead on top of a Python HTTP server, not S3 itself.

    python benchmarks/bench_s3.py [--mib 96] [--repeat 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable

import s3fs
import torch

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


def best(repeat: int, fn: Callable[[], None]) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=96, help="payload size in MiB (default 96)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    work = tempfile.mkdtemp(prefix="bench-s3-")
    try:
        host, port = server.get_host_and_port()
        opts = {
            "endpoint_url": f"http://{host}:{port}",
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"},
        }
        fs = s3fs.S3FileSystem(**opts)
        fs.call_s3("create_bucket", Bucket=BUCKET)

        local = ss.open_store(os.path.join(work, "src"))
        cid = ss.save(local, make_state(args.mib), step=0, rng=False)
        nbytes = sum(local.object_size(o) or 0 for o in local.objects())
        objects_dir = os.path.join(work, "src", "objects")
        n_objects = len(list(local.objects()))

        uploaded: list[str] = []

        def ss_upload() -> None:
            url = f"s3://{BUCKET}/ss-{uuid.uuid4().hex[:8]}"
            copy_commit(local, ss.open_store(url, **opts), cid, ref="main")
            uploaded.append(url)

        def fs_put() -> None:
            fs.put(objects_dir, f"{BUCKET}/fs-{uuid.uuid4().hex[:8]}/objects", recursive=True)

        up_ss = best(args.repeat, ss_upload)
        up_fs = best(args.repeat, fs_put)
        remote = ss.open_store(uploaded[-1], **opts)
        remote_keys = uploaded[-1][len("s3://") :] + "/objects"

        def ss_download() -> None:
            dst = os.path.join(work, f"dl-{uuid.uuid4().hex[:8]}")
            copy_commit(remote, ss.open_store(dst), cid)
            shutil.rmtree(dst)

        def fs_get() -> None:
            dst = os.path.join(work, f"get-{uuid.uuid4().hex[:8]}")
            fs.get(remote_keys, dst, recursive=True)
            shutil.rmtree(dst)

        down_ss = best(args.repeat, ss_download)
        down_fs = best(args.repeat, fs_get)

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
    print(
        f"# {n_objects} objects, {nbytes / MiB:.1f} MiB, moto {_version('moto')} on 127.0.0.1, s3fs {s3fs.__version__}, "
        f"python {platform.python_version()}, {os.cpu_count()} cpus; best of {args.repeat}"
    )
    print(f"{'operation':<10} {'shardstore MB/s':>16} {'s3fs MB/s':>10} {'ratio':>6}")
    for name, a, b in (("upload", up_ss, up_fs), ("download", down_ss, down_fs)):
        print(f"{name:<10} {mb / a:>16.1f} {mb / b:>10.1f} {b / a:>6.2f}")


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
