"""Wall-clock timeline of cold ``dcp.load``s on 2 Gloo ranks: where a load's time goes, and
whether the block device is busy through it (issue 34 item 5; benchmarks/RESULTS.md, "Where a
cold one-thread load waits").

The state, model and saves are ``bench_dcp.py``'s (FSDP2 on 2 ranks, ``--mib`` MiB of
parameters, 3 x that with both AdamW moments); each repetition loads it once with every reader of
``--methods``, in a rotated order, the page cache dropped before each (as root: required):

- ``ss1`` / ``ss2``: ``dcp.load`` through ``StoreReader(thread_count=1 / 2)``;
- ``fs``: through ``FileSystemReader`` (which reads on the calling thread).

A separate process samples the block device holding the scratch directory (``/sys/dev/block/
MAJ:MIN/stat``) every 2 ms; each rank marks, on the shared monotonic clock, the phases of its
load (``read_metadata``, ``prepare_local_plan``, ``read_data`` and within it the size checks and
the reads; the end of ``dcp.load`` and of ``set_state_dict``) and every object read
(``read_exact``: one block's ``readv``s and hashing). Printed per load: its wall time (first
rank's start to last rank's end), when the device first and last read, the bytes it read, its
busy time (``io_ticks``), the average request size and the mean number of requests in flight,
and the share of samples with none in flight; per rank: its CPU time (``os.times``: user +
system, and the system part), each phase's start in ms from the load's start, and the time
between object reads (the reading thread's work outside ``read_exact``: copies, read-ahead calls,
bookkeeping). To compare two trees, run it from each (another checkout's ``shardstore`` first on
``PYTHONPATH``), alternating.

The probes (wrapped methods and the sampler) cost CPU of their own: compare loads within one run.

    python benchmarks/dcp_load_timeline.py [--mib 256] [--reps 3] [--methods ss1,fs]
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _dist_bench as db
import bench_dcp as bd
import torch

WORLD = 2
#: Run in a child process (argv: the stat file, the output file, the stop file): one line per
#: sample, the monotonic time then the stat file's fields (SPEC of /sys/block/*/stat: read I/Os,
#: read merges, sectors read, read ticks, 4 write fields, in flight, io_ticks, ...).
_SAMPLER = r"""
import os, sys, time
stat, out, stop = sys.argv[1:4]
with open(out, "w") as f:
    while not os.path.exists(stop):
        with open(stat) as s:
            f.write(f"{time.monotonic():.6f} {s.read().strip()}\n")
        time.sleep(0.002)
"""
#: Each rank's marks, in order, as (name, monotonic time); "<" starts a phase, ">" ends it.
MARKS: list[tuple[str, float]] = []
PHASES = (
    "ss.meta<",
    "fs.meta<",
    "ss.plan<",
    "ss.data<",
    "ss.check<",
    "ss.check>",
    "ss.run<",
    "ss.data>",
    "fs.data<",
    "fs.data>",
    "load>",
    "set>",
)


def mark(name: str) -> None:
    MARKS.append((name, time.monotonic()))


def _wrap(owner: Any, attr: str, label: str) -> None:
    fn: Callable[..., Any] = getattr(owner, attr)

    @functools.wraps(fn)
    def marked(*a: Any, **k: Any) -> Any:
        mark(label + "<")
        try:
            return fn(*a, **k)
        finally:
            mark(label + ">")

    setattr(owner, attr, marked)


def _worker(rank: int, port: int, args: argparse.Namespace, work: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import shardstore.backends.local as local
    import shardstore.dcp.reader as reader
    from shardstore.dcp import StoreReader, StoreWriter

    for owner, attr, label in (
        (StoreReader, "read_metadata", "ss.meta"),
        (StoreReader, "prepare_local_plan", "ss.plan"),
        (StoreReader, "read_data", "ss.data"),
        (reader, "check_reads", "ss.check"),
        (reader, "run_reads", "ss.run"),
        (local, "read_exact", "blk"),
        (dcp.FileSystemReader, "read_metadata", "fs.meta"),
        (dcp.FileSystemReader, "read_data", "fs.data"),
    ):
        _wrap(owner, attr, label)
    with db.group(rank, WORLD, port):
        mesh = init_device_mesh("cpu", (WORLD,))
        layers = max(2, args.mib // 16)
        model, opt = bd._build(layers, mesh)
        dest = bd._build(layers, mesh)
        (want,) = db.fill((model, opt), [dest])

        def state(m: torch.nn.Module, o: torch.optim.Optimizer) -> dict:
            msd, osd = get_state_dict(m, o)
            return {"model": msd, "optim": osd}

        ss_dir, fs_dir = os.path.join(work, "ss"), os.path.join(work, "fs")
        dcp.save(state(model, opt), storage_writer=StoreWriter(ss_dir, step=1, thread_count=2))
        dcp.save(state(model, opt), storage_writer=dcp.FileSystemWriter(fs_dir, thread_count=2))
        runs = []
        for rep in range(args.reps):
            for name in db.rotated(args.methods.split(","), rep):
                db.zero(*dest)
                db.drop(rank, True)
                dist.barrier()
                MARKS.clear()
                c0, t0 = os.times(), time.monotonic()
                sd = state(*dest)
                if name == "fs":
                    storage: dcp.StorageReader = dcp.FileSystemReader(fs_dir)
                else:
                    storage = StoreReader(ss_dir, thread_count=int(name.removeprefix("ss")))
                dcp.load(sd, storage_reader=storage)
                mark("load>")
                set_state_dict(*dest, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
                mark("set>")
                t1, c1 = time.monotonic(), os.times()
                dist.barrier()
                user, system = c1.user - c0.user, c1.system - c0.system
                runs.append({"name": name, "t0": t0, "t1": t1, "user": user, "sys": system, "marks": list(MARKS)})
                bad = db.mismatches(*dest, want)
                if bad:
                    raise SystemExit(f"rank {rank}, {name}: loaded state differs in {bad[:5]}")
        with open(f"{out}.{rank}", "w") as f:
            json.dump(runs, f)
        dist.barrier()


def _device_stat(path: str) -> str:
    st = os.stat(path)
    return f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"


def _report(ranks: list[list[dict]], samples: list[list[float]]) -> list[str]:
    times = [s[0] for s in samples]

    def at(t: float) -> list[float]:
        return samples[max(0, bisect.bisect_right(times, t) - 1)]

    lines = []
    for runs in zip(*ranks):
        t0, t1 = min(r["t0"] for r in runs), max(r["t1"] for r in runs)
        window = samples[max(0, bisect.bisect_right(times, t0) - 1) : bisect.bisect_right(times, t1) + 1]
        moved = [b[0] for a, b in zip(window, window[1:]) if b[3] > a[3]]  # sectors read rose
        a, b = at(t0), at(t1)
        sectors, requests = b[3] - a[3], max(1.0, b[1] - a[1])
        in_flight = [s[9] for s in window] or [0.0]
        first = f"+{1000 * (moved[0] - t0):.0f}" if moved else "-"
        last = f"+{1000 * (moved[-1] - t0):.0f}" if moved else "-"
        lines.append(
            f"{runs[0]['name']:4} wall {1000 * (t1 - t0):5.0f} ms | device: reads {first}..{last} ms, "
            f"{sectors * 512 / 1e6:.0f} MB, busy {b[10] - a[10]:.0f} ms, requests {sectors / 2 / requests:.0f} KiB, "
            f"in flight mean {sum(in_flight) / len(in_flight):.1f}, none {sum(x == 0 for x in in_flight) / len(in_flight):.2f}"
        )
        for r in runs:
            first_at: dict[str, float] = {}
            for name, t in r["marks"]:
                first_at.setdefault(name, 1000 * (t - t0))
            reads = [(1000 * (t - t0), n) for n, t in r["marks"] if n.startswith("blk")]
            spans = list(zip(reads[::2], reads[1::2]))
            gaps = [s[0][0] - p[1][0] for p, s in zip(spans, spans[1:])]
            phases = " ".join(f"{k}{first_at[k]:.0f}" for k in PHASES if k in first_at)
            between = f" | {len(spans)} reads, {sum(gaps):.0f} ms between them" if spans else ""
            cpu = f"cpu {1000 * (r['user'] + r['sys']):.0f} ms (sys {1000 * r['sys']:.0f})"
            lines.append(f"    {cpu}  {phases}{between}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of parameters (the checkpoint is 3x this)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default="ss1,fs", help="comma-separated: ss1, ss2 (StoreReader threads), fs")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir beside the repository)")
    args = ap.parse_args(argv)
    if not db.can_drop():
        ap.error("the page cache is dropped before each load: run as root")
    work = tempfile.mkdtemp(prefix="timeline-dcp-", dir=args.dir or os.path.dirname(db.ROOT))
    stop, disk = os.path.join(work, "stop"), os.path.join(work, "device")
    sampler = subprocess.Popen([sys.executable, "-c", _SAMPLER, _device_stat(work), disk, stop])
    try:
        db.spawn(_worker, WORLD, (args, work, os.path.join(work, "result")))
        open(stop, "w").close()
        sampler.wait()
        ranks = [json.load(open(os.path.join(work, f"result.{r}"))) for r in range(WORLD)]
        samples = [[float(x) for x in line.split()] for line in open(disk)]
        print("\n".join(_report(ranks, samples)))
    finally:
        if sampler.poll() is None:
            sampler.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
