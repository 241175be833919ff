"""A sharded save's durability, two ways in one run: one fsync barrier after the last batch
(what ``save_distributed`` does, ``store.tensors.WriteBatch``) against the same code made
durable batch by batch (each 64 MiB batch's writes finished right after its blocks are
written: the behaviour before commit 0d3c1a9). 2 Gloo processes, bench_dtensor's FSDP2
model and state, a fresh store each save, the modes interleaved in a rotated order after one
untimed save of each method; the time is the slower rank's, between barriers.

    python benchmarks/compare_durability.py [--mib 256] [--reps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import _dist_bench as db
import bench_dtensor as bd
import torch.distributed as dist

import shardstore as ss
from shardstore.sharded import exchange as ex

orig = ex._exchange  # the exchange's batch as shipped


def per_batch(store, owned, sending, need, g, group, threads, stats, arena, writes):
    """The exchange's batch, then its writes made durable at once (one fsync barrier per batch)."""
    out = orig(store, owned, sending, need, g, group, threads, stats, arena, writes)
    writes.finish(store.storage, threads=threads)
    return out


def worker(rank: int, port: int, work: str, mib: int, reps: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with db.group(rank, 2, port):
        mesh = init_device_mesh("cpu", (2,))
        model, opt = bd._build("fsdp", max(1, mib // 16), mesh)
        db.fill((model, opt), [])
        db.warm_up(rank, model, opt, work)
        times: dict[str, list[float]] = {"one barrier": [], "per batch": []}
        for rep in range(reps):
            for mode in db.rotated(list(times), rep):
                ex._exchange = orig if mode == "one barrier" else per_batch
                d = os.path.join(work, f"{mode.replace(' ', '-')}-{rep}")
                dist.barrier()
                t0 = time.perf_counter()
                ss.save_distributed(ss.open_store(d), model, opt, info=ss.CommitInfo(step=1), rng=False)
                dist.barrier()
                times[mode].append(time.perf_counter() - t0)
                if rank == 0:
                    shutil.rmtree(d, ignore_errors=True)
        ex._exchange = orig
        if rank == 0:
            with open(out, "w") as f:
                json.dump(times, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of parameters (the state is 3x this), in 16 MiB weights")
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    start = db.load()
    work = tempfile.mkdtemp(prefix="bench-durability-", dir=os.path.dirname(db.ROOT))
    out = os.path.join(work, "times.json")
    try:
        db.spawn(worker, 2, (work, args.mib, args.reps, out))
        times = json.load(open(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"`python benchmarks/compare_durability.py --mib {args.mib} --reps {args.reps}`; commit {db.commit()}; "
        f"load average {start} at the start, {db.load()} at the end; state {3 * args.mib} MiB on 2 ranks."
    )
    for mode, ts in times.items():
        print(f"- {mode}: median {statistics.median(ts):.3f} s (runs {', '.join(f'{t:.3f}' for t in ts)})")
    print(
        f"- one barrier is {statistics.median(times['per batch']) / statistics.median(times['one barrier']):.2f}x as fast as per batch"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
