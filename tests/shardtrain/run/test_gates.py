"""The gates on synthetic paired losses with known outcomes, and the bound against numpy."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from roles_fixtures import eval_role, roles_run  # noqa: F401  (roles_run: the fixture `run`)

import shardstore
from shardstore_cli.shardtrain_cli import main
from shardtrain.job.roles import DEVELOPMENT
from shardtrain.run.evaluate import Case, CommitEval, EvalReport, SetLoss
from shardtrain.run.gates import GateReport, Thresholds, gate_report, render_gates, write_gate_report

N = 40
RNG = np.random.default_rng(7)
WEIGHTS = RNG.integers(2, 9, size=N).astype(float)  # assistant tokens per document (unequal)
BASE = RNG.uniform(1.0, 3.0, size=N) * WEIGHTS  # per-document summed losses


def _set(name: str, kind: str, per_token_shift: float, noise: float = 0.0, seed: int = 0) -> SetLoss:
    eps = np.random.default_rng(seed).normal(0.0, noise, size=N) * WEIGHTS
    doc = BASE + per_token_shift * WEIGHTS + eps
    return SetLoss(
        name, float(doc.sum() / WEIGHTS.sum()), float(WEIGHTS.sum()), tuple(doc.tolist()), tuple(WEIGHTS.tolist()), kind
    )


def _cases(right: int) -> tuple[Case, ...]:
    return tuple(Case("dev_task", "lookup", "p", "1", "1" if i < right else "0", (), i < right) for i in range(8))


def _report(gain_shift: float, retention_shift: float, right: tuple[int, int], noise: float = 0.0) -> EvalReport:
    base = CommitEval(
        "a" * 64, 0, (_set("dev_task", "task", 0.0), _set("dev_retention", "retention", 0.0)), _cases(right[0]), 1.0
    )
    cand = CommitEval(
        "b" * 64,
        8,
        (_set("dev_task", "task", gain_shift, noise, 1), _set("dev_retention", "retention", retention_shift, noise, 2)),
        _cases(right[1]),
        1.0,
    )
    return EvalReport("c" * 64, "development", 2, (base, cand), ())


def _gates(report: EvalReport, t: Thresholds = Thresholds()) -> dict[str, bool]:
    g = gate_report(report, t, baseline="a" * 64, candidate="b" * 64)
    return {r.gate: r.passed for r in g.rows} | {"all": g.passed}


@pytest.mark.parametrize(
    ("gain", "retention", "right", "expected"),
    [
        (-0.0011, 0.019, (4, 4), {"gain": True, "retention": True, "generation": True, "all": True}),
        (-0.0009, 0.019, (4, 5), {"gain": False, "retention": True, "generation": True, "all": False}),
        (-0.0011, 0.021, (4, 4), {"gain": True, "retention": False, "generation": True, "all": False}),
        (-0.5, -0.5, (5, 4), {"gain": True, "retention": True, "generation": False, "all": False}),
    ],
)
def test_each_gate_on_both_sides_of_its_threshold(
    gain: float, retention: float, right: tuple[int, int], expected: dict[str, bool]
) -> None:
    # Without noise every document moves by the same per-token shift, so every resample's
    # difference, and so the bound, is that shift: the outcome is known exactly.
    assert _gates(_report(gain, retention, right)) == expected


def test_noise_widens_the_bound_past_the_gain_threshold() -> None:
    # A mean gain of 0.01 nats/token passes when the documents agree, fails when they scatter.
    assert _gates(_report(-0.01, 0.0, (4, 4), noise=0.0))["gain"]
    assert not _gates(_report(-0.01, 0.0, (4, 4), noise=0.2))["gain"]


def test_the_bound_matches_an_independent_numpy_computation() -> None:
    report = _report(-0.01, 0.01, (4, 4), noise=0.05)
    t = Thresholds(resamples=500, seed=11)
    g = gate_report(report, t, baseline="a" * 64, candidate="b" * 64)
    base, cand = report.commits
    for row, b, c in zip(g.rows, base.losses, cand.losses):
        bl, cl, w = np.array(b.doc_loss), np.array(c.doc_loss), np.array(b.doc_weight)
        draws = np.random.default_rng(11).integers(0, N, size=(500, N))
        diffs = [(cl[d].sum() - bl[d].sum()) / w[d].sum() for d in draws]  # one resample at a time
        assert row.bound == pytest.approx(np.percentile(diffs, 95), rel=1e-12, abs=1e-15)
        assert row.value == pytest.approx((cl.sum() - bl.sum()) / w.sum(), rel=1e-12)
    assert g.resamples == 500 and g.seed == 11


def test_the_report_is_a_pinned_object_and_renders(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import msgspec

    store = shardstore.open_store(str(tmp_path / "store"))
    g = gate_report(_report(-0.01, 0.0, (4, 4)), Thresholds(), baseline="a" * 64, candidate="b" * 64)
    oid = write_gate_report(store, g)
    assert store.pinned(f"gates/{'c' * 64}/{oid}") == (oid,)
    assert msgspec.json.decode(bytes(store.get(oid)), type=GateReport) == g
    table = "\n".join(render_gates(g))
    assert "gain" in table and "retention" in table and "generation" in table and "all gates: PASS" in table


def test_gate_command_uses_the_recipe_and_stores_its_report(run: SimpleNamespace) -> None:
    from shardtrain.run.gates import gate_report, thresholds_of

    base, cand = run.commits
    expected = gate_report(eval_role(run, DEVELOPMENT), thresholds_of(run.job), baseline=base, candidate=cand)
    code = main(
        [
            "gate",
            "--store",
            run.url,
            "--baseline",
            base,
            "--candidate",
            cand,
            "--workers",
            "1",
            "--cases",
            "1",
            "--max-new-tokens",
            "2",
        ]
    )
    assert code == (0 if expected.passed else 3)  # a failed gate: problems found (SPEC.md §23)
    reports = [n for n in run.store.pin_names() if n.startswith(f"gates/{run.job.id}/")]
    assert len(reports) == 1
    from shardtrain.run.gates import GateReport

    stored = msgspec.json.decode(bytes(run.store.get(reports[0].split("/")[-1])), type=GateReport)
    # The same figures as the in-process evaluation (up to the kernels this process picked),
    # and the thresholds of the job's recipe.
    assert (stored.job, stored.baseline, stored.candidate, stored.passed) == (run.job.id, base, cand, expected.passed)
    for got, want in zip(stored.rows, expected.rows, strict=True):
        assert (got.gate, got.set, got.threshold, got.passed) == (want.gate, want.set, want.threshold, want.passed)
        assert got.bound == pytest.approx(want.bound, rel=1e-5, abs=1e-7)
    assert [r.threshold for r in stored.rows] == [-0.001, 0.02, 0.0]
    assert main(["gate", "--store", run.url, "--baseline", base, "--candidate", cand, "--final", "--workers", "1"]) == 5
