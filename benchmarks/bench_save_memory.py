"""Each rank's peak memory during a sharded save: shardstore.save_distributed against dcp.save.

One DTensor of ``--mib`` MiB of float32 (rows of 1 MiB) over 4 Gloo processes, split two
ways: by rows (``Shard(0)``, FSDP2's split, of 6 rows fewer: uneven, so rank boundaries cut
blocks) and by
columns (``Shard(1)``, tensor parallelism's rowwise split: every 4 MiB block is assembled
from 4 ranks' strips). Each rank builds only its own slice, never the whole tensor. For
each method and split, in a fresh group of processes (a process's first save is what is
measured, as a trainer's first checkpoint would be), every rank hands freed heap back
(``malloc_trim``), resets its resident-set high-water mark (``/proc/self/clear_refs`` 5)
and reports ``VmHWM`` after the save minus ``VmRSS`` before: what the save added on top of
the slice it already held. shardstore's exchange statistics say what it staged.

    python benchmarks/bench_save_memory.py [--mib 384] [--results benchmarks/RESULTS.md]

The ratio column is the peer's increase over shardstore's (above 1: shardstore adds less).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta

import torch
import torch._dynamo  # noqa: F401  before any group (see shardtrain.workers.launch)
import torch.distributed as dist
import torch.multiprocessing as mp

import shardstore as ss
import shardstore.sharded.exchange as sex

WORLD = 4
COLS = 262144  # one row: 1 MiB of float32
MiB = 1 << 20


def _vm(key: bytes) -> int:
    with open("/proc/self/status", "rb") as f:
        for line in f.read(1 << 16).splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key!r} in /proc/self/status")


def _worker(rank: int, port: int, method: str, split: str, rows: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (WORLD,))
        g = torch.Generator().manual_seed(rank)
        if split == "rows":
            rows -= 6  # torch.chunk of 378 rows: 95, 95, 95, 93 — boundaries that cut 4-row blocks
            per = -(-rows // WORLD)
            n = max(0, min(per, rows - rank * per))
            local, placement = torch.randn(n, COLS, generator=g), Shard(0)
        else:
            local, placement = torch.randn(rows, COLS // WORLD, generator=g), Shard(1)
        big = DTensor.from_local(
            local, mesh, (placement,), run_check=False, shape=torch.Size((rows, COLS)), stride=(COLS, 1)
        )
        dist.barrier()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "wb") as f:
            f.write(b"5")
        before = _vm(b"VmRSS:")
        if method == "shardstore":
            ss.save_distributed(
                ss.open_store(root), {"big": big}, None, info=ss.CommitInfo(step=0), rng=False, ref=None, parent=None
            )
        else:
            import torch.distributed.checkpoint as dcp

            dcp.save({"big": big}, checkpoint_id=root)
        peak = _vm(b"VmHWM:")
        staged = sex.last_exchange().peak_staged if method == "shardstore" else 0
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"increase": peak - before, "slice": local.numel() * 4, "staged": staged}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(method: str, split: str, rows: int) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="bench-save-memory-")
    try:
        root, out = os.path.join(tmp, "ckpt"), os.path.join(tmp, "result")
        if method == "shardstore":
            ss.open_store(root)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(
            _worker, args=(port, method, split, rows, root, out), nprocs=WORLD, join=True, start_method="spawn"
        )
        return [json.load(open(f"{out}.{r}")) for r in range(WORLD)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _table(rows: int) -> str:
    lines = [
        f"`python benchmarks/bench_save_memory.py --mib {rows}`",
        "",
        _machine(),
        "",
        f"One float32 DTensor of {rows} MiB over {WORLD} Gloo processes; per rank: resident-set peak during the save minus "
        "the resident set before it (the slice was already resident), MiB, min–max over ranks; one fresh group per row.",
        "",
        "| split | method | slice per rank | increase during save | shardstore staged | method ÷ shardstore |",
        "|---|---|---|---|---|---|",
    ]
    for split in ("rows", "cols"):
        got = {m: _run(m, split, rows) for m in ("shardstore", "dcp.save")}
        ours = max(r["increase"] for r in got["shardstore"])
        for m, res in got.items():
            inc = [r["increase"] / MiB for r in res]
            sl = [r["slice"] / MiB for r in res]
            staged = f"{max(r['staged'] for r in res) / MiB:.0f}" if m == "shardstore" else "—"
            ratio = max(r["increase"] for r in res) / max(ours, 1)
            name = "Shard(0), uneven" if split == "rows" else "Shard(1)"
            lines.append(
                f"| {name} | {m} | {min(sl):.0f}–{max(sl):.0f} | {min(inc):.1f}–{max(inc):.1f} | {staged} | {ratio:.2f} |"
            )
    return "\n".join(lines) + "\n"


def _machine() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    return f"commit {commit}; {os.cpu_count()} cores, Linux {platform.release()}; Python {platform.python_version()}, torch {torch.__version__}, glibc malloc defaults."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=384, help="tensor size in MiB (rows of 1 MiB)")
    ap.add_argument("--results", help="write the table between this benchmark's markers in this file")
    args = ap.parse_args()
    text = _table(args.mib)
    print(text)
    if args.results:
        begin, end = "<!-- bench_save_memory:begin -->", "<!-- bench_save_memory:end -->"
        with open(args.results) as f:
            doc = f.read()
        block = f"{begin}\n{text}{end}"
        doc = (
            doc[: doc.index(begin)] + block + doc[doc.index(end) + len(end) :]
            if begin in doc
            else doc.rstrip("\n") + f"\n\n## Peak memory during a sharded save\n\n{block}\n"
        )
        with open(args.results, "w") as f:
            f.write(doc)


if __name__ == "__main__":
    sys.exit(main())
