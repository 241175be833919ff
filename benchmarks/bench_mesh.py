"""FSDP2 on tensor parallelism, 4 Gloo processes on a 2 x 2 mesh: shardstore against DCP, restored into other meshes.

The model is ``L`` bias-free Linear layers of ``side x side`` float32 (4096 x 4096, 64 MiB each,
from ``--mib 128`` up; smaller sides below that), made tensor parallel on the mesh's ``tp`` dim
with ``parallelize_module`` (even layers ``ColwiseParallel``: weight ``Shard(0)``; odd layers
``RowwiseParallel``: weight ``Shard(1)``) and then ``fully_shard``-ed over ``dp``, so a Colwise
weight is ``(_StridedShard(0, sf=2), Shard(0))`` and a Rowwise one ``(Shard(0), Shard(1))``.
AdamW takes one step so both moments exist; then every parameter and moment is filled with
values drawn from its name (``_dist_bench.fill``): the checkpoint is 3 x ``--mib`` MiB. On the
tile grid (SPEC.md §5.1, format version 4) a 4096 x 4096 float32 tensor is 4 x 4 tiles of
1024 x 1024 (4 MiB), so every split below (quarters of rows, quarters of columns, half by half)
is whole tiles: each rank should read its share and no more. Smaller sides (``--mib`` under
128) have tiles the 4-way splits cut, and tensors of one block that every rank reads whole, so
there the bytes read exceed the share by design (smoke runs only).

Each repetition runs every method once, in a rotated order; a method's time is the slowest
rank's, between two barriers; every rank uses one torch thread.

- save from the 2 x 2 mesh: ``shardstore.save_distributed`` into a fresh store, against
  ``dcp.save(get_state_dict(...))`` (its default ``FileSystemWriter``, which fsyncs) into a
  fresh directory;
- restore, from a cold page cache (``drop_caches`` when root; said otherwise), into models
  already built on three meshes of the same 4 processes: FSDP2 over 4 (every tensor
  ``Shard(0)``: quarters of rows), tensor parallelism over 4 (Colwise ``Shard(0)``, Rowwise
  ``Shard(1)``: quarters of columns), and the 2 x 2 mesh it was saved from; ``shardstore.restore``
  (every block read is verified against its id) against ``dcp.load`` + ``set_state_dict``. After
  each restore every local slice (and ``step``) is compared with the values it must hold, outside
  the timing; a mismatch exits non-zero;
- ``copy --shard K`` (``shardstore.copy_commit(slot=K)``, what the CLI calls), each rank K at
  once, from the last repetition's store: the bytes it read against slot K's share, and the
  copy verified (``verify --shard K``), a failure exiting non-zero.

Bytes are counted at the storage layer (``_dist_bench.CountingStorage``: object reads and
writes, manifests included) and, for both libraries, as the process's read/write system-call
bytes (``/proc/self/io``).

    python benchmarks/bench_mesh.py [--mib 256] [--reps 3] [--results benchmarks/RESULTS.md]
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
from shardstore.format.grid import tile_shape

WORLD = 4
BEGIN, END = "<!-- bench_mesh:begin -->", "<!-- bench_mesh:end -->"
SECTION = "## FSDP2 on tensor parallelism: shardstore vs torch.distributed.checkpoint (4 Gloo processes, 2 × 2 mesh)"
SAVES = ("shardstore.save_distributed", "dcp.save")
SS_RESTORE, DCP_RESTORE = "shardstore.restore (verifies every block)", "dcp.load + set_state_dict"
#: destination name -> how the model is split there; "2d" is the mesh the state was saved from.
DESTS = {"FSDP2 × 4 (Shard(0): row quarters)": "fsdp", "TP × 4 (Colwise Shard(0), Rowwise Shard(1): column quarters)": "tp",
         "2 × 2 (dp, tp): the saving mesh": "2d"}  # fmt: skip
OTHER = [d for d, kind in DESTS.items() if kind != "2d"]  # the targets' "restore into another mesh"


def _layout(mib: int) -> tuple[int, int]:
    """(side, layers): the widest side up to 4096 with at least 2 layers, then as many layers
    as make ``mib`` MiB (at least 1)."""
    side = 4096
    while side > 256 and 2 * side * side * 4 > mib * db.MIB:
        side //= 2
    return side, max(1, round(mib * db.MIB / (side * side * 4)))


def _build(kind: str, side: int, layers: int, mesh2d, line) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """The model split as ``kind`` says (``2d``, ``fsdp``, ``tp``), built on the meta device and
    then given (uninitialised) local storage: ``fill`` writes every value."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(side, side, bias=False) for _ in range(layers)))
    plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(layers)}
    if kind == "2d":
        parallelize_module(model, mesh2d["tp"], plan)
        for layer in model:
            fully_shard(layer, mesh=mesh2d["dp"])
        fully_shard(model, mesh=mesh2d["dp"])
    elif kind == "fsdp":
        for layer in model:
            fully_shard(layer, mesh=line)
        fully_shard(model, mesh=line)
    else:
        parallelize_module(model, line, plan)
    model.to_empty(device="cpu")
    return model, db.adamw_with_moments(model)


def _worker(rank: int, port: int, args: argparse.Namespace, work: str, out: str, drop: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    with db.group(rank, WORLD, port):
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        line = init_device_mesh("cpu", (WORLD,))
        side, layers = _layout(args.mib)
        model, opt = _build("2d", side, layers, mesh2d, line)
        dests = {name: _build(kind, side, layers, mesh2d, line) for name, kind in DESTS.items()}
        wants = dict(zip(dests, db.fill((model, opt), list(dests.values()))))
        timer = db.Timer()
        rec: dict = {"saved_share": db.share(model, opt), "share": {d: db.share(*m) for d, m in dests.items()},
                     "written": [], "written_objects": [], "profile": [], "disk_written": {n: [] for n in SAVES}, "dcp_rank_bytes": [],
                     "read": {d: [] for d in DESTS}, "disk_read": {f"{m} → {d}": [] for d in DESTS for m in (SS_RESTORE, DCP_RESTORE)}}  # fmt: skip
        last: tuple[str, ...] = ()
        db.warm_up(rank, model, opt, work)
        for rep in range(args.reps):
            ss_dir, dcp_dir = os.path.join(work, f"ss-{rep}"), os.path.join(work, f"dcp-{rep}")
            before: dict = {}

            def ss_save() -> None:
                store, counter = db.counted(ss.open_store(ss_dir))
                t0 = time.perf_counter()
                ss.save_distributed(store, model, opt, info=ss.CommitInfo(step=1), rng=False)
                rec["profile"].append(db.exchange_profile(time.perf_counter() - t0))
                rec["written"].append(counter.written_bytes)
                rec["written_objects"].append(counter.written_objects)

            def dcp_save() -> None:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)

            for name, fn in db.rotated(list(zip(SAVES, (ss_save, dcp_save))), rep):
                dist.barrier()
                before = db.io()
                timer(name, fn)
                rec["disk_written"][name].append(db.io_delta(before, "write_bytes"))
            db.fio_limits(timer, rank, WORLD, work, rec["saved_share"], drop)
            rec["dcp_rank_bytes"].append(
                sum(
                    os.path.getsize(os.path.join(dcp_dir, f)) for f in os.listdir(dcp_dir) if f.startswith(f"__{rank}_")
                )
            )
            if rank == 0:
                rec["objects"], rec["dcp_files"] = db.tree_size(os.path.join(ss_dir, "objects")), db.tree_size(dcp_dir)

            def restorer(dest: str, ours: bool):
                return db.restorer(ours, ss_dir, dcp_dir, *dests[dest], rec["read"][dest])

            runs = [(f"{m} → {d}", d, restorer(d, m == SS_RESTORE)) for d in DESTS for m in (SS_RESTORE, DCP_RESTORE)]
            for name, dest, fn in db.rotated(runs, rep):
                db.zero(*dests[dest])
                db.drop(rank, drop)
                dist.barrier()
                before = db.io()
                timer(name, fn)
                rec["disk_read"][name].append(db.io_delta(before, "read_bytes"))
                bad = db.mismatches(*dests[dest], wants[dest])
                if bad:
                    raise SystemExit(
                        f"rank {rank}, {name}: restored state differs from the saved state in {bad[:5]} ({len(bad)} tensors)"
                    )
            dist.barrier()
            if rank == 0 and last:  # the previous repetition's checkpoints (the last one's store is copied below)
                for path in last:
                    shutil.rmtree(path, ignore_errors=True)
            last = (ss_dir, dcp_dir)
        src_store = ss.open_store(last[0], create=False)
        lc = ss.load_commit(src_store, "main")
        rec["manifest_bytes"] = sum(len(src_store.get(o)) for o in [lc.id, *lc.shard_ids.values()])
        source, counter = db.counted(src_store)
        dst = ss.open_store(os.path.join(work, f"slot-{rank}"))
        dist.barrier()
        t0 = time.perf_counter()
        copied = ss.copy_commit(source, dst, lc.id, slot=rank)
        rec["copy"] = {"read": counter.read_bytes, "objects": copied.objects_copied, "s": time.perf_counter() - t0}
        report = ss.verify(dst, [lc.id], slot=rank)
        if not report.ok:
            raise SystemExit(f"rank {rank}: verify --shard {rank} of the copied slot failed: {report}")
        rec["times"] = timer.times
        with open(f"{out}.{rank}", "w") as f:
            json.dump(rec, f)
        dist.barrier()


def _med_mib(xs: list[int | None]) -> str:
    return "—" if not xs or None in xs else db.mib(statistics.median(xs))


def _table(results: list[dict], args: argparse.Namespace, drop: bool, loads: tuple[str, str]) -> str:
    side, layers = _layout(args.mib)
    total = sum(r["saved_share"] for r in results)
    tile = " × ".join(str(t) for t in tile_shape("float32", (side, side)))
    setup = (
        f"{WORLD} Gloo processes (1 torch thread each), saved from a 2 × 2 (dp, tp) mesh: {layers} Linear layers of {side} × {side} "
        f"float32 (tiles {tile}), Colwise/Rowwise on tp then fully_shard on dp; state {total / db.MIB:.0f} MiB (parameters + both AdamW moments)."
    )
    lines = db.report_head("bench_mesh.py", args, loads, drop, setup)
    lines += db.timing_tables(
        results, SAVES, (SS_RESTORE, DCP_RESTORE), list(DESTS), total, "**save** (from the 2 × 2 mesh)"
    )
    med = statistics.median
    lines += ["**bytes per rank** (MiB, medians over the runs): shardstore's counted at the storage layer (object writes and reads, "
              "manifests included); \"disk\": the process's own block-device bytes (/proc/self/io write_bytes, read_bytes: "
              "0 from a warm page cache)", "",
              "| rank | saved share | shardstore written (objects) | shardstore disk written | dcp.save disk written | dcp files of the rank |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for rank, r in enumerate(results):
        ssw, dcpw = r["disk_written"][SAVES[0]], r["disk_written"][SAVES[1]]
        lines.append(f"| {rank} | {db.mib(r['saved_share'])} | {db.mib(med(r['written']))} ({med(r['written_objects']):.0f}) | "
                     f"{_med_mib(ssw)} | {_med_mib(dcpw)} | {db.mib(med(r['dcp_rank_bytes']))} |")  # fmt: skip
    objs, files = results[0]["objects"], results[0]["dcp_files"]
    lines += ["", f"Objects in the shardstore store: {objs[0]} ({objs[1] / db.MIB:.1f} MiB, manifests included; "
              f"{results[0]['manifest_bytes'] / 1024:.1f} KiB of commit and shard manifests); DCP files: {files[0]} ({files[1] / db.MIB:.1f} MiB).", ""]  # fmt: skip
    lines += [
        "| restore into | rank | share | shardstore read (÷ share) | shardstore disk read | dcp disk read |",
        "|---|---|---|---|---|---|",
    ]
    worst: dict[str, float] = {}
    for d in DESTS:
        for rank, r in enumerate(results):
            read, sh = med(r["read"][d]), r["share"][d]
            worst[d] = max(worst.get(d, 0.0), read / sh)
            sr, dr = r["disk_read"][f"{SS_RESTORE} → {d}"], r["disk_read"][f"{DCP_RESTORE} → {d}"]
            lines.append(
                f"| {d} | {rank} | {db.mib(sh)} | {db.mib(read)} ({read / sh:.3f}) | {_med_mib(sr)} | {_med_mib(dr)} |"
            )
    lines += ["", "**copy --shard K** (each rank K at once, from the last run's store; bytes read at the source's storage, manifests included)", "",
              "| K | slot K's share | read (÷ share) | objects copied | s |", "|---|---|---|---|---|"]  # fmt: skip
    copy_worst = 0.0
    for k, r in enumerate(results):
        c = r["copy"]
        copy_worst = max(copy_worst, c["read"] / r["saved_share"])
        lines.append(
            f"| {k} | {db.mib(r['saved_share'])} | {db.mib(c['read'])} ({c['read'] / r['saved_share']:.3f}) | {c['objects']} | {c['s']:.2f} |"
        )
    lines += db.target_rows(results, SAVES, (SS_RESTORE, DCP_RESTORE), OTHER, list(DESTS), worst)
    lines.append(
        f"| copy --shard K reads ≤ 1.25× slot K's share | {copy_worst:.3f}× (worst K) | {db.met(copy_worst <= 1.25)} |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return db.main(
        __doc__,
        _worker,
        WORLD,
        "mesh",
        _table,
        (BEGIN, END, SECTION),
        "MiB of parameters (the checkpoint is 3x this); 4096-wide layers from 128 up",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
