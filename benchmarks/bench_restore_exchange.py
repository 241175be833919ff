"""Restore by exchange against the restore on its own, on N Gloo ranks on local disk (SPEC.md §16.2).

    python benchmarks/bench_restore_exchange.py [--world 4] [--tensors 4] [--rows 1024] [--cols 16384] [--reps 3]

Each rank holds a dim-0 slice (FSDP2's ``Shard(0)``) of ``--tensors`` float32 tensors of
``rows x cols`` (default 1024 x 16384, 64 MiB: 16 tiles of 1024 x 1024, each spanning every
row, so a rank's 256 rows cross all 16 and a rank on its own reads the whole tensor, 4x its share). The slices are saved
once (``save_distributed``); then, ``--reps`` times, interleaved (the order alternates per rep),
every rank restores them into fresh DTensors on its own and by exchange (``restore(...,
group=)``), checks them bitwise against what it saved, and records: the bytes of objects it
read (counted at the storage layer), its wall time between two barriers and its process CPU
time (all threads). The table: per method, the slowest rank's wall time (median over reps),
the ranks' CPU time summed (median), and the bytes read per rank (min-max, MiB). The page cache
is warm (the store was just written; nothing is dropped): this measures CPU and copies, not disk.

    python benchmarks/bench_restore_exchange.py --plan 8B --ranks 32,256,2048

``--plan``: no processes; one rank's planning alone, for a ``bench_scale_sim`` model restored into
each N dp-only (float32 parameters and both moments, torch.chunk's rows): every rank's
description built, encoded and decoded as the all-gather delivers it, then ``plan_group_read``
for rank 0 (process CPU time of each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from _dist_bench import MIB, CountingStorage, group, spawn

import shardstore as ss


def _worker(rank: int, port: int, world: int, root: str, out: str, args: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    with group(rank, world, port):
        mesh = init_device_mesh("cpu", (world,))
        rows, cols = args["rows"], args["cols"]
        share = rows // world
        g = torch.Generator().manual_seed(1000 + rank)
        mine = {f"t{i}": torch.randn(share, cols, generator=g) for i in range(args["tensors"])}
        saved = {k: DTensor.from_local(v, mesh, (Shard(0),), run_check=False) for k, v in mine.items()}
        store = ss.open_store(root)
        cid = ss.save_distributed(store, saved, None, info=ss.CommitInfo(step=0, job="bench"), rng=False, ref="main")
        del saved
        records = []
        for rep in range(args["reps"]):
            order = ("alone", "exchange") if rep % 2 == 0 else ("exchange", "alone")
            for how in order:
                dests = {
                    k: DTensor.from_local(torch.empty(share, cols), mesh, (Shard(0),), run_check=False) for k in mine
                }
                counter = CountingStorage(store.storage)
                counted = ss.Store(counter, create=False)
                dist.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                ss.restore(counted, cid, dests, group=dist.group.WORLD if how == "exchange" else None)
                w1, c1 = time.perf_counter(), time.process_time()
                dist.barrier()
                ok = all(torch.equal(dests[k].to_local(), mine[k]) for k in mine)
                records.append(
                    {
                        "how": how,
                        "rep": rep,
                        "wall": w1 - w0,
                        "cpu": c1 - c0,
                        "read": counter.read_bytes,
                        "objects": counter.read_objects,
                        "ok": ok,
                    }
                )
                del dests
        with open(f"{out}.{rank}", "w") as f:
            json.dump(records, f)


def plan_times(key: str, ns: list[int]) -> None:
    """``--plan``: decode and plan CPU time of rank 0 for model ``key`` into each of ``ns`` ranks."""
    import zlib

    import bench_scale_sim as sim
    import msgspec

    from shardstore.sharded.read_exchange import TILES, Needed, plan_group_read

    model = sim.MODELS[key]
    print(f"{model.name}: one rank's restore-by-exchange plan (CPU seconds), load {os.getloadavg()[0]:.2f}")
    print("| ranks | descriptions, each rank (KiB) | decode all | plan, rank 0 | blocks | rank 0's pieces |")
    print("|---|---|---|---|---|---|")
    for n in ns:
        peers: list[list[Needed]] = [[] for _ in range(n)]
        for name, shape, _ in model.tensors(model.layers):
            for role in sim.ROLES:
                k = format(zlib.crc32(f"{name}\0{role}".encode()), "064x")  # stands for the payload's digest
                c = -(-shape[0] // n)
                for r in range(n):
                    if r * c >= shape[0]:
                        break
                    box = ((r * c,) + (0,) * (len(shape) - 1), (min(c, shape[0] - r * c), *shape[1:]))
                    peers[r].append(Needed(k, TILES, "float32", shape, (box,)))
        raw = [msgspec.json.encode(sorted(p, key=lambda x: x.key)) for p in peers]
        dec = msgspec.json.Decoder(list[Needed])
        t0 = time.process_time()
        got = [dec.decode(x) for x in raw]
        t1 = time.process_time()
        plan = plan_group_read(got, 0)
        t2 = time.process_time()
        print(
            f"| {n:,} | {len(raw[0]) / 1024:.1f} | {t1 - t0:.2f} s | {t2 - t1:.2f} s | {len(plan):,} | "
            f"{sum(len(p.pieces) for p in plan):,} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--tensors", type=int, default=4)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=16384)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the store goes (default: a temporary directory)")
    p.add_argument("--plan", default=None, help="a bench_scale_sim model (8B, 70B, 405B): time one rank's plan only")
    p.add_argument("--ranks", default="32,256,2048", help="with --plan: the ranks restored into, comma-separated")
    a = p.parse_args()
    if a.plan:
        plan_times(a.plan, [int(x) for x in a.ranks.split(",")])
        return
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root, out = os.path.join(tmp, "store"), os.path.join(tmp, "result")
        ss.open_store(root)
        load0 = os.getloadavg()
        spawn(_worker, a.world, (a.world, root, out, vars(a)))
        load1 = os.getloadavg()
        ranks = []
        for r in range(a.world):
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
    if not all(rec["ok"] for recs in ranks for rec in recs):
        raise SystemExit("a restored tensor differs from what was saved")
    share = a.tensors * a.rows * a.cols * 4 // a.world
    print(f"{a.world} ranks, {a.tensors} x float32[{a.rows}, {a.cols}] Shard(0); share per rank {share / MIB:.0f} MiB")
    print(f"load average {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f} at start, {load1[0]:.2f}/{load1[1]:.2f} at end")
    print(
        "| method | wall, slowest rank (median s) | CPU, all ranks (median s) | read per rank (MiB) | objects read per rank |"
    )
    print("|---|---|---|---|---|")
    for how in ("alone", "exchange"):
        walls, cpus, reads, objs = [], [], [], []
        for rep in range(a.reps):
            recs = [next(x for x in recs if x["how"] == how and x["rep"] == rep) for recs in ranks]
            walls.append(max(x["wall"] for x in recs))
            cpus.append(sum(x["cpu"] for x in recs))
            reads += [x["read"] / MIB for x in recs]
            objs += [x["objects"] for x in recs]
        print(
            f"| {how} | {statistics.median(walls):.3f} ({', '.join(f'{w:.3f}' for w in walls)}) "
            f"| {statistics.median(cpus):.3f} ({', '.join(f'{c:.3f}' for c in cpus)}) "
            f"| {min(reads):.1f}–{max(reads):.1f} | {min(objs)}–{max(objs)} |"
        )


if __name__ == "__main__":
    main()
