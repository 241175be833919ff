"""Distillation parity: the sharded CE + KL step on 2 and 3 workers against one process.

The reference run (`distill_helpers.oracle_worker`) is `transformers`' `LlamaForCausalLM`
for both student and frozen reference, whole-batch autograd, the KL term computed by
`torch.nn.functional.kl_div`, `clip_grad_norm_` and `torch.optim.AdamW`: none of
shardtrain's loss, pipeline, ring, clipping, optimizer or model code runs in it (it takes
the student's initial values from `build_stage` and the frozen reference's from the
reference commit, as the workers do). The
batch has 5 rows split 2 + 2 + 1 (a partial microbatch), unequal per-token weights,
replay rows next to new rows in a full microbatch and alone in the partial one, and a
clipping threshold below the gradient norm; Adam's eps is the recipe's 1e-8 (the test
asserts each of these of the batch and hyperparameters it runs).

Every check runs in two dtypes, from one launch per worker count and one for the
reference:

- **float64** (student, reference, activations and messages: `build_stage(dtype=...)`):
  loss, gradient norm, the parameter vector and every updated tensor within 1e-9
  relative of the reference (the issue asks 1e-6; measured: loss 1.4e-16, norm 0,
  vector 1.8e-16, worst tensor 2.1e-15).
- **float32**, the training profile, with bounds set from what it measured: loss 9.6e-9
  and norm 1.1e-7 (bound 1e-6), parameter vector 2.6e-7 (bound 1e-6), worst tensor
  2.7e-6 of its norm (bound 1e-5). Per tensor float32 cannot promise 1e-6 in general:
  the first Adam update is ``lr * g / (|g| + eps)``, so an element whose gradient is ~eps
  moves by up to ~lr when float32 summation order changes its gradient by ~eps (with a
  reference as small as the student, REF_STD 0.02, layers.3 v_proj had such elements and
  measured 1.9e-5). float64 takes that noise out, which is why it carries the per-tensor
  claim.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from distill_helpers import distill_worker, oracle_worker
from safetensors import safe_open
from safetensors.torch import load_file
from shardtrain_helpers import DETERMINISTIC_ENV, GROUPS_JSON, make_batch, read_results, tiny_config

import shardstore
from shardtrain import Partition, build_stage, launch_local
from shardtrain.engine.batch import split_microbatches
from shardtrain.engine.loss import DistillTargets, microbatch_loss
from shardtrain.run.distill import Reference, reference_bytes

pytest.importorskip("transformers")  # the reference run (distill_helpers.oracle_worker) imports it

LAYOUTS = {2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}
STEPS, SEED, REF_SEED, MAX_NORM, MICRO = 1, 1234, 77, 0.5, 2
# The reference's initial scale: with the student's 0.02 both models are near uniform and
# the KL term is 0.2% of the loss; at 0.3 it is ~19%, so a wrong KL cannot hide in it.
REF_STD = 0.3
REPLAY, COEF, TEMP = [1, 4], 0.7, 2.0
GROUPS = GROUPS_JSON  # the recipe's hyperparameters, eps 1e-8 included
DTYPES = {"float64": torch.float64, "float32": torch.float32}
# Relative tolerances: (loss and norm, whole parameter vector, each tensor); the module
# docstring gives what each measured.
TOL = {"float64": (1e-9, 1e-9, 1e-9), "float32": (1e-6, 1e-6, 1e-5)}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.fixture(scope="module")
def reference_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """A store holding the frozen reference (another seed than the student) as a one-slot
    commit per parameter dtype."""
    config = tiny_config()
    url = str(tmp_path_factory.mktemp("refstore") / "store")
    store = shardstore.open_store(url)
    commits = {}
    for name, dtype in DTYPES.items():
        model = build_stage(
            config, Partition.even(config.num_hidden_layers, 1), 0, seed=REF_SEED, dtype=dtype, init_std=REF_STD
        )
        commits[name] = shardstore.save(
            store, model, step=0, ref=f"reference-{name}", config=config.to_hf_dict(), rng=False, transition="init"
        )
    return url, commits


def _spec(out_dir: Path, commits: dict[str, str], url: str, ranges: list[tuple[int, int]] | None = None) -> str:
    return json.dumps(
        {
            "out_dir": str(out_dir),
            "ranges": ranges,
            "seed": SEED,
            "store": url,
            "steps": STEPS,
            "runs": [{"dtype": k, "reference": cid} for k, cid in commits.items()],
            "microbatch_size": MICRO,
            "max_grad_norm": MAX_NORM,
            "replay": REPLAY,
            "coef": COEF,
            "temperature": TEMP,
            "groups": GROUPS,
        }
    )


@pytest.fixture(scope="module")
def runs(reference_store: tuple[str, dict[str, str]], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """(workers, dtype) -> (merged tensors, per-rank metadata): one launch per worker count."""
    url, commits = reference_store
    out = {}
    for n, ranges in LAYOUTS.items():
        d = tmp_path_factory.mktemp(f"distill{n}")
        launch_local(
            distill_worker,
            n,
            (_spec(d, commits, url, ranges),),
            env=DETERMINISTIC_ENV,
            timeout=timedelta(seconds=60),
            join_timeout=120,
        )
        for k in commits:
            out[n, k] = read_results(d / k, n)
    return out


@pytest.fixture(scope="module")
def oracle(reference_store: tuple[str, dict[str, str]], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """dtype -> (per-step (loss, norm, CE-only loss), parameters) of the one-process reference run,
    in a process with the workers' environment (distill_helpers says why)."""
    url, commits = reference_store
    d = tmp_path_factory.mktemp("oracle")
    launch_local(
        oracle_worker,
        1,
        (_spec(d, commits, url),),
        env=DETERMINISTIC_ENV,
        timeout=timedelta(seconds=60),
        join_timeout=120,
    )
    out = {}
    for k in commits:
        path = d / k / "oracle.safetensors"
        with safe_open(str(path), "pt") as f:
            history = [tuple(h) for h in json.loads(f.metadata()["history"])]
        out[k] = (history, load_file(str(path)))
    return out


def test_the_parity_batch_has_every_condition() -> None:
    """What the parity test claims of its batch, checked on the batch itself."""
    b = make_batch(tiny_config(), seed=SEED)
    replay = torch.zeros(b.tokens.shape[0], dtype=torch.bool)
    replay[REPLAY] = True
    mbs = split_microbatches(b, MICRO)
    assert [mb.rows for mb in mbs] == [2, 2, 1]  # a partial last microbatch...
    assert bool(replay[mbs[-1].start : mbs[-1].stop].all())  # ...holding a replay record
    assert any(0 < int(replay[mb.start : mb.stop].sum()) < mb.rows for mb in mbs)  # replay + new in one microbatch
    assert b.weights[b.weights > 0].unique().numel() > 10  # unequal weights
    assert GROUPS["decay"]["eps"] == GROUPS["no_decay"]["eps"] == 1e-8
    assert GROUPS["decay"]["weight_decay"] > 0  # decoupled weight decay acts too


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", [2, 3])
def test_sharded_ce_plus_kl_matches_one_process(runs: dict, oracle: dict, n: int, dtype: str) -> None:
    tensors, metas = runs[n, dtype]
    history, ref = oracle[dtype]
    tol_scalar, tol_vector, tol_tensor = TOL[dtype]
    results = metas[0]["results"]
    assert len(results) == STEPS and all(m["results"] == results for m in metas)
    assert all(m["reference_dtype"] == str(DTYPES[dtype]) for m in metas)
    for (loss, norm, coef), (ref_loss, ref_norm, ce_only) in zip(results, history):
        assert _rel(loss, ref_loss) <= tol_scalar, (loss, ref_loss)
        assert _rel(norm, ref_norm) <= tol_scalar, (norm, ref_norm)
        assert ref_norm > MAX_NORM and coef < 1.0  # clipping acts...
        assert coef == pytest.approx(MAX_NORM / (ref_norm + 1e-6), rel=1e-6)  # ...by the reference's factor
        assert _rel(ref_loss, ce_only) > 1e-2  # the KL term really replaced CE on the replay rows
    assert set(tensors) == set(ref)
    assert all(t.dtype == DTYPES[dtype] for t in tensors.values())
    # Updated parameters: the whole parameter vector, and each tensor by its own norm.
    diff = sum(float((tensors[k].double() - ref[k].double()).square().sum()) for k in ref) ** 0.5
    total = sum(float(ref[k].double().square().sum()) for k in ref) ** 0.5
    per = {k: float((tensors[k].double() - ref[k].double()).norm() / ref[k].double().norm()) for k in ref}
    worst = max(per, key=per.__getitem__)
    print(
        f"distill parity {dtype} n={n}: loss {_rel(results[0][0], history[0][0]):.1e} norm "
        f"{_rel(results[0][1], history[0][1]):.1e} params {diff / total:.1e} worst tensor {per[worst]:.1e} "
        f"({worst})"
    )
    assert diff / total <= tol_vector, diff / total
    assert per[worst] <= tol_tensor, (worst, per[worst])
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
        parts = sum(
            microbatch_loss(
                logits[s : s + size],
                b.targets[s : s + size],
                w[s : s + size],
                w.sum(),
                rows=(s, min(s + size, 5)),
                distill=d,
            )
            for s in range(0, 5, size)
        )
        assert float(parts) == pytest.approx(float(whole), rel=1e-12)
    with pytest.raises(ValueError, match="do not cover"):
        DistillTargets(mask, ref[:1], COEF, TEMP)


def test_the_seed_reference_adds_no_objects(reference_store: tuple[str, dict[str, str]]) -> None:
    url, commits = reference_store
    cid = commits["float32"]
    store = shardstore.open_store(url, create=False)
    before = sorted(store.objects())
    ref = Reference(store, cid, slot=0, num_slots=1, device=torch.device("cpu"), timeout=5.0)
    after = sorted(store.objects())
    assert len(after) == len(before) and after == before
    assert all(not p.requires_grad for p in ref.stage.parameters())
    model = build_stage(tiny_config(), Partition.even(4, 1), 0, seed=REF_SEED, init_std=REF_STD)
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in ref.stage.named_parameters())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_two_and_three_workers_agree_bitwise(runs: dict, dtype: str) -> None:
    (t2, m2), (t3, m3) = runs[2, dtype], runs[3, dtype]
    assert m2[0]["results"] == m3[0]["results"]  # loss, norm and clip factor to the last bit
    assert set(t2) == set(t3) and all(torch.equal(t2[k], t3[k]) for k in t2)
