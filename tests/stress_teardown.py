"""Stress: start and tear down many two-rank Gloo groups, each training a little and
committing with `save_distributed`; count workers that die on the way out.

Not collected by pytest (it runs for many minutes). It reproduces a rare abort of a
worker that had finished its work, seen once in CI: "terminate called without an active
exception", exit code -6, no Python frame. A core dump showed the cause: the main thread
in interpreter shutdown while a Gloo worker thread, destroying a finished all_gather, took
the GIL to release a tensor's Python object. The group's threads were still alive after
destroy_process_group because torch._dynamo, imported lazily once the group existed (a
torch optimizer does it), holds a reference to the group.

    --exit old        init without importing torch._dynamo first, normal interpreter
                      shutdown: the code before the fix
    --exit shutdown   shardtrain.workers.launch.run_worker (imports torch._dynamo before the
                      group), normal interpreter shutdown: the torchrun path
    --exit launcher   the local launcher's worker entry, which also skips interpreter
                      shutdown once the work is done (the default)

    PYTHONPATH=. python tests/stress_teardown.py --rounds 600 --exit old
    PYTHONPATH=. python tests/stress_teardown.py --rounds 600 --exit shutdown

(from the repository root: a script's own directory, tests/, holds tests/shardstore/ and
tests/shardtrain/, which hide the packages unless the root is on the path too)

`--buffers frombuffer` puts back the commit protocol's old `torch.frombuffer` buffers,
first suspected; they were not the cause. Workers are forked from this process; for the
fixed paths it imports torch._dynamo once up front (as init_from_env would in each
worker), for `old` it does not, so each worker imports it late as the old code did.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import importlib
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

import shardstore as ss
import shardstore.checkpoint.distributed as sd
from shardtrain.workers.launch import WorkerContext, _child_main, free_port, run_worker


def _frombuffer_pack(status: int, oid: str | None) -> torch.Tensor:
    raw = bytes([status]) + (bytes.fromhex(oid) if oid else bytes(32))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _worker(ctx: WorkerContext, root: str) -> None:
    torch.manual_seed(ctx.rank)
    store = ss.open_store(root)
    lin = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(lin.parameters())
    for step in range(3):
        lin(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        mine = {f"w{ctx.rank}": lin.weight.detach(), f"b{ctx.rank}": lin.bias.detach()}
        ss.save_distributed(store, mine, None, info=ss.CommitInfo(step=step))


def _round(root: str, exit_path: str) -> list[int]:
    port = free_port()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            if exit_path == "launcher":  # the launcher's worker entry, exit included
                _child_main(_worker, (root,), rank, 2, port, 60.0, None, os.path.join(root, f"error-{rank}"))
                os._exit(2)  # not reached: the entry always exits
            faulthandler.enable()
            os.environ.update(
                RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
            )
            try:
                if exit_path == "old":
                    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
                    _worker(WorkerContext(rank, 2, rank, "gloo", torch.device("cpu"), timedelta(seconds=60)), root)
                    dist.barrier()
                    dist.destroy_process_group()
                else:
                    run_worker(_worker, root, timeout=timedelta(seconds=60))
            except BaseException as exc:  # a real error, not the abort this counts
                print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                os._exit(1)
            sys.exit(0)  # through interpreter shutdown, where the abort happened
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--exit", choices=("launcher", "shutdown", "old"), default="launcher")
    parser.add_argument("--buffers", choices=("owned", "frombuffer"), default="owned")
    args = parser.parse_args()
    if args.exit != "old":  # what init_from_env does first; done once here, not per forked worker
        importlib.import_module("torch._dynamo")
    if args.buffers == "frombuffer":
        sd._pack = _frombuffer_pack
    codes: collections.Counter[int] = collections.Counter()
    with tempfile.TemporaryDirectory(prefix="stress-teardown-") as tmp:
        for i in range(args.rounds):
            root = os.path.join(tmp, str(i))
            os.makedirs(root)
            for rank, code in enumerate(_round(root, args.exit)):
                codes[code] += 1
                if code != 0:
                    error = os.path.join(root, f"error-{rank}")
                    why = open(error).readline().strip() if os.path.exists(error) else "no Python error"
                    print(f"round {i}: rank {rank} exit code {code}: {why}", flush=True)
            if (i + 1) % 50 == 0:
                print(f"{i + 1} rounds: exit codes {dict(codes)}", flush=True)
    print(f"{args.rounds} rounds, exit {args.exit}, buffers {args.buffers}: exit codes {dict(codes)}")


if __name__ == "__main__":
    main()
