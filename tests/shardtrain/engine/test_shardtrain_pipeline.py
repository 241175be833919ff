"""The pipeline against a monolithic reference, across 1, 2 and 3 worker processes.

The reference is `transformers`' `LlamaForCausalLM` loaded with the same initial weights,
trained with whole-batch autograd, `clip_grad_norm_` and `torch.optim.AdamW`: none of
shardtrain's pipeline, clipping or optimizer code runs in it. It runs once, in a process of
its own under the workers' environment (`DETERMINISTIC_ENV`): `ATEN_CPU_CAPABILITY`, fixed at
torch's import, picks the CPU kernels, and pytest's process may run others (another CPU
vendor, other last bits) than the workers it is compared with.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from shardtrain_helpers import (
    DETERMINISTIC_ENV,
    GROUPS_JSON,
    job_spec,
    make_batch,
    read_results,
    tiny_config,
    train_worker,
)

from shardtrain import Batch, Partition, build_stage, canonical_parameter_names, launch_local, lr_multiplier
from shardtrain.engine.optim import Schedule
from shardtrain.engine.pipeline import Pipeline
from shardtrain.errors import BatchError, ConfigError, WorkerFailedError

transformers = pytest.importorskip("transformers")

# Keyed by a name; the worker count is the number of ranges. "3e": slot 0 holds no layers.
LAYOUTS = {1: [(0, 4)], 2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)], "3e": [(0, 0), (0, 3), (3, 4)]}
STEPS, MAX_NORM, SEED = 4, 0.5, 1234


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, tuple[dict[str, torch.Tensor], list[dict[str, Any]]]]:
    """The same tied job trained by 1, 2 and 3 worker processes over Gloo (every layout)."""
    out = {}
    for key, ranges in LAYOUTS.items():
        n = len(ranges)
        d = tmp_path_factory.mktemp(f"workers{key}")
        launch_local(
            train_worker,
            n,
            (job_spec(d, ranges=ranges, steps=STEPS, max_grad_norm=MAX_NORM, seed=SEED),),
            env=DETERMINISTIC_ENV,
            timeout=timedelta(seconds=60),
            join_timeout=120,
        )
        out[key] = read_results(d, n)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """`reference_run(STEPS)`, computed in its own process under the workers' kernels (module docstring)."""
    out = str(tmp_path_factory.mktemp("reference") / "reference.safetensors")
    launch_local(
        _reference_worker, 1, (STEPS, out), env=DETERMINISTIC_ENV, timeout=timedelta(seconds=60), join_timeout=120
    )
    with safe_open(out, "pt") as f:
        history = [tuple(h) for h in json.loads(f.metadata()["history"])]
    return history, load_file(out)


def _reference_worker(ctx: Any, steps: int, out: str) -> None:
    history, state = reference_run(steps)
    save_file({k: v.contiguous() for k, v in state.items()}, out, metadata={"history": json.dumps(history)})


def reference_run(steps: int) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """Whole-model autograd in one process with transformers' Llama and torch's AdamW."""
    config = tiny_config(tied=True)
    init = build_stage(config, Partition.even(config.num_hidden_layers, 1), 0, seed=SEED)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict()))
    model.load_state_dict({n: p.detach().clone() for n, p in init.named_parameters()}, strict=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one parameter, two uses
    params = dict(model.named_parameters())
    assert tuple(params) == canonical_parameter_names(config)
    groups = [
        {"params": [p for p in params.values() if p.ndim >= 2], **_torch_group(GROUPS_JSON["decay"])},
        {"params": [p for p in params.values() if p.ndim < 2], **_torch_group(GROUPS_JSON["no_decay"])},
    ]
    opt = torch.optim.AdamW(groups, foreach=False)
    schedule = Schedule(warmup_steps=2, total_steps=steps, min_ratio=0.1)
    history = []
    for step in range(steps):
        b = make_batch(config, seed=SEED + step)
        for g, spec in zip(opt.param_groups, (GROUPS_JSON["decay"], GROUPS_JSON["no_decay"])):
            g["lr"] = spec["lr"] * lr_multiplier(step, schedule)
        opt.zero_grad()
        logits = model(input_ids=b.tokens).logits  # (B, T, V), right padding needs no mask
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.targets.reshape(-1), reduction="none")
        loss = (ce * b.weights.reshape(-1)).sum() / b.weights.sum()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM))
        opt.step()
        history.append((float(loss.detach()), norm))
    state = {n: p.detach().clone() for n, p in params.items()}
    for n, p in params.items():
        state[f"exp_avg/{n}"] = opt.state[p]["exp_avg"]
        state[f"exp_avg_sq/{n}"] = opt.state[p]["exp_avg_sq"]
    return history, state


def _torch_group(spec: dict[str, float]) -> dict[str, Any]:
    return {
        "lr": spec["lr"],
        "betas": (spec["beta1"], spec["beta2"]),
        "eps": spec["eps"],
        "weight_decay": spec["weight_decay"],
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a whole tensor, ||a - b|| / ||b||.

    Not elementwise: Adam divides each gradient element by its own magnitude, so elements
    whose gradient is at float32 noise level move by up to ~lr either way, whatever the
    summation order; a few such elements differ by ~1e-4 relative while the tensor agrees
    to ~1e-6 (measured: worst 2.8e-6 here).
    """
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("n", [2, 3])
def test_matches_monolithic_reference(runs: dict, reference: tuple, n: int) -> None:
    tensors, metas = runs[n]
    history, ref = reference
    results = metas[0]["results"]
    assert len(results) == STEPS
    for (loss, norm, coef, _), (ref_loss, ref_norm) in zip(results, history):
        assert ref_norm > MAX_NORM and norm > MAX_NORM and coef < 1.0  # clipping really acts every step
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
        assert abs(norm - ref_norm) <= 1e-6 * ref_norm
    assert set(tensors) == set(ref)
    worst = max(_rel(tensors[k], ref[k]) for k in ref)
    assert worst <= 1e-5, worst
    # Every rank reports the same numbers.
    assert all(m["results"] == results for m in metas)


def test_worker_counts_are_bitwise_identical(runs: dict) -> None:
    base, base_metas = runs[1]
    for key in (2, 3, "3e"):
        tensors, metas = runs[key]
        assert set(tensors) == set(base)
        different = [k for k in base if not torch.equal(tensors[k], base[k])]
        assert not different, different[:5]
        assert metas[0]["results"] == base_metas[0]["results"]  # losses, norms to the last bit


def test_workers_hold_only_what_they_own(runs: dict) -> None:
    config = tiny_config(tied=True)
    for key, ranges in LAYOUTS.items():
        _, metas = runs[key]
        partition = Partition.from_ranges(ranges, config.num_hidden_layers)
        full = build_stage(config, Partition.even(4, 1), 0, seed=0)
        numel = {name: p.numel() for name, p in full.named_parameters()}
        for slot, meta in enumerate(metas):
            inventory = meta["inventory"]
            assert tuple(inventory) == partition.owned_parameter_names(config, slot)
            assert all(inventory[name] == 4 * numel[name] for name in inventory)
            assert set(meta["ages"].values()) == {STEPS}


def test_microbatching_does_not_change_the_gradient() -> None:
    """In one process: microbatches of 1, 2 (partial last) and the whole batch give the same
    loss and accumulated gradients, to float32 summation-order noise."""
    config = tiny_config(tied=False)
    batch = make_batch(config, seed=5, rows=5)
    partition = Partition.even(4, 1)
    stage = build_stage(config, partition, 0, seed=3)
    pipe = Pipeline(stage, partition, 0)
    results = []
    for mbs in (5, 2, 1):
        stage.zero_grad(set_to_none=True)
        loss = pipe.forward_backward(batch, step=0, microbatch_size=mbs)
        results.append((loss, {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}))
    whole_loss, whole_grads = results[0]
    assert len(whole_grads) == len(canonical_parameter_names(config))
    for loss, grads in results[1:]:
        assert loss == pytest.approx(whole_loss, rel=1e-6)
        assert max(_rel(grads[k], whole_grads[k]) for k in whole_grads) <= 1e-6


def test_multi_slot_pipeline_needs_a_process_group() -> None:
    config = tiny_config()
    partition = Partition.even(4, 2)
    stage = build_stage(config, partition, 0, seed=0)
    with pytest.raises(ConfigError, match="needs an initialised process group"):
        Pipeline(stage, partition, 0)
    with pytest.raises(ConfigError, match="does not match slot 1"):
        Pipeline(stage, partition, 1)


def test_dead_peer_fails_survivor_quickly(tmp_path: Path) -> None:
    spec = job_spec(tmp_path, ranges=LAYOUTS[2], steps=2, die_rank=1, die_step=1, message_timeout=5)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        launch_local(train_worker, 2, (spec,), env=DETERMINISTIC_ENV, timeout=timedelta(seconds=30), join_timeout=90)
    elapsed = time.monotonic() - start
    assert info.value.failures[1] == "exited with code 3"
    assert info.value.failures[0].startswith("PeerFailureError: slot 0:")
    assert "slot 1" in info.value.failures[0]
    assert elapsed < 45, elapsed


def test_hung_peer_times_out(tmp_path: Path) -> None:
    spec = job_spec(tmp_path, ranges=LAYOUTS[2], steps=1, die_rank=1, die_step=0, die_mode="hang", message_timeout=3)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        launch_local(
            train_worker,
            2,
            (spec,),
            env=DETERMINISTIC_ENV,
            timeout=timedelta(seconds=30),
            join_timeout=90,
            failure_grace=1.0,
        )
    elapsed = time.monotonic() - start
    message = info.value.failures[0]
    assert message.startswith("PeerFailureError: slot 0: receiving activation of step 0 microbatch 0 from slot 1")
    assert "timeout 3 s" in message
    assert info.value.failures[1].startswith("terminated")  # the hung worker was stopped by the launcher
    assert elapsed < 45, elapsed


def test_batch_is_validated_before_any_message() -> None:
    config = tiny_config()
    partition = Partition.even(4, 1)
    pipe = Pipeline(build_stage(config, partition, 0, seed=0), partition, 0)
    good = make_batch(config, seed=0)
    bad = Batch(good.tokens, good.targets, torch.zeros_like(good.weights))
    with pytest.raises(BatchError, match="no target weight"):
        pipe.forward_backward(bad, step=0, microbatch_size=2)
