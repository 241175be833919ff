"""FSDP2 state on 2 Gloo processes: shardstore.save_distributed / restore against dcp.save / dcp.load.

One FSDP2 model (``fully_shard`` over 2 ranks, dim-0 slices) of ``--mib`` MiB of float32
parameters in tensors of 256 x 16384 (16 MiB: 4 canonical blocks of 64 rows, so each rank's
slice is 2 whole blocks), with AdamW moments filled in by one step: the
checkpoint is parameters plus both moments, 3 x ``--mib`` MiB in all. Both ranks run each
method at the same time, interleaved (each repetition runs every method once, in a
rotated order); the time of a method is the slowest rank's, between two barriers.

- save: ``shardstore.save_distributed`` (hashes every block, one fsync barrier per batch,
  the commit protocol) into a fresh store per repetition (so nothing deduplicates), against
  ``dcp.save`` of ``get_state_dict(model, optimizer)`` (its default ``FileSystemWriter``,
  which fsyncs) into a fresh directory;
- restore from a cold page cache (``drop_caches`` when root; said otherwise) into a second,
  already-built FSDP2 model and optimizer: ``shardstore.restore`` (every block read is
  verified against its id) against ``dcp.load`` + ``set_state_dict``. After each restore
  every local slice is compared with the saved state (outside the timing; a mismatch exits
  non-zero).

    python benchmarks/bench_dtensor.py [--mib 256] [--reps 3] [--results benchmarks/RESULTS.md]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch._dynamo  # noqa: F401  before any group (see shardtrain.workers.launch)
import torch.distributed as dist
import torch.multiprocessing as mp

import shardstore as ss

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- bench_dtensor:begin -->", "<!-- bench_dtensor:end -->"
SECTION = "## FSDP2 state: shardstore vs torch.distributed.checkpoint (2 Gloo processes)"
COLS, ROWS = 16384, 256  # 16 MiB per parameter: 4 blocks of 64 rows; 2 ranks hold 2 each


def _model(mib: int, mesh) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    from torch.distributed.fsdp import fully_shard

    n = max(1, mib // 16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(COLS, ROWS, bias=False) for _ in range(n)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def _locals(model, opt) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out += [p.to_local(), opt.state[p]["exp_avg"].to_local(), opt.state[p]["exp_avg_sq"].to_local()]
    return out


def _zero(model, opt) -> None:
    with torch.no_grad():
        for t in _locals(model, opt):
            t.zero_()


def _drop(rank: int, drop: bool) -> None:
    if drop and rank == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def _worker(rank: int, port: int, args: argparse.Namespace, work: str, out: str, drop: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    try:
        mesh = init_device_mesh("cpu", (2,))
        model, opt = _model(args.mib, mesh)
        dest, dopt = _model(args.mib, mesh)
        want = [t.clone() for t in _locals(model, opt)]
        times: dict[str, list[float]] = {}
        read: list[int] = []

        def timed(name: str, fn) -> None:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times.setdefault(name, []).append(time.perf_counter() - t0)

        def check(what: str) -> None:
            got = _locals(dest, dopt)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                raise SystemExit(f"{what}: restored state differs from the saved state")

        for rep in range(args.reps):
            ss_dir, dcp_dir = os.path.join(work, f"ss-{rep}"), os.path.join(work, f"dcp-{rep}")

            def ss_save() -> None:
                store = ss.open_store(ss_dir)
                ss.save_distributed(store, model, opt, info=ss.CommitInfo(step=1), rng=False)

            def dcp_save() -> None:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)

            def ss_restore() -> None:
                read.append(ss.restore(ss.open_store(ss_dir, create=False), "main", dest, dopt).bytes_read)

            def dcp_restore() -> None:
                msd, osd = get_state_dict(dest, dopt)
                sd = {"model": msd, "optim": osd}
                dcp.load(sd, checkpoint_id=dcp_dir)
                set_state_dict(dest, dopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

            saves = [("shardstore.save_distributed", ss_save), ("dcp.save", dcp_save)]
            restores = [("shardstore.restore (verifies every block)", ss_restore), ("dcp.load + set_state_dict", dcp_restore)]
            if rep % 2:
                saves.reverse()
                restores.reverse()
            for name, fn in saves:
                timed(name, fn)
            for name, fn in restores:
                _zero(dest, dopt)
                if rank == 0:
                    _drop(rank, drop)
                dist.barrier()
                timed(name, fn)
                check(name)
        share = sum(t.numel() * t.element_size() for t in want)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"times": times, "share": share, "read": read}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_drop() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def _table(results: list[dict], mib: int, reps: int, drop: bool) -> str:
    total = sum(r["share"] for r in results)
    ranks = len(results)
    slowest = {k: [max(r["times"][k][i] for r in results) for i in range(reps)] for k in results[0]["times"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = [
        f"`python benchmarks/bench_dtensor.py --mib {mib} --reps {reps}`",
        "",
        f"commit {commit}; {os.cpu_count()} cores; torch {torch.__version__}; shardstore {ss.__version__}; "
        f"{ranks} Gloo processes, FSDP2 dim-0 slices; state {total / MIB:.0f} MiB (parameters + both AdamW moments).",
        "Page cache before each restore: " + ("dropped (as root)." if drop else "NOT dropped: restores read warm pages."),
        f"Medians of {reps} interleaved runs (min–max); the time is the slower rank's; ratios are shardstore's speed over DCP's.",
        "",
    ]
    for op, ours, peer in (("save", "shardstore.save_distributed", "dcp.save"),
                           ("restore", "shardstore.restore (verifies every block)", "dcp.load + set_state_dict")):
        lines += [f"**{op}**", "", "| method | median s (min–max) | GB/s median | shardstore ÷ DCP |", "|---|---|---|---|"]
        for name in (ours, peer):
            ts = slowest[name]
            med = statistics.median(ts)
            ratio = statistics.median(slowest[peer]) / statistics.median(slowest[ours])
            lines.append(f"| {name} | {med:.3f} ({min(ts):.3f}–{max(ts):.3f}) | {total / med / 1e9:.2f} | {ratio:.2f} |" if name == ours
                         else f"| {name} | {med:.3f} ({min(ts):.3f}–{max(ts):.3f}) | {total / med / 1e9:.2f} | 1.00 |")
        lines.append("")
    read = [statistics.median(r["read"]) for r in results]
    lines.append("Bytes read by shardstore.restore per rank / that rank's share: "
                 + ", ".join(f"{b / MIB:.1f} / {r['share'] / MIB:.1f} MiB" for b, r in zip(read, results)) + ".")
    return "\n".join(lines)


def _write(path: str, text: str) -> None:
    block = f"{BEGIN}\n{text}\n{END}"
    old = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    if BEGIN in old and END in old:
        new = old[: old.index(BEGIN)] + block + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + f"\n\n{SECTION}\n\n{block}\n"
    with open(path, "w") as f:
        f.write(new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of parameters (the checkpoint is 3x this)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir beside the repository)")
    ap.add_argument("--results", default=None, help="write the table into this RESULTS.md")
    ap.add_argument("--warm", action="store_true", help="never drop the page cache (smoke runs)")
    args = ap.parse_args(argv)
    drop = not args.warm and _can_drop()
    work = tempfile.mkdtemp(prefix="bench-dtensor-", dir=args.dir or os.path.dirname(ROOT))
    out = os.path.join(work, "result")
    try:
        mp.start_processes(_worker, args=(_free_port(), args, work, out, drop), nprocs=2, join=True, start_method="spawn")
        results = [json.load(open(f"{out}.{r}")) for r in range(2)]
        text = _table(results, args.mib, args.reps, drop)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(text)
    if args.results:
        _write(args.results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
