"""What completing each slot's memory tier costs at a commit under FSDP2 (SPEC.md §19.3,
``checkpoint.replicas.complete``): 2 Gloo ranks on loopback, a ``fully_shard``-ed model saved
through write-through tiers, each commit held and replicated as shardtrain's committer does.

Per rank and commit: the save's time, ``complete``'s and ``replicate``'s (``complete`` included),
the slot closure's bytes and the rank's state (parameters and both moments), what its tier lacked
after the save (``lacked``) and received to complete it (``filled``), the bytes sent and received
in all, and those a buddy copied from its host's own tier instead (``local``).

    python benchmarks/bench_tier_complete.py --layers 4 --dim 2048            # tiles align with the split
    python benchmarks/bench_tier_complete.py --layers 1 --dim 1024 --wide 4096  # tiles span both ranks' rows
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model(mesh, layers: int, dim: int, wide: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        if wide:  # a (dim x wide) weight, whose tiles span all its rows, then a (wide x dim) one
            mods += [torch.nn.Linear(wide, dim), torch.nn.LayerNorm(dim), torch.nn.Linear(dim, wide)]
        else:
            mods += [torch.nn.Linear(dim, dim), torch.nn.LayerNorm(dim)]
    top = wide or dim
    m = torch.nn.Sequential(*mods, torch.nn.BatchNorm1d(top), torch.nn.Linear(top, 8))
    for sub in mods:
        if isinstance(sub, torch.nn.Linear):
            fully_shard(sub, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _body(rank: int, world: int, root: str, home: str, out: str, a: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import shardstore as ss
    from shardstore.backends.memory_tier import MemoryTier
    from shardstore.backends.tiers import TieredStorage
    from shardstore.checkpoint import replicas
    from shardstore.format.closure import commit_closure

    mesh = init_device_mesh("cpu", (world,))
    host = os.path.join(home, f"host{rank}")

    def tier_for(slot: int) -> MemoryTier:
        return MemoryTier(host, slot)

    own = tier_for(rank)
    durable = ss.open_store(root)
    store = ss.Store(TieredStorage(durable.storage, [own], fill=own), create=False)
    m = _model(mesh, a.layers, a.dim, a.wide)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    complete_s = [0.0]
    complete = replicas.complete

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return complete(*args, **kwargs)
        finally:
            complete_s[0] = time.perf_counter() - t

    replicas.complete = timed  # type: ignore[assignment]  # this process only
    rows = []
    for step in range(1, a.commits + 1):
        x = torch.randn(16, a.wide or a.dim, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
        dist.barrier()
        t0 = time.perf_counter()
        cid = ss.save_distributed(store, m, opt, info=ss.CommitInfo(step=step), rng=False)
        t1 = time.perf_counter()
        ids = commit_closure(ss.load_commit(store, cid), slot=rank).ids()
        lacked = sum(durable.object_size(o) or 0 for o in ids if not own.has(o))
        own.hold(cid, ids)
        t2 = time.perf_counter()
        rep = replicas.replicate(dist.group.WORLD, slot=rank, commit=cid, objects=ids, own=own, tier_for=tier_for)
        t3 = time.perf_counter()
        rows.append(
            {
                "step": step,
                "save_s": round(t1 - t0, 3),
                "complete_s": round(complete_s[0], 3),
                "replicate_s": round(t3 - t2, 3),
                "closure": sum(durable.object_size(o) or 0 for o in ids),
                "state": sum(p.to_local().numel() * p.element_size() * 3 for p in m.parameters()),
                "lacked": lacked,
                "filled": rep.filled,
                "sent": rep.sent,
                "received": rep.received,
                "local": rep.local,
                "holds": own.holds(cid) is not None,
                "buddy_holds": rep.held,
            }
        )
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)


def _entry(rank: int, world: int, port: int, *args: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        _body(rank, world, *args)  # type: ignore[arg-type]
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--wide", type=int, default=0, help="alternate (dim x wide) and (wide x dim) weights")
    p.add_argument("--commits", type=int, default=3)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="bench-tier-complete-")
    try:
        import shardstore as ss

        root = os.path.join(home, "store")
        ss.open_store(root)
        out = os.path.join(home, "result")
        mp.start_processes(
            _entry, args=(2, port, root, os.path.join(home, "tiers"), out, a), nprocs=2, join=True, start_method="spawn"
        )
        for r in range(2):
            with open(f"{out}.{r}") as f:
                for row in json.load(f):
                    print(json.dumps({"rank": r, **row}))
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
