"""Worker of the distillation parity test (importable by name in spawned worker processes).

Each worker builds its slot of the student (seeded) and of the frozen reference (restored
from a commit in the store), runs the reference's forward-only ring pass on the replay
rows, then the student's pipeline step with CE + KL, and writes its parameters, step
numbers and the loss terms into ``rank{r}.safetensors``.
"""
from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
from safetensors.torch import save_file
from shardtrain_helpers import GROUPS_JSON, make_batch, tiny_config

import shardstore
from shardtrain.distill import Reference
from shardtrain.launch import WorkerContext
from shardtrain.loss import DistillTargets
from shardtrain.optim import AdamW, GroupConfig, Schedule
from shardtrain.partition import Partition, build_stage
from shardtrain.pipeline import Pipeline
from shardtrain.trainer import Trainer


def distill_worker(ctx: WorkerContext, spec_json: str) -> None:
    spec = json.loads(spec_json)
    config = tiny_config()
    partition = Partition.from_ranges([tuple(r) for r in spec["ranges"]], config.num_hidden_layers)
    stage = build_stage(config, partition, ctx.rank, seed=spec["seed"], device=ctx.device)
    store = shardstore.open_store(spec["store"], create=False)
    reference = Reference(store, spec["reference"], slot=ctx.rank, num_slots=ctx.world_size, device=ctx.device,
                          timeout=60.0)
    pipe = Pipeline(stage, partition, ctx.rank, timeout=timedelta(seconds=60))
    opt = AdamW(stage.named_parameters(), {k: GroupConfig(**v) for k, v in spec.get("groups", GROUPS_JSON).items()},
                schedule=Schedule(warmup_steps=1, total_steps=spec["steps"], min_ratio=0.1))
    trainer = Trainer(pipe, opt, microbatch_size=spec["microbatch_size"], max_grad_norm=spec["max_grad_norm"])
    results = []
    for step in range(spec["steps"]):
        batch = make_batch(config, seed=spec["seed"] + step)
        mask = torch.zeros(batch.tokens.shape[0], dtype=torch.bool)
        mask[spec["replay"]] = True
        ref = reference.logprobs(batch.tokens[mask], spec["temperature"])
        pipe.distill = None if ref is None else DistillTargets(mask, ref, spec["coef"], spec["temperature"])
        r = trainer.step(batch)
        results.append([r.loss, r.grad_norm, r.clip_coef])
    tensors = {name: p.detach().clone() for name, p in stage.named_parameters()}
    save_file(tensors, os.path.join(spec["out_dir"], f"rank{ctx.rank}.safetensors"),
              metadata={"results": json.dumps(results),
                        "reference_params": json.dumps(sum(p.numel() for p in reference.stage.parameters()))})
