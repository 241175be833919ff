"""Workers of the distillation parity test (importable by name in spawned worker processes).

`distill_worker` is one slot of the sharded run. Each worker builds its slot of the
student (seeded) and of the frozen reference (restored from a commit in the store), runs
the reference's forward-only ring pass on the replay rows, then the student's pipeline
step with CE + KL, and writes its parameters, step numbers and the loss terms into
``<dtype>/rank{r}.safetensors``: once per entry of the spec's ``runs`` (a parameter dtype
and the reference commit saved in it), all in one process group so the test pays for
one launch per worker count.

`oracle_worker` is the single-process reference: `transformers`' `LlamaForCausalLM` for
student and frozen reference, whole-batch autograd, the KL term by
`torch.nn.functional.kl_div`, `clip_grad_norm_` and `torch.optim.AdamW`; none of
shardtrain's loss, pipeline, ring, clipping, optimizer or model code runs in it. Its
inputs are the sharded run's: the student's initial values drawn by `build_stage` from
the same seed, the frozen reference's read from the same reference commit. It runs alone
in a process with the slots' environment (`DETERMINISTIC_ENV`), not in pytest's, because
`ATEN_CPU_CAPABILITY` (fixed at torch's import) picks the CPU kernels: under pytest's
capability `normal_` draws last-bit different initial values (measured; it held the
float64 comparison to ~1e-7), and the float32 steps inside RMSNorm (both models
normalise in float32, as transformers does) could differ likewise. It writes
``<dtype>/oracle.safetensors``.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from shardtrain_helpers import GROUPS_JSON, make_batch, tiny_config

import shardstore
from shardtrain.engine.loss import DistillTargets
from shardtrain.engine.optim import AdamW, GroupConfig, Schedule, lr_multiplier
from shardtrain.engine.partition import Partition, build_stage, canonical_parameter_names
from shardtrain.engine.pipeline import Pipeline
from shardtrain.engine.trainer import Trainer
from shardtrain.run.distill import Reference
from shardtrain.workers.launch import WorkerContext


def distill_worker(ctx: WorkerContext, spec_json: str) -> None:
    spec = json.loads(spec_json)
    store = shardstore.open_store(spec["store"], create=False)
    for run in spec["runs"]:
        _run(
            ctx,
            spec,
            store,
            getattr(torch, run["dtype"]),
            run["reference"],
            os.path.join(spec["out_dir"], run["dtype"]),
        )


def _run(
    ctx: WorkerContext, spec: dict, store: shardstore.Store, dtype: torch.dtype, reference_commit: str, out_dir: str
) -> None:
    config = tiny_config()
    partition = Partition.from_ranges([tuple(r) for r in spec["ranges"]], config.num_hidden_layers)
    stage = build_stage(config, partition, ctx.rank, seed=spec["seed"], device=ctx.device, dtype=dtype)
    reference = Reference(
        store, reference_commit, slot=ctx.rank, num_slots=ctx.world_size, device=ctx.device, timeout=60.0, dtype=dtype
    )
    pipe = Pipeline(stage, partition, ctx.rank, timeout=timedelta(seconds=60))
    opt = AdamW(
        stage.named_parameters(),
        {k: GroupConfig(**v) for k, v in spec.get("groups", GROUPS_JSON).items()},
        schedule=Schedule(warmup_steps=1, total_steps=spec["steps"], min_ratio=0.1),
    )
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
    os.makedirs(out_dir, exist_ok=True)
    save_file(
        tensors,
        os.path.join(out_dir, f"rank{ctx.rank}.safetensors"),
        metadata={
            "results": json.dumps(results),
            "reference_params": json.dumps(sum(p.numel() for p in reference.stage.parameters())),
            "reference_dtype": json.dumps(str(next(reference.stage.parameters()).dtype)),
        },
    )


def oracle_worker(ctx: WorkerContext, spec_json: str) -> None:
    spec = json.loads(spec_json)
    for run in spec["runs"]:
        history, params = reference_run(spec, getattr(torch, run["dtype"]), run["reference"])
        out_dir = os.path.join(spec["out_dir"], run["dtype"])
        os.makedirs(out_dir, exist_ok=True)
        save_file(params, os.path.join(out_dir, "oracle.safetensors"), metadata={"history": json.dumps(history)})


def _hf(seed: int, dtype: torch.dtype, store: shardstore.Store | None = None, commit: str | None = None) -> Any:
    """A transformers Llama holding `build_stage`'s initial values of `seed`, or `commit`'s tensors."""
    import transformers

    config = tiny_config()
    init = build_stage(config, Partition.even(config.num_hidden_layers, 1), 0, seed=seed, dtype=dtype)
    if commit is not None:
        assert store is not None
        shardstore.restore(store, commit, init)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict())).to(dtype)
    model.load_state_dict({n: p.detach().clone() for n, p in init.named_parameters()}, strict=False)
    assert all(p.dtype == dtype for p in model.parameters())
    return model


def reference_run(
    spec: dict, dtype: torch.dtype, reference: str
) -> tuple[list[tuple[float, float, float]], dict[str, torch.Tensor]]:
    """Whole-model CE + KL in one process; per step (loss, gradient norm, CE-only loss), and the parameters."""
    config = tiny_config()
    store = shardstore.open_store(spec["store"], create=False)
    student, teacher = _hf(spec["seed"], dtype), _hf(0, dtype, store, reference)
    params = dict(student.named_parameters())
    assert tuple(params) == canonical_parameter_names(config)
    gs = spec["groups"]
    groups = [
        {"params": [p for p in params.values() if p.ndim >= 2], **_group(gs["decay"])},
        {"params": [p for p in params.values() if p.ndim < 2], **_group(gs["no_decay"])},
    ]
    opt = torch.optim.AdamW(groups, foreach=False)
    schedule = Schedule(warmup_steps=1, total_steps=spec["steps"], min_ratio=0.1)
    temp, coef = spec["temperature"], spec["coef"]
    history = []
    for step in range(spec["steps"]):
        b = make_batch(config, seed=spec["seed"] + step)
        replay = torch.zeros(b.tokens.shape[0], dtype=torch.bool)
        replay[spec["replay"]] = True
        for g, name in zip(opt.param_groups, ("decay", "no_decay")):
            g["lr"] = gs[name]["lr"] * lr_multiplier(step, schedule)
        opt.zero_grad()
        logits = student(input_ids=b.tokens).logits  # (B, T, V)
        with torch.no_grad():
            ref_logits = teacher(input_ids=b.tokens).logits  # (B, T, V)
        weights = b.weights.to(dtype)  # (B, T)
        total = b.weights.sum()  # the loss denominator: a float32 sum, as `Batch.total_weight` defines it
        ce = F.cross_entropy(logits.transpose(1, 2), b.targets, reduction="none")  # (B, T)
        ce_sum = (ce * weights)[~replay].sum()
        kl = F.kl_div(
            F.log_softmax(logits[replay] / temp, -1),
            F.log_softmax(ref_logits[replay] / temp, -1),
            reduction="none",
            log_target=True,
        ).sum(-1)  # (R, T): KL(p_ref || p_student)
        loss = (ce_sum + coef * temp**2 * (kl * weights[replay]).sum()) / total
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), spec["max_grad_norm"]))
        opt.step()
        history.append((float(loss.detach()), norm, float(((ce * weights).sum() / total).detach())))
    return history, {n: p.detach().clone() for n, p in params.items()}


def _group(spec: dict[str, float]) -> dict[str, Any]:
    return {
        "lr": spec["lr"],
        "betas": (spec["beta1"], spec["beta2"]),
        "eps": spec["eps"],
        "weight_decay": spec["weight_decay"],
    }
