"""Distillation parity: the sharded CE + KL step on 2 and 3 workers against one process.

The reference run is `transformers`' `LlamaForCausalLM` for both student and frozen
reference, whole-batch autograd, the KL term computed by `torch.nn.functional.kl_div`,
`clip_grad_norm_` and `torch.optim.AdamW`: none of shardtrain's loss, pipeline, ring,
clipping or optimizer code runs in it. The batch has 5 rows split 2 + 2 + 1 (a partial
microbatch), unequal per-token weights, replay rows in a full and in the partial
microbatch next to new rows, and a clipping threshold below the gradient norm.
"""
from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distill_helpers import distill_worker
from shardtrain_helpers import DETERMINISTIC_ENV, GROUPS_JSON, make_batch, read_results, tiny_config

import shardstore
from shardtrain import Partition, build_stage, canonical_parameter_names, launch_local, lr_multiplier
from shardtrain.distill import Reference, reference_bytes
from shardtrain.loss import DistillTargets, microbatch_loss
from shardtrain.optim import Schedule

transformers = pytest.importorskip("transformers")

LAYOUTS = {2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
STEPS, SEED, REF_SEED, MAX_NORM, MICRO = 1, 1234, 77, 0.5, 2
REPLAY, COEF, TEMP = [1, 4], 0.7, 2.0
# Adam's eps is 1e-6 here, not 1e-8: the first update is lr * g / (|g| + eps), which
# amplifies float32 summation noise in an element whose gradient is ~eps by lr / eps.
# With eps = 1e-8 one element of one tensor (layers.3 v_proj) moved 1.6e-4 apart, 2.3e-4
# of that tensor's norm, while every other tensor agreed to ~1e-6 (measured).
GROUPS = {k: {**v, "eps": 1e-6} for k, v in GROUPS_JSON.items()}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.fixture(scope="module")
def reference_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A store holding the frozen reference as a one-slot commit (another seed than the student)."""
    config = tiny_config()
    url = str(tmp_path_factory.mktemp("refstore") / "store")
    store = shardstore.open_store(url)
    model = build_stage(config, Partition.even(config.num_hidden_layers, 1), 0, seed=REF_SEED)
    cid = shardstore.save(store, model, step=0, ref="reference", config=config.to_hf_dict(), rng=False,
                          transition="init")
    return url, cid


@pytest.fixture(scope="module")
def runs(reference_store: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    url, cid = reference_store
    out = {}
    for n, ranges in LAYOUTS.items():
        d = tmp_path_factory.mktemp(f"distill{n}")
        spec = {"out_dir": str(d), "ranges": ranges, "seed": SEED, "store": url, "reference": cid, "steps": STEPS,
                "microbatch_size": MICRO, "max_grad_norm": MAX_NORM, "replay": REPLAY, "coef": COEF,
                "temperature": TEMP, "groups": GROUPS}
        launch_local(distill_worker, n, (json.dumps(spec),), env=DETERMINISTIC_ENV, timeout=timedelta(seconds=60),
                     join_timeout=120)
        out[n] = read_results(d, n)
    return out


def _hf(seed: int) -> Any:
    config = tiny_config()
    init = build_stage(config, Partition.even(config.num_hidden_layers, 1), 0, seed=seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict()))
    model.load_state_dict({n: p.detach().clone() for n, p in init.named_parameters()}, strict=False)
    return model


def reference_run() -> tuple[list[tuple[float, float, float]], dict[str, torch.Tensor]]:
    """Whole-model CE + KL in one process: transformers' Llama, kl_div, clip_grad_norm_, torch AdamW."""
    config = tiny_config()
    student, teacher = _hf(SEED), _hf(REF_SEED)
    params = dict(student.named_parameters())
    assert tuple(params) == canonical_parameter_names(config)
    groups = [{"params": [p for p in params.values() if p.ndim >= 2], **_group(GROUPS["decay"])},
              {"params": [p for p in params.values() if p.ndim < 2], **_group(GROUPS["no_decay"])}]
    opt = torch.optim.AdamW(groups, foreach=False)
    schedule = Schedule(warmup_steps=1, total_steps=STEPS, min_ratio=0.1)
    history = []
    for step in range(STEPS):
        b = make_batch(config, seed=SEED + step)
        replay = torch.zeros(b.tokens.shape[0], dtype=torch.bool)
        replay[REPLAY] = True
        for g, spec in zip(opt.param_groups, (GROUPS["decay"], GROUPS["no_decay"])):
            g["lr"] = spec["lr"] * lr_multiplier(step, schedule)
        opt.zero_grad()
        logits = student(input_ids=b.tokens).logits  # (B, T, V)
        with torch.no_grad():
            ref_logits = teacher(input_ids=b.tokens).logits  # (B, T, V)
        ce = F.cross_entropy(logits.transpose(1, 2), b.targets, reduction="none")  # (B, T)
        ce_sum = (ce * b.weights)[~replay].sum()
        kl = F.kl_div(F.log_softmax(logits[replay] / TEMP, -1), F.log_softmax(ref_logits[replay] / TEMP, -1),
                      reduction="none", log_target=True).sum(-1)  # (R, T): KL(p_ref || p_student)
        loss = (ce_sum + COEF * TEMP ** 2 * (kl * b.weights[replay]).sum()) / b.weights.sum()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM))
        opt.step()
        history.append((float(loss.detach()), norm, float(((ce * b.weights).sum() / b.weights.sum()).detach())))
    return history, {n: p.detach().clone() for n, p in params.items()}


def _group(spec: dict[str, float]) -> dict[str, Any]:
    return {"lr": spec["lr"], "betas": (spec["beta1"], spec["beta2"]), "eps": spec["eps"],
            "weight_decay": spec["weight_decay"]}


@pytest.fixture(scope="module")
def oracle() -> tuple[list[tuple[float, float, float]], dict[str, torch.Tensor]]:
    return reference_run()


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_ce_plus_kl_matches_one_process(runs: dict, oracle: Any, n: int) -> None:
    tensors, metas = runs[n]
    history, ref = oracle
    results = metas[0]["results"]
    assert len(results) == STEPS and all(m["results"] == results for m in metas)
    for (loss, norm, coef), (ref_loss, ref_norm, ce_only) in zip(results, history):
        assert ref_norm > MAX_NORM and coef < 1.0  # clipping acts
        assert _rel(loss, ref_loss) <= 1e-6, (loss, ref_loss)
        assert _rel(norm, ref_norm) <= 1e-6, (norm, ref_norm)
        assert _rel(ref_loss, ce_only) > 1e-2  # the KL term really replaced CE on the replay rows
    assert set(tensors) == set(ref)
    # Updated parameters: the whole parameter vector within 1e-6 relative, and each tensor
    # within 1e-5 (float32 summation order, amplified per element by Adam's normalisation;
    # the CE-only pipeline test has the same per-tensor bound).
    diff = sum(float((tensors[k].double() - ref[k].double()).square().sum()) for k in ref) ** 0.5
    total = sum(float(ref[k].double().square().sum()) for k in ref) ** 0.5
    worst = max(float((tensors[k].double() - ref[k].double()).norm() / ref[k].double().norm()) for k in ref)
    print(f"distill parity n={n}: loss {_rel(results[0][0], history[0][0]):.1e} norm "
          f"{_rel(results[0][1], history[0][1]):.1e} params {diff / total:.1e} worst tensor {worst:.1e}")
    assert diff / total <= 1e-6, diff / total
    assert worst <= 1e-5, worst
    # No worker held the whole reference: each built only its slot's layers.
    full = sum(p.numel() for p in build_stage(tiny_config(), Partition.even(4, 1), 0, seed=0).parameters())
    assert all(m["reference_params"] < full for m in metas)
    assert sum(m["reference_params"] for m in metas) == full
    # ...and what each held is what a planner is told, computed without allocating anything.
    assert [m["reference_params"] * 4 for m in metas] == [reference_bytes(tiny_config(), n, s) for s in range(n)]


def test_microbatching_and_replay_placement_do_not_change_the_loss() -> None:
    """The per-microbatch losses sum to the whole batch's, for any split (one process, no ring)."""
    config = tiny_config()
    b = make_batch(config, seed=3, rows=5)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, b.tokens.shape[1], config.vocab_size, generator=g, dtype=torch.float64)
    ref = torch.log_softmax(torch.randn(2, b.tokens.shape[1], config.vocab_size, generator=g, dtype=torch.float64), -1)
    mask = torch.tensor([False, True, False, False, True])
    d = DistillTargets(mask, ref, COEF, TEMP)
    w = b.weights.double()
    whole = microbatch_loss(logits, b.targets, w, w.sum(), rows=(0, 5), distill=d)
    for size in (1, 2, 3):
        parts = sum(microbatch_loss(logits[s:s + size], b.targets[s:s + size], w[s:s + size], w.sum(),
                                    rows=(s, min(s + size, 5)), distill=d) for s in range(0, 5, size))
        assert float(parts) == pytest.approx(float(whole), rel=1e-12)
    with pytest.raises(ValueError, match="do not cover"):
        DistillTargets(mask, ref[:1], COEF, TEMP)


def test_the_seed_reference_adds_no_objects(reference_store: tuple[str, str]) -> None:
    url, cid = reference_store
    store = shardstore.open_store(url, create=False)
    before = sorted(store.objects())
    ref = Reference(store, cid, slot=0, num_slots=1, device=torch.device("cpu"), timeout=5.0)
    after = sorted(store.objects())
    assert len(after) == len(before) and after == before
    assert all(not p.requires_grad for p in ref.stage.parameters())
    model = build_stage(tiny_config(), Partition.even(4, 1), 0, seed=REF_SEED)
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in ref.stage.named_parameters())



def test_two_and_three_workers_agree_bitwise(runs: dict) -> None:
    (t2, m2), (t3, m3) = runs[2], runs[3]
    assert m2[0]["results"] == m3[0]["results"]  # loss, norm and clip factor to the last bit
    assert set(t2) == set(t3) and all(torch.equal(t2[k], t3[k]) for k in t2)
