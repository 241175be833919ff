"""shardstore as DCP's storage layer on 2 Gloo processes: StoreWriter / StoreReader against DCP's
own FileSystemWriter / FileSystemReader, both under ``dcp.save`` / ``dcp.load``.

One FSDP2 model (``fully_shard`` over 2 ranks, dim-0 slices) of ``--mib`` MiB of float32 parameters
in bias-free Linear weights of 2048 x 2048 (16 MiB each); AdamW takes one step so both moments
exist, then every parameter and moment is filled with values drawn from its name
(``_dist_bench.fill``): the state DCP saves is 3 x ``--mib`` MiB (``get_state_dict``). Each
rank's chunk of a weight is 1024 x 2048 (8 MiB), stored by StoreWriter as 2 tiles of 1024 x 1024.
Both ranks run each method at the same time, interleaved (each repetition runs every method once,
in a rotated order); a method's time is the slowest rank's, between two barriers; one torch
thread each.

- save: ``dcp.save`` through ``StoreWriter(thread_count=T)`` (hashes every byte, writes
  create-only, one fsync barrier per rank, the commit and its ref moved by compare-and-swap)
  into a fresh store per repetition, against ``FileSystemWriter(thread_count=T)`` (which fsyncs)
  into a fresh directory; ``T`` is ``--threads`` for both;
- a second save with half the state frozen: the second half of the layers (their weights and
  both moments) is changed, the first half left as it was, and each writer saves again into the
  same store / a fresh directory: StoreWriter's object bytes written are counted at the storage
  layer (``_dist_bench.CountingStorage``) against the changed half;
- load into the same FSDP2 model (zeroed first; the page cache dropped as root, unless
  ``--warm``): ``dcp.load`` through ``StoreReader(thread_count=1)`` (every block read verified
  against its id) against ``FileSystemReader`` (which reads on the calling thread: it has no
  thread count), each then ``set_state_dict``; and ``StoreReader(thread_count=T)`` and
  ``StoreReader()`` (its default thread count: default against default) beside them; every local
  slice is compared with the values it must hold (outside the timing; a mismatch exits non-zero).

    python benchmarks/bench_dcp.py [--mib 256] [--reps 3] [--threads 2] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import sys

import _dist_bench as db
import torch
import torch.distributed as dist

import shardstore as ss

WORLD = 2
BEGIN, END = "<!-- bench_dcp:begin -->", "<!-- bench_dcp:end -->"
SECTION = "## DCP's storage layer: StoreWriter / StoreReader vs FileSystemWriter / FileSystemReader (2 Gloo processes)"
SIDE = 2048
SAVES = ("dcp.save → StoreWriter", "dcp.save → FileSystemWriter")
RESAVES = ("half frozen: dcp.save → StoreWriter (same store)", "half frozen: dcp.save → FileSystemWriter")
LOADS = ("dcp.load ← StoreReader, 1 thread (verifies every block)", "dcp.load ← FileSystemReader")
#: StoreReader at the writers' thread count as well (FileSystemReader has no thread count: it reads on one).
THREADED = "dcp.load ← StoreReader, --threads threads"
#: StoreReader as constructed without a thread_count, against FileSystemReader as constructed: default vs default.
DEFAULT = "dcp.load ← StoreReader, its default thread_count"


def _default_threads() -> int:
    from shardstore.dcp import StoreReader

    return int(inspect.signature(StoreReader).parameters["thread_count"].default)


def _build(layers: int, mesh) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(SIDE, SIDE, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model, db.adamw_with_moments(model)


def _change_half(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Change the second half of the layers (weights and both moments); return this rank's bytes changed."""
    n = 0
    with torch.no_grad():
        for layer in list(model)[len(model) // 2 :]:
            p = layer.weight
            for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]):
                local = t.to_local()
                local.add_(1.0)
                n += local.numel() * local.element_size()
    return n


def _worker(rank: int, port: int, args: argparse.Namespace, work: str, out: str, drop: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from shardstore.dcp import StoreReader, StoreWriter

    with db.group(rank, WORLD, port):
        mesh = init_device_mesh("cpu", (WORLD,))
        layers = max(2, args.mib // 16)
        model, opt = _build(layers, mesh)
        dest = _build(layers, mesh)
        (want,) = db.fill((model, opt), [dest])
        timer = db.Timer()
        written: list[int] = []
        changed = 0

        def state(m, o) -> dict:
            msd, osd = get_state_dict(m, o)
            return {"model": msd, "optim": osd}

        db.warm_up(rank, model, opt, work)
        for rep in range(args.reps):
            ss_dir, fs_dir, fs2_dir = (os.path.join(work, f"{k}-{rep}") for k in ("ss", "fs", "fs2"))
            if rep:  # each repetition saves the state as it was filled: undo the last one's change
                (want,) = db.fill((model, opt), [dest])

            def ss_save() -> None:
                dcp.save(state(model, opt), storage_writer=StoreWriter(ss_dir, step=1, thread_count=args.threads))

            def fs_save(path: str) -> None:
                dcp.save(state(model, opt), storage_writer=dcp.FileSystemWriter(path, thread_count=args.threads))

            for name, fn in db.rotated(list(zip(SAVES, (ss_save, lambda: fs_save(fs_dir)))), rep):
                timer(name, fn)

            loads = [(LOADS[0], 1), (LOADS[1], 0), (THREADED, args.threads), (DEFAULT, -1)]
            for name, threads in db.rotated(loads, rep):
                db.zero(*dest)
                db.drop(rank, drop)
                dist.barrier()

                def load(threads: int = threads) -> None:
                    sd = state(*dest)
                    if threads < 0:  # as constructed without a thread_count
                        reader: dcp.StorageReader = StoreReader(ss_dir)
                    else:
                        reader = StoreReader(ss_dir, thread_count=threads) if threads else dcp.FileSystemReader(fs_dir)
                    dcp.load(sd, storage_reader=reader)
                    set_state_dict(*dest, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

                timer(name, load)
                bad = db.mismatches(*dest, want)
                if bad:
                    raise SystemExit(f"rank {rank}, {name}: loaded state differs in {bad[:5]} ({len(bad)} tensors)")

            changed = _change_half(model, opt)
            store, counter = db.counted(ss.open_store(ss_dir))

            def ss_resave() -> None:
                dcp.save(state(model, opt), storage_writer=StoreWriter(store, step=2, thread_count=args.threads))

            for name, fn in db.rotated(list(zip(RESAVES, (ss_resave, lambda: fs_save(fs2_dir)))), rep):
                timer(name, fn)
            written.append(counter.written_bytes)
            dist.barrier()
            if rank == 0:
                for d in (ss_dir, fs_dir, fs2_dir):
                    shutil.rmtree(d, ignore_errors=True)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(
                {"times": dict(timer.times), "share": db.share(model, opt), "written": written, "changed": changed}, f
            )
        dist.barrier()


def _table(results: list[dict], args: argparse.Namespace, drop: bool, loads: tuple[str, str]) -> str:
    total = sum(r["share"] for r in results)
    setup = (
        f"{WORLD} Gloo processes (1 torch thread each), FSDP2 dim-0 slices; {max(2, args.mib // 16)} weights of "
        f"{SIDE} × {SIDE} float32; state {total / db.MIB:.0f} MiB (parameters + both AdamW moments); "
        f"writers' thread_count {args.threads}; readers' 1 (FileSystemReader reads on the calling thread), and "
        f"StoreReader's {args.threads} as well."
    )
    lines = db.report_head("bench_dcp.py", args, loads, drop, setup)
    lines[0] = lines[0][:-1] + f" --threads {args.threads}`"
    for title, pair in (
        ("**save**", SAVES),
        ("**load** (then set_state_dict)", LOADS),
        ("**second save, half frozen**", RESAVES),
    ):
        lines += [title, "", *db.method_table(results, *pair, total), ""]
        if pair == LOADS:  # StoreReader at the writers' thread count and at its default too, beside the pair
            for name, label in (
                (THREADED, f"{args.threads} threads"),
                (DEFAULT, f"default ({_default_threads()} threads)"),
            ):
                ts = db.slowest(results, name)
                med = statistics.median(ts)
                row = f"| StoreReader, {label} | {med:.3f} ({min(ts):.3f}–{max(ts):.3f}) | {total / med / 1e9:.2f}"
                lines.insert(-1, f"{row} | {db.ratio(results, name, LOADS[1]):.2f} |")
    changed = sum(r["changed"] for r in results)
    written = [sum(r["written"][i] for r in results) for i in range(len(results[0]["written"]))]
    lines.append(
        "Second save, object bytes StoreWriter wrote (both ranks, counted at the storage layer, manifests included): "
        + ", ".join(f"{w / db.MIB:.2f} MiB" for w in written)
        + f" per repetition; the changed half is {changed / db.MIB:.2f} MiB, the frozen half "
        f"{(total - changed) / db.MIB:.2f} MiB (FileSystemWriter writes all {total / db.MIB:.0f} MiB again)."
    )
    save, load = db.ratio(results, *SAVES), db.ratio(results, *LOADS)
    threaded, default = db.ratio(results, THREADED, LOADS[1]), db.ratio(results, DEFAULT, LOADS[1])
    frozen_written = max(0, statistics.median(written) - changed)
    lines += [
        "",
        "**targets** (issue 34)",
        "",
        "| target | figure | met |",
        "|---|---|---|",
        f"| save ≥ 1.0× FileSystemWriter (median) | {save:.2f}× | {db.met(save >= 1.0)} |",
        f"| load ≥ 1.0× FileSystemReader (median), both on one thread | {load:.2f}× | {db.met(load >= 1.0)} |",
        f"| load ≥ 1.0× FileSystemReader (median), at {args.threads} threads | {threaded:.2f}× | {db.met(threaded >= 1.0)} |",
        f"| load ≥ 1.0× FileSystemReader (median), each as constructed by default (StoreReader "
        f"{_default_threads()} threads, FileSystemReader the calling thread) | {default:.2f}× | {db.met(default >= 1.0)} |",
        f"| the frozen half written zero times (bytes written beyond the changed half: manifests only) | "
        f"{frozen_written / 1024:.1f} KiB beyond it | {db.met(frozen_written < 1 << 20)} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    def options(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--threads", type=int, default=2, help="thread_count of both writers (default 2)")

    return db.main(
        __doc__,
        _worker,
        WORLD,
        "dcp",
        _table,
        (BEGIN, END, SECTION),
        "MiB of parameters (the checkpoint is 3x this), in 16 MiB weights",
        argv,
        options,
    )


if __name__ == "__main__":
    sys.exit(main())
