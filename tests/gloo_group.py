"""One local Gloo group for a test module: start ``world`` processes (forked from the
suite's forkserver, ``conftest.START_METHOD``), run one function on every rank, and hand
each rank's JSON-able result back to the test.

Starting processes is the expensive part of a multi-process test, so a module runs one
group that does all of its checks (``body`` returns a dict of findings per rank).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401  before any group: see shardtrain.workers.launch.init_from_env
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import START_METHOD

__all__ = ["free_port", "run_group", "run_group_on_store"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(body: Callable[..., dict], world: int, tmp: Path, *args: Any, timeout_s: float = 120) -> list[dict]:
    """``body(rank, world, *args)`` on each rank of a fresh ``world``-process Gloo group
    (one thread each); return the ranks' results in rank order. ``body`` must be a
    module-level function (it is sent to the processes by reference)."""
    out = str(tmp / "result")
    mp.start_processes(
        _entry,
        args=(world, free_port(), out, timeout_s, body, args),
        nprocs=world,
        join=True,
        start_method=START_METHOD,
    )
    results = []
    for r in range(world):
        with open(f"{out}.{r}") as f:
            results.append(json.load(f))
    return results


def _entry(
    rank: int, world: int, port: int, out: str, timeout_s: float, body: Callable[..., dict], args: tuple
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        result = body(rank, world, *args)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
        dist.barrier()  # nobody tears the group down while a peer still uses it
    finally:
        dist.destroy_process_group()


def run_group_on_store(
    body: Callable[..., dict], world: int, tmp: Path, *, timeout_s: float = 120
) -> tuple[str, list[dict]]:
    """``run_group`` with a fresh store at ``tmp/store`` (created here, before the ranks start):
    ``body(rank, world, root)``; return the store's root and the ranks' results."""
    import shardstore as ss

    root = str(tmp / "store")
    ss.open_store(root)
    return root, run_group(body, world, tmp, root, timeout_s=timeout_s)
