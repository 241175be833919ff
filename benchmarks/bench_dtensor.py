"""FSDP2 state on 2 Gloo processes: shardstore.save_distributed / restore against dcp.save / dcp.load.

One FSDP2 model (``fully_shard`` over 2 ranks, dim-0 slices) of ``--mib`` MiB of float32
parameters in bias-free Linear weights of 2048 x 2048 (16 MiB each). On the tile grid (SPEC.md
§5.1, format version 4) each is 2 x 2 tiles of 1024 x 1024 (4 MiB), so a rank's row half is 2
whole tiles and so is a column half: every restore below should read exactly its share. AdamW
takes one step so both moments exist, then every parameter and moment is filled with values
drawn from its name (``_dist_bench.fill``): the checkpoint is 3 x ``--mib`` MiB. Both ranks run
each method at the same time, interleaved (each repetition runs every method once, in a rotated
order); the time of a method is the slowest rank's, between two barriers; one torch thread each.

- save: ``shardstore.save_distributed`` (hashes every block, one fsync barrier at the end,
  the commit protocol) into a fresh store per repetition (so nothing deduplicates), against
  ``dcp.save`` of ``get_state_dict(model, optimizer)`` (its default ``FileSystemWriter``,
  which fsyncs) into a fresh directory;
- restore from a cold page cache (``drop_caches`` when root; said otherwise) into models and
  optimizers already built on two meshes of the 2 processes: FSDP2 over 2 again (the saving
  mesh: row halves) and tensor parallelism over 2 (every layer ``RowwiseParallel``, its weight
  ``Shard(1)``: column halves, another mesh); ``shardstore.restore`` (every block read is
  verified against its id) against ``dcp.load`` + ``set_state_dict``. After each restore every
  local slice (and ``step``) is compared with the values it must hold (outside the timing; a
  mismatch exits non-zero). Each rank's bytes read are counted at the storage layer (object
  reads, manifests included: ``_dist_bench.CountingStorage``) against its share there.

    python benchmarks/bench_dtensor.py [--mib 256] [--reps 3] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import _dist_bench as db
import torch
import torch.distributed as dist

import shardstore as ss

WORLD = 2
BEGIN, END = "<!-- bench_dtensor:begin -->", "<!-- bench_dtensor:end -->"
SECTION = "## FSDP2 state: shardstore vs torch.distributed.checkpoint (2 Gloo processes)"
SIDE = 2048  # 16 MiB per parameter: 2 x 2 tiles of 1024 x 1024; a rank's row or column half holds 2
SAVES = ("shardstore.save_distributed", "dcp.save")
SS_RESTORE, DCP_RESTORE = "shardstore.restore (verifies every block)", "dcp.load + set_state_dict"
#: destination name -> how the model is split there; "fsdp" is the mesh the state was saved from.
DESTS = {"FSDP2 × 2 (the saving mesh: row halves)": "fsdp", "TP × 2 (RowwiseParallel, Shard(1): column halves)": "tp"}
OTHER = [d for d, kind in DESTS.items() if kind != "fsdp"]  # the targets' "restore into another mesh"


def _build(kind: str, layers: int, mesh) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """The model split as ``kind`` says (``fsdp``, ``tp``), built on the meta device and then
    given (uninitialised) local storage: ``fill`` writes every value."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(SIDE, SIDE, bias=False) for _ in range(layers)))
    if kind == "fsdp":
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh, {str(i): RowwiseParallel() for i in range(layers)})
    model.to_empty(device="cpu")
    return model, db.adamw_with_moments(model)


def _worker(rank: int, port: int, args: argparse.Namespace, work: str, out: str, drop: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    with db.group(rank, WORLD, port):
        mesh = init_device_mesh("cpu", (WORLD,))
        layers = max(1, args.mib // 16)
        model, opt = _build("fsdp", layers, mesh)
        dests = {name: _build(kind, layers, mesh) for name, kind in DESTS.items()}
        wants = dict(zip(dests, db.fill((model, opt), list(dests.values()))))
        timer = db.Timer()
        read: dict[str, list[int]] = {d: [] for d in DESTS}
        profile: list[dict[str, float]] = []

        db.warm_up(rank, model, opt, work)
        for rep in range(args.reps):
            ss_dir, dcp_dir = os.path.join(work, f"ss-{rep}"), os.path.join(work, f"dcp-{rep}")

            def ss_save() -> None:
                store = ss.open_store(ss_dir)
                t0 = time.perf_counter()
                ss.save_distributed(store, model, opt, info=ss.CommitInfo(step=1), rng=False)
                profile.append(db.exchange_profile(time.perf_counter() - t0))

            def dcp_save() -> None:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)

            def restorer(dest: str, ours: bool):
                return db.restorer(ours, ss_dir, dcp_dir, *dests[dest], read[dest])

            for name, fn in db.rotated(list(zip(SAVES, (ss_save, dcp_save))), rep):
                timer(name, fn)
            db.fio_limits(timer, rank, WORLD, work, db.share(model, opt), drop)
            runs = [(f"{m} → {d}", d, restorer(d, m == SS_RESTORE)) for d in DESTS for m in (SS_RESTORE, DCP_RESTORE)]
            for name, dest, fn in db.rotated(runs, rep):
                db.zero(*dests[dest])
                db.drop(rank, drop)
                dist.barrier()
                timer(name, fn)
                bad = db.mismatches(*dests[dest], wants[dest])
                if bad:
                    raise SystemExit(
                        f"rank {rank}, {name}: restored state differs from the saved state in {bad[:5]} ({len(bad)} tensors)"
                    )
            dist.barrier()
            if rank == 0:  # nothing is read from this repetition's checkpoints again
                shutil.rmtree(ss_dir, ignore_errors=True)
                shutil.rmtree(dcp_dir, ignore_errors=True)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(
                {
                    "times": timer.times,
                    "saved_share": db.share(model, opt),
                    "share": {d: db.share(*m) for d, m in dests.items()},
                    "read": read,
                    "profile": profile,
                },
                f,
            )
        dist.barrier()


def _table(results: list[dict], args: argparse.Namespace, drop: bool, loads: tuple[str, str]) -> str:
    total = sum(r["saved_share"] for r in results)
    setup = (
        f"{WORLD} Gloo processes (1 torch thread each), saved from FSDP2 dim-0 slices; {max(1, args.mib // 16)} weight(s) of "
        f"{SIDE} × {SIDE} float32 (tiles 1024 × 1024); state {total / db.MIB:.0f} MiB (parameters + both AdamW moments)."
    )
    lines = db.report_head("bench_dtensor.py", args, loads, drop, setup)
    lines += db.timing_tables(results, SAVES, (SS_RESTORE, DCP_RESTORE), list(DESTS), total, "**save**")
    worst: dict[str, float] = {}
    for d in DESTS:
        reads = [statistics.median(r["read"][d]) for r in results]
        worst[d] = max(b / r["share"][d] for b, r in zip(reads, results))
        lines.append(f"Bytes read by shardstore.restore per rank / that rank's share, into {d} (object reads at the storage layer, manifests included): "
                     + ", ".join(f"{b / db.MIB:.1f} / {r['share'][d] / db.MIB:.1f} MiB" for b, r in zip(reads, results)) + ".")  # fmt: skip
    lines += db.target_rows(results, SAVES, (SS_RESTORE, DCP_RESTORE), OTHER, list(DESTS), worst)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return db.main(
        __doc__,
        _worker,
        WORLD,
        "dtensor",
        _table,
        (BEGIN, END, SECTION),
        "MiB of parameters (the checkpoint is 3x this), in 16 MiB weights",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
