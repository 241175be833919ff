"""Gates: the experiment's pass/fail decisions for a candidate commit against a baseline.

From paired per-document losses and the generated answers of one evaluation (`evaluate`,
development sets by default, final sets after a selection):

- **gain** (each new-task set): the upper one-sided 95% paired-bootstrap bound of
  candidate minus baseline loss, in nats per assistant token, must lie *below*
  ``gain_bound`` (-0.001 in the default recipe);
- **retention** (each retention set): the same upper bound must be *at most*
  ``retention_bound`` (+0.02);
- **generation**: over every task set's generated answers, the candidate must not get
  fewer right than the baseline (no aggregate loss of correct answers).

The bootstrap resamples documents with replacement, the same documents on both sides,
``resamples`` times (2000) from ``numpy.random.default_rng(seed)`` (seed 0); the bound is
the 0.95 quantile of the resampled ratio-of-sums differences (`paired_bootstrap`).
Thresholds, resample count and seed come from the job's recipe, fixed before training,
never from the command line. The report is stored as an object and pinned as
``gates/<job id>/<report id>`` so gc keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from shardstore import Store
from shardstore.format.manifest import f64_decode
from shardtrain.errors import JobError
from shardtrain.job.job import PreparedJob
from shardtrain.run.evaluate import CommitEval, EvalReport, paired_bootstrap

__all__ = ["Thresholds", "GateRow", "GateReport", "thresholds_of", "gate_report", "write_gate_report", "render_gates"]

_VERSION = 1
_ENC = msgspec.json.Encoder(order="sorted")


@dataclass(frozen=True)
class Thresholds:
    gain_bound: float = -0.001
    retention_bound: float = 0.02
    resamples: int = 2000
    seed: int = 0


def thresholds_of(job: PreparedJob) -> Thresholds:
    g = job.job.recipe.gates
    return Thresholds(f64_decode(g.gain_bound), f64_decode(g.retention_bound), g.resamples, g.seed)


class GateRow(msgspec.Struct, frozen=True):
    gate: str  # gain, retention or generation
    set: str  # the held-out set (generation: "N answers", over every task set)
    value: float  # gain/retention: candidate - baseline nats per token; generation: candidate - baseline correct
    bound: float  # gain/retention: the upper one-sided 95% bound; generation: = value
    threshold: float
    passed: bool


class GateReport(msgspec.Struct, frozen=True, tag="shardtrain-gate-report", tag_field="type"):
    version: int
    job: str
    role: str
    baseline: str
    candidate: str
    resamples: int
    seed: int
    rows: tuple[GateRow, ...]
    passed: bool


def _find(report: EvalReport, commit: str) -> CommitEval:
    for c in report.commits:
        if c.commit == commit:
            return c
    raise JobError(f"commit {commit[:12]} was not evaluated")


def gate_report(report: EvalReport, thresholds: Thresholds, *, baseline: str, candidate: str) -> GateReport:
    """Apply the three gates to `candidate` against `baseline`, both in `report`."""
    base, cand = _find(report, baseline), _find(report, candidate)
    rows = []
    for b, c in zip(base.losses, cand.losses):
        if b.name != c.name:
            raise JobError(f"the two commits were evaluated on different sets ({b.name} vs {c.name})")
        diff, _, upper = paired_bootstrap(b, c, resamples=thresholds.resamples, seed=thresholds.seed)
        if b.kind == "task":
            rows.append(GateRow("gain", b.name, diff, upper, thresholds.gain_bound, upper < thresholds.gain_bound))
        else:
            rows.append(
                GateRow(
                    "retention", b.name, diff, upper, thresholds.retention_bound, upper <= thresholds.retention_bound
                )
            )
    gained = float(cand.correct - base.correct)
    rows.append(GateRow("generation", f"{len(cand.cases)} answers", gained, gained, 0.0, gained >= 0))
    return GateReport(
        _VERSION,
        report.job,
        report.role,
        base.commit,
        cand.commit,
        thresholds.resamples,
        thresholds.seed,
        tuple(rows),
        all(r.passed for r in rows),
    )


def write_gate_report(store: Store, report: GateReport) -> str:
    """Store the report as an object, pinned as ``gates/<job id>/<report id>``; return its id."""
    oid = store.put(_ENC.encode(report))
    store.sync()
    store.add_to_pin(f"gates/{report.job}/{oid}", [oid])
    return oid


def render_gates(report: GateReport, base: CommitEval | None = None, cand: CommitEval | None = None) -> list[str]:
    """The gates as a table (with generated-correct counts when the evaluations are given)."""
    lines = [
        f"{report.role} gates: candidate {report.candidate[:12]} vs baseline {report.baseline[:12]} "
        f"({report.resamples} paired-bootstrap resamples, seed {report.seed})",
        f"  {'gate':<11} {'set':<16} {'cand-base':>10} {'upper 95%':>10} {'threshold':>10}  result",
    ]
    for r in report.rows:
        if r.gate == "generation":
            counts = f" ({cand.correct if cand else '?'} vs {base.correct if base else '?'} correct)"
            lines.append(
                f"  {r.gate:<11} {r.set:<16} {r.value:>+10.0f} {'':>10} {'>= 0':>10}  "
                f"{'pass' if r.passed else 'FAIL'}{counts}"
            )
        else:
            op = "<" if r.gate == "gain" else "<="
            lines.append(
                f"  {r.gate:<11} {r.set:<16} {r.value:>+10.4f} {r.bound:>+10.4f} {op + f'{r.threshold:+.3f}':>10}  "
                f"{'pass' if r.passed else 'FAIL'}"
            )
    lines.append(f"  all gates: {'PASS' if report.passed else 'FAIL'}")
    return lines
