"""The main job on the embedded default: train, lose a worker, recover exactly, continue, evaluate.

`run_demo` reproduces the seed study's lifecycle at toy scale, with two local Gloo workers:

1. prepare the default job (byte-level tokenizer, generated tasks, tiny Llama);
2. the uninterrupted reference: cohort A from a fresh start, committing every `every`
   steps on ref `main`;
3. a fresh group restores the last commit before the end of cohort A (one commit interval
   early, so the replay is short) and worker 1 is killed during a later update, after a
   microbatch's forward and before the optimizer step; the survivor aborts naming the
   last committed step, and no ref names the lost work;
4. the host of slot 1 is lost with its memory tier (each worker has a tier directory of its
   own, standing in for separate hosts; SPEC.md §19.3); the survivor restores the common
   commit from its memory tier, the replacement from its buddy's replica of slot 1 (slot
   0's host), neither reading an object from the store; they replay to the end of cohort A
   on ref `recovery`, and the recovered commit id is compared with the uninterrupted one,
   next to the bytes each worker's restore read from each tier;
5. cohort B (new records plus declared replay of cohort A) continues `main`; the end of
   cohort A is regrouped onto one more worker (a repartition commit with the same
   learned-state root, no tensor object written) and the end of cohort B grown by one
   identity block (checked bitwise), neither trained further;
6. the seed, the end of cohort A and the end of cohort B are evaluated through the shards
   on the development sets (per-family generated answers, losses) and the development
   gates of both endpoints against the seed are reported and stored;
7. the cohort-B endpoint (fixed in advance, not picked by the gates) is selected, which
   opens the final sets; they are evaluated and gated the same way, and the store is
   verified.

Cohort A distils toward the seed on its conversation replay, cohort B toward the
committed end of cohort A (the recipe's references; `shardtrain.run.distill`). The sizes below
(`STEPS_A` ...) with `prepare_default`'s recipe are chosen so that cohort A learns the filter
family in generation within the demo's budget (docs/DEMO.md).

It reports through `say` (one line at a time); the CLI prints.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import shardstore
from shardtrain.errors import RunAborted
from shardtrain.job.default_job import prepare_default
from shardtrain.job.job import load_job
from shardtrain.job.roles import FINAL, select
from shardtrain.reshape.grow import grow, identity_check
from shardtrain.reshape.regroup import regroup
from shardtrain.run.evaluate import CommitEval, EvalReport, EvalSpec, evaluate
from shardtrain.run.gates import GateReport, gate_report, render_gates, thresholds_of, write_gate_report
from shardtrain.run.lifecycle import FAULT_ENV, RunResult, RunSpec, StepEvent, train

__all__ = ["DemoResult", "run_demo"]


@dataclass
class DemoResult:
    home: str
    store: str
    reference: str  # the uninterrupted run's end-of-cohort-A commit
    recovered: str  # the recovered run's end-of-cohort-A commit
    final: str  # the end of cohort B
    verify_ok: bool
    report: EvalReport | None = None
    final_report: EvalReport | None = None
    gates: list[GateReport] = field(default_factory=list)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    adaptive_ok: bool = True  # the repartition kept the learned-state root and the grown blocks are the identity
    recovery_restore: list[RunResult] = field(default_factory=list)  # the recovery's workers (bytes read per tier)

    @property
    def equal(self) -> bool:
        return self.reference == self.recovered


#: The demo's cohort sizes and commit interval (docs/DEMO.md).
STEPS_A, STEPS_B, EVERY, BATCH_SIZE, MICROBATCH_SIZE = 700, 12, 50, 32, 8


def run_demo(
    home: str,
    *,
    say: Callable[[str], None],
    progress: Callable[[StepEvent], None] | None = None,
    steps_a: int = STEPS_A,
    steps_b: int = STEPS_B,
    every: int = EVERY,
    crash_step: int | None = None,
    workers: int = 2,
    timeout: float = 60.0,
    batch_size: int = BATCH_SIZE,
    microbatch_size: int = MICROBATCH_SIZE,
) -> DemoResult:
    started = time.monotonic()
    timings: dict[str, float] = {}
    os.makedirs(home, exist_ok=True)
    store_url = os.path.join(home, "store")
    if os.path.exists(store_url):
        raise FileExistsError(f"{store_url} already exists; give the demo a fresh --home")
    # The group is lost in the last commit interval of cohort A, so the replay is one interval.
    resume_step = (steps_a - 1) // every * every
    crash_step = resume_step + every // 2 if crash_step is None else crash_step
    if not resume_step < crash_step < steps_a:
        raise ValueError(f"the crash step {crash_step} must lie between the resume step {resume_step} and {steps_a}")

    t = time.monotonic()
    job_path = prepare_default(
        os.path.join(home, "job"),
        steps_a=steps_a,
        steps_b=steps_b,
        batch_size=batch_size,
        microbatch_size=microbatch_size,
    )
    job = load_job(job_path)
    say(
        f"prepared job {job.id[:12]}: {len(job.records)} records, {job.num_steps} steps "
        f"(cohort A {steps_a}, cohort B {steps_b} with declared replay), schedule {job.schedule_id[:12]}, "
        f"tokenizer assets {', '.join(a.name for a in job.job.tokenizer)}"
    )
    store = shardstore.open_store(store_url)
    timings["prepare"] = time.monotonic() - t
    # Each worker's memory tier in a directory of its own, as if each ran on a host of its own;
    # two commits kept, so the group can restart from the commit before the last.
    tiers = tuple((s, os.path.join(home, f"memory-host{s + 1}")) for s in range(workers))
    last: list[RunResult] = []

    def run(name: str, env: dict[str, str] | None = None, **kw: object) -> dict[int, str]:
        t = time.monotonic()
        spec = RunSpec(
            job=job_path, store=store_url, every=every, progress=progress, memory_tiers=tiers, tier_commits=2, **kw
        )  # type: ignore[arg-type]
        last[:] = train(spec, workers, timeout=timeout, env=env)
        timings[name] = time.monotonic() - t
        return {c.step: c.id for c in last[0].commits}

    say(f"[1/7] uninterrupted run: steps 0-{steps_a} on {workers} workers, committing every {every} (ref main)")
    ref_commits = run("uninterrupted", until=steps_a, ref="main")
    reference, resume_from = ref_commits[steps_a], ref_commits[resume_step]
    say(f"      step {steps_a}: {reference}")
    kl_coef, temp = job.kl()
    say(
        f"      loss: CE on new records + {kl_coef:g} * T^2 * KL(reference || student) at T={temp:g} on "
        f"{sum(len(s.replay) for s in job.job.schedule.steps[:steps_a])} declared conversation replays, the "
        f"reference being the seed commit {ref_commits[0][:12]} (restored per slot, no new objects)"
    )

    say(
        f"[2/7] fresh group restores step {resume_step} ({resume_from[:12]}); worker 1 is killed during step "
        f"{crash_step}, after microbatch 0's forward and before the optimizer update"
    )
    t = time.monotonic()
    try:
        run(
            "crash",
            until=steps_a,
            resume=resume_from,
            ref="recovery",
            env={FAULT_ENV: f"slot=1,step={crash_step},microbatch=0"},
        )
        raise AssertionError("the injected fault did not stop the run")
    except RunAborted as exc:
        lines = str(exc).splitlines()
        timings["crash"] = time.monotonic() - t
    for line in lines:
        say(f"      {line}")
    say(
        f"      group stopped {timings['crash']:.1f} s after launch; ref 'recovery' is "
        f"{store.ref('recovery') or 'absent'}: no uncommitted update reached a ref"
    )

    say(
        f"[3/7] host 2 (slot 1) is lost with its memory tier {tiers[1][1]}; its replacement starts with an "
        f"empty tier, and slot 0's host holds slot 1's replica"
    )
    shutil.rmtree(tiers[1][1])

    say(f"[4/7] survivor + replacement restore step {resume_step} and replay to step {steps_a} (ref recovery)")
    rec_commits = run("recovery", until=steps_a, resume=resume_from, ref="recovery")
    recovery = list(last)
    recovered = rec_commits[steps_a]
    same = "EQUALS" if recovered == reference else "DIFFERS FROM"
    for r in recovery:
        b = r.restore
        say(
            f"      worker {r.rank} restored step {resume_step}: {b.memory} bytes from its memory tier, {b.peers} "
            f"from peers, {b.store} from the store"
            + (f" ({len(r.restore_rejected)} copies refused)" if r.restore_rejected else "")
        )
    say(f"      recovered step-{steps_a} commit {recovered} {same} the uninterrupted run's {reference}")
    say(f"      bytes the recovery's restore read from the store: {sum(r.restore.store for r in recovery)}")
    if recovered == reference:
        say("      (identical weights, Adam moments and ages, data cursor, RNG states, parent and job binding)")

    say(f"[5/7] cohort B: steps {steps_a}-{steps_a + steps_b}, new records plus declared replay (ref main)")
    final = run("cohort B", until=steps_a + steps_b, resume="main", ref="main")[steps_a + steps_b]
    say(f"      step {steps_a + steps_b}: {final}; its replays distilled toward the cohort-A endpoint {reference[:12]}")

    adaptive_ok = _adaptive(store, reference, final, workers, say, timings)

    seed = ref_commits[0]
    say(
        f"[6/7] development sets through the shards ({workers} workers): seed, step {steps_a}, step {steps_a + steps_b}"
    )
    t = time.monotonic()
    cases = len(job.eval_set("dev_task"))
    report = evaluate(
        EvalSpec(store=store_url, commits=(seed, reference, final), max_new_tokens=16, cases_per_set=cases),
        workers,
        timeout=timeout,
    )
    timings["evaluate"] = time.monotonic() - t
    for line in family_table(
        report.commits, {seed: "seed", reference: f"step {steps_a}", final: f"step {steps_a + steps_b}"}
    ):
        say(f"      {line}")
    dev_loss = [next(x.loss for x in e.losses if x.name == "dev_task") for e in report.commits]
    say(
        f"      development task loss (nats per assistant token): {' -> '.join(f'{v:.3f}' for v in dev_loss)} "
        f"(seed, step {steps_a}, step {steps_a + steps_b})"
    )
    counts = report.commits[1].family_counts()
    best = max(sorted(counts), key=lambda f: counts[f][0])
    say(
        f"      best family after cohort A: {best} {counts[best][0]}/{counts[best][1]} generated answers right "
        f"(seed {report.commits[0].family_counts().get(best, (0, 0))[0]}/{counts[best][1]}; docs/DEMO.md)"
    )
    thresholds = thresholds_of(job)
    gates = []
    for cand in (reference, final):
        g = gate_report(report, thresholds, baseline=seed, candidate=cand)
        oid = write_gate_report(store, g)
        gates.append(g)
        for line in render_gates(g, report.commits[0], next(c for c in report.commits if c.commit == cand)):
            say(f"      {line}")
        say(f"      report {oid[:16]} stored (pinned under gates/)")

    say(f"[7/7] select step {steps_a + steps_b} (the endpoint fixed before training), open the final sets")
    t = time.monotonic()
    sel = select(store, job.id, final)
    say(f"      selection {sel[:16]}: job {job.id[:12]} -> commit {final[:12]}")
    final_report = evaluate(
        EvalSpec(store=store_url, commits=(seed, final), max_new_tokens=16, cases_per_set=cases, role=FINAL),
        workers,
        timeout=timeout,
    )
    timings["final"] = time.monotonic() - t
    for line in family_table(final_report.commits, {seed: "seed", final: f"step {steps_a + steps_b}"}):
        say(f"      {line}")
    g = gate_report(final_report, thresholds, baseline=seed, candidate=final)
    oid = write_gate_report(store, g)
    gates.append(g)
    for line in render_gates(g, final_report.commits[0], final_report.commits[1]):
        say(f"      {line}")
    say(f"      report {oid[:16]} stored (pinned under gates/)")
    verified = shardstore.verify(store)
    say(
        f"shardstore verify {store_url}: {'ok' if verified.ok else 'PROBLEMS'} ({len(verified.commits)} commits, "
        f"{verified.objects_checked} objects, {verified.bytes_hashed} bytes re-hashed)"
    )
    return DemoResult(
        home,
        store_url,
        reference,
        recovered,
        final,
        verified.ok,
        report,
        final_report,
        gates,
        time.monotonic() - started,
        timings,
        adaptive_ok,
        recovery,
    )


def _adaptive(
    store: shardstore.Store,
    reference: str,
    final: str,
    workers: int,
    say: Callable[[str], None],
    timings: dict[str, float],
) -> bool:
    """Adaptive shards at no training cost: regroup the end of cohort A onto one more worker
    (ref ``wide``), and grow the end of cohort B by one identity block (ref ``grown``)."""
    t = time.monotonic()
    before = set(store.objects())
    made = regroup(store, reference, workers=workers + 1, ref="wide")
    tensors = {e.param for e in shardstore.load_commit(store, reference).entries().values()}
    same = made.learned_root == made.parent_learned_root
    say(
        f"[5a] regroup step {made.step} onto {workers + 1} workers (ref wide): repartition commit {made.commit[:16]}, "
        f"layers {','.join(f'{r.start}:{r.stop}' for r in made.partition.ranges)}"
    )
    say(
        f"      learned-state root {made.learned_root} {'EQUALS' if same else 'DIFFERS FROM'} step {made.step}'s "
        f"{made.parent_learned_root}; {len(set(store.objects()) - before)} new objects (shard manifests, commit, "
        f"the new slot's RNG), {len(set(made.new_objects) & tensors)} tensor objects written"
    )
    grown = grow(store, final, 1, ref="grown")
    layers = grown.partition.num_layers
    ok = identity_check(store, grown.commit, range(layers - 1, layers))
    say(
        f"[5b] grow step {grown.step} by one block copied from layer {layers - 2} (ref grown): grow commit "
        f"{grown.commit[:16]}, {layers} layers on {grown.partition.num_slots} workers"
    )
    say(
        f"      identity check: new layer {layers - 1} maps its input to itself bitwise: {'yes' if ok else 'NO'}; "
        f"its new parameters are born at step {grown.step} with Adam age 0"
    )
    timings["adaptive"] = time.monotonic() - t
    return same and ok


def family_table(commits: tuple[CommitEval, ...], labels: dict[str, str]) -> list[str]:
    """Generated answers right per task family, one row per commit."""
    families = sorted({c.family for e in commits for c in e.cases})
    lines = ["correct answers  " + "  ".join(f"{f:>7}" for f in families) + "      all"]
    for e in commits:
        counts = e.family_counts()
        cells = "  ".join(f"{counts.get(f, (0, 0))[0]:>3}/{counts.get(f, (0, 0))[1]:<3}" for f in families)
        lines.append(f"{labels.get(e.commit, e.commit[:12]):<15}  {cells}  {e.correct:>3}/{len(e.cases)}")
    return lines
