"""Shared pieces of the shardtrain tests: a tiny config, synthetic batches, and the worker
functions the tests start in separate processes (they must be importable by name).

Workers return results through safetensors files in a directory the test chooses:
parameters under their names, moments under `exp_avg/<name>` and `exp_avg_sq/<name>`,
and per-step numbers plus the parameter inventory as JSON in the file's metadata.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from shardtrain.engine.batch import Batch
from shardtrain.engine.messages import ACTIVATION, Channel, MessageHeader
from shardtrain.engine.model import LlamaConfig
from shardtrain.engine.optim import AdamW, GroupConfig, Schedule
from shardtrain.engine.partition import Partition, build_stage, parameter_inventory
from shardtrain.engine.pipeline import Pipeline
from shardtrain.engine.trainer import Trainer
from shardtrain.workers.launch import WorkerContext

DETERMINISTIC_ENV = {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def tiny_config(*, tied: bool = True, layers: int = 4) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=112,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def make_batch(config: LlamaConfig, *, seed: int, rows: int = 5, seq_len: int = 24) -> Batch:
    """Right-padded sequences of unequal lengths with assistant-style non-uniform weights."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(rows, seq_len, dtype=torch.int64)
    targets = torch.zeros(rows, seq_len, dtype=torch.int64)
    weights = torch.zeros(rows, seq_len, dtype=torch.float32)
    for r in range(rows):
        length = int(torch.randint(6, seq_len + 1, (1,), generator=g))
        seq = torch.randint(1, config.vocab_size, (length + 1,), generator=g)
        tokens[r, :length], targets[r, :length] = seq[:-1], seq[1:]
        prompt = int(torch.randint(1, length // 2 + 1, (1,), generator=g))  # unweighted "prompt" prefix
        weights[r, prompt:length] = 0.25 + 1.75 * torch.rand(length - prompt, generator=g)
    return Batch(tokens, targets, weights)


def job_spec(
    out_dir: str | Path,
    *,
    ranges: list[tuple[int, int]],
    tied: bool = True,
    steps: int = 4,
    microbatch_size: int = 2,
    max_grad_norm: float = 0.5,
    seed: int = 1234,
    **extra: Any,
) -> str:
    spec = {
        "out_dir": str(out_dir),
        "config": tiny_config(tied=tied).to_hf_dict(),
        "ranges": ranges,
        "steps": steps,
        "microbatch_size": microbatch_size,
        "max_grad_norm": max_grad_norm,
        "seed": seed,
        "groups": GROUPS_JSON,
        "schedule": {"warmup_steps": min(2, steps), "total_steps": steps, "min_ratio": 0.1},
    }
    spec.update(extra)
    return json.dumps(spec)


GROUPS_JSON = {
    "decay": {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1},
    "no_decay": {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0},
}


def train_worker(ctx: WorkerContext, spec_json: str) -> None:
    """Train the spec's job as slot `ctx.rank` and write `rank{r}.safetensors`."""
    spec = json.loads(spec_json)
    config = LlamaConfig.from_hf_dict(spec["config"])
    partition = Partition.from_ranges([tuple(r) for r in spec["ranges"]], config.num_hidden_layers)
    stage = build_stage(config, partition, ctx.rank, seed=spec["seed"], device=ctx.device)
    inventory = parameter_inventory(stage)
    # Messages may get a shorter deadline than the group's rendezvous, which must tolerate
    # workers that start seconds apart on a loaded machine.
    message_timeout = timedelta(seconds=spec["message_timeout"]) if "message_timeout" in spec else ctx.timeout
    pipe = Pipeline(stage, partition, ctx.rank, timeout=message_timeout)
    groups = {k: GroupConfig(**v) for k, v in spec["groups"].items()}
    opt = AdamW(stage.named_parameters(), groups, schedule=Schedule(**spec["schedule"]))
    trainer = Trainer(pipe, opt, microbatch_size=spec["microbatch_size"], max_grad_norm=spec["max_grad_norm"])
    results = []
    for step in range(spec["steps"]):
        if spec.get("die_rank") == ctx.rank and spec.get("die_step") == step:
            if spec.get("die_mode") == "hang":
                time.sleep(3600)
            os._exit(3)  # a peer vanishing without a word
        r = trainer.step(make_batch(config, seed=spec["seed"] + step))
        results.append([r.loss, r.grad_norm, r.clip_coef, r.lr_multiplier])
    _, params = opt.state_export()
    tensors = {name: p.detach().clone() for name, p in stage.named_parameters()}
    for name, st in params.items():
        tensors[f"exp_avg/{name}"] = st["exp_avg"].clone()
        tensors[f"exp_avg_sq/{name}"] = st["exp_avg_sq"].clone()
    meta = {
        "results": json.dumps(results),
        "inventory": json.dumps(inventory),
        "ages": json.dumps({n: st["age"] for n, st in params.items()}),
        "bytes_sent": str(pipe.bytes_sent),
    }
    save_file(tensors, os.path.join(spec["out_dir"], f"rank{ctx.rank}.safetensors"), metadata=meta)


def read_results(out_dir: str | Path, world_size: int) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Merge every rank's tensors (names are disjoint) and return per-rank metadata."""
    from safetensors import safe_open

    merged: dict[str, torch.Tensor] = {}
    metas = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.safetensors")
        tensors = load_file(path)
        assert not set(tensors) & set(merged), "two ranks returned the same tensor"
        merged.update(tensors)
        with safe_open(path, "pt") as f:
            metas.append({k: json.loads(v) for k, v in f.metadata().items()})
    return merged, metas


def header_mismatch_worker(ctx: WorkerContext, wrong_field: str) -> None:
    """Slot 1 sends an activation whose header is wrong in `wrong_field`; slot 0 must refuse it."""
    channel = Channel(ctx.rank, timeout=ctx.timeout, max_elements=1 << 20)
    expected = MessageHeader(ACTIVATION, 7, 0, torch.float32, (2, 5, 8))
    if ctx.rank == 1:
        bad = {"step": 8, "microbatch": 1, "shape": (2, 6, 8)}[wrong_field]
        sent = MessageHeader(**{**expected.__dict__, wrong_field: bad})
        channel.send(torch.zeros(sent.shape), 0, sent)
        channel.flush()
    else:
        channel.recv(1, expected)


def posted_header_mismatch_worker(ctx: WorkerContext) -> None:
    """As `header_mismatch_worker` (wrong step), but slot 0 posted its receive ahead (`Channel.post`)."""
    channel = Channel(ctx.rank, timeout=ctx.timeout, max_elements=1 << 20)
    expected = MessageHeader(ACTIVATION, 7, 0, torch.float32, (2, 5, 8))
    if ctx.rank == 1:
        sent = MessageHeader(**{**expected.__dict__, "step": 8})
        channel.send(torch.zeros(sent.shape), 0, sent)
        channel.flush()
    else:
        channel.wait(channel.post(1, expected))


def failing_worker(ctx: WorkerContext, rank_to_fail: int) -> None:
    if ctx.rank == rank_to_fail:
        raise ValueError(f"boom on rank {ctx.rank}")


def aborting_worker(ctx: WorkerContext, rank_to_abort: int, in_teardown: bool = False) -> None:
    """Die the way native code does when it calls std::terminate: SIGABRT, no Python error;
    with `in_teardown`, only when the group is torn down, after this function returned."""
    if ctx.rank == rank_to_abort:
        if in_teardown:
            import shardtrain.workers.launch

            shardtrain.workers.launch.shutdown = os.abort  # this worker process only
        else:
            os.abort()


def lingering_thread_worker(ctx: WorkerContext, out_dir: str) -> None:
    """Return while a non-daemon thread still has a file to write."""

    def late() -> None:
        time.sleep(0.5)
        Path(out_dir, f"late-{ctx.rank}.txt").write_text("written after the function returned")

    threading.Thread(target=late).start()


def environment_worker(ctx: WorkerContext, out_dir: str, names: list[str]) -> None:
    """Write what this worker sees: the named variables and its rank; say hello on stdout."""
    seen = {"env": {n: os.environ.get(n) for n in names}, "rank": os.environ.get("RANK")}
    print(f"worker {ctx.rank} says hello on stdout", flush=True)
    Path(out_dir, f"env-{ctx.rank}.json").write_text(json.dumps(seen))


def optimizer_worker(ctx: WorkerContext) -> None:
    """Build a torch optimizer once the group exists; in torch 2.13 that imports torch._dynamo."""
    lin = torch.nn.Linear(4, 4)
    torch.optim.AdamW(lin.parameters()).step()
    dist.barrier()


def threads_left_after_run_worker() -> list[str]:
    """Run `optimizer_worker` under `run_worker` (RANK etc. from the environment) and
    return the names of the threads still alive after its teardown."""
    from shardtrain.workers.launch import run_worker

    run_worker(optimizer_worker, timeout=timedelta(seconds=60))
    return sorted(Path(f"/proc/self/task/{tid}/comm").read_text().strip() for tid in os.listdir("/proc/self/task"))


if __name__ == "__main__":  # the torchrun entry: python -m torch.distributed.run ... shardtrain_helpers.py SPEC
    import sys

    from shardtrain.workers.launch import run_worker

    run_worker(train_worker, sys.argv[1], timeout=timedelta(seconds=60))
