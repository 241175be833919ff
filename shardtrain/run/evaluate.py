"""Evaluation and inference through the shards: held-out loss, greedy generation, bootstrap.

Each worker restores only the weights its slot owns from a commit and runs its layers;
no worker builds the whole model. Activations go round the same ring as in training
(0 -> 1 -> ... -> n-1 -> 0; slot 0 embeds and applies the head), as checked messages.

- **Loss**: mean cross-entropy per assistant (weighted) token over each held-out set of
  the job, and per document (sum of token losses, sum of weights) for paired comparisons.
- **Greedy generation** with a KV cache on every stage: the prompt is run once (prefill)
  and each new token then costs one position per layer. Slot 0 picks the next token and
  broadcasts it, so every worker knows the generated tokens and when to stop (the end
  token or `max_new_tokens`). Answers are checked exactly against the record's answer.
- **Paired bootstrap**: documents are resampled with replacement, the same documents for
  both commits, and the one-sided 95% bounds of the per-token loss difference reported.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import numpy as np
import torch

import shardstore
from shardstore import Store, load_commit, open_store
from shardtrain.engine.partition import Partition, build_stage
from shardtrain.engine.ring import Ring
from shardtrain.errors import JobError, ResumeError, WorkerFailedError
from shardtrain.job.job import JOB_FILE, PreparedJob, decode_job, load_job
from shardtrain.job.roles import DEVELOPMENT, FINAL, open_finals
from shardtrain.reshape import admission
from shardtrain.reshape.planner import for_job
from shardtrain.run.lifecycle import DETERMINISTIC_ENV, commit_config, gate
from shardtrain.workers.launch import WorkerContext, launch_local

__all__ = [
    "EvalSpec",
    "SetLoss",
    "Case",
    "CommitEval",
    "Comparison",
    "EvalReport",
    "Ring",
    "evaluate",
    "evaluate_worker",
    "job_from_store",
    "paired_bootstrap",
]


@dataclass(frozen=True)
class EvalSpec:
    store: str
    commits: tuple[str, ...]  # targets; comparisons are each against the first
    job: str | None = None  # job.json; None: the job files kept in the store
    cases_per_set: int = 8  # generations per held-out set
    max_new_tokens: int = 24
    batch_size: int = 8
    message_timeout: float = 60.0
    out_dir: str | None = None
    role: str = DEVELOPMENT  # which held-out sets: development, or final (needs a selection; shardtrain.job.roles)


class SetLoss(msgspec.Struct, frozen=True):
    name: str
    loss: float  # mean nats per assistant token
    tokens: float
    doc_loss: tuple[float, ...]  # per document: sum of token losses
    doc_weight: tuple[float, ...]  # per document: sum of target weights
    kind: str = "task"  # the set's kind: task or retention


class Case(msgspec.Struct, frozen=True):
    set: str
    family: str
    prompt: str
    expected: str
    generated: str
    tokens: tuple[int, ...]
    correct: bool


class CommitEval(msgspec.Struct, frozen=True):
    commit: str
    step: int
    losses: tuple[SetLoss, ...]
    cases: tuple[Case, ...]
    tokens_per_second: float

    @property
    def correct(self) -> int:
        return sum(c.correct for c in self.cases)

    def family_counts(self) -> dict[str, tuple[int, int]]:
        """Per task family: (correct, generated)."""
        out: dict[str, tuple[int, int]] = {}
        for c in self.cases:
            right, n = out.get(c.family, (0, 0))
            out[c.family] = (right + c.correct, n + 1)
        return out


class Comparison(msgspec.Struct, frozen=True):
    set: str
    baseline: str
    commit: str
    diff: float  # per-token loss of commit minus baseline
    lower: float  # one-sided 95% lower bound
    upper: float  # one-sided 95% upper bound


class EvalReport(msgspec.Struct, frozen=True):
    job: str
    role: str
    workers: int
    commits: tuple[CommitEval, ...]
    comparisons: tuple[Comparison, ...]


def paired_bootstrap(
    base: SetLoss, new: SetLoss, *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(difference, lower, upper) of new minus base per-token loss, one-sided 95% bounds."""
    bl, bw = np.asarray(base.doc_loss), np.asarray(base.doc_weight)
    nl, nw = np.asarray(new.doc_loss), np.asarray(new.doc_weight)
    if bl.shape != nl.shape or not np.array_equal(bw, nw):
        raise ValueError("paired bootstrap needs the same documents, with the same target weights, on both sides")
    idx = np.random.default_rng(seed).integers(0, len(bl), size=(resamples, len(bl)))  # (R, N)
    w = bw[idx].sum(axis=1)  # (R,)
    diffs = (nl[idx].sum(axis=1) - bl[idx].sum(axis=1)) / w  # (R,)
    diff = float((nl.sum() - bl.sum()) / bw.sum())
    return diff, float(np.quantile(diffs, 0.05)), float(np.quantile(diffs, 0.95))


def job_from_store(store: Store, job_id: str, directory: str) -> PreparedJob:
    """Rebuild a job's directory from the objects `train` kept in the store, and verify it."""
    try:
        raw = bytes(store.get(job_id))
    except shardstore.ObjectNotFound:
        raise JobError(
            f"job {job_id[:12]}'s files are not in {store.url} (the commit was copied here without "
            f"--pin jobs/{job_id}, or gc removed them after that pin was dropped); pass --prepared JOB"
        ) from None
    path = os.path.join(directory, JOB_FILE)
    with open(path, "wb") as f:
        f.write(raw)
    job = decode_job(raw, f"job {job_id}")
    for asset in (*job.tokenizer, job.records):
        with open(os.path.join(directory, asset.name), "wb") as f:
            f.write(bytes(store.get(asset.blake3)))
    return load_job(path)


def _load_job(spec: EvalSpec, store: Store, tmp: str) -> PreparedJob:
    """The job given, or the one the first trained commit names (an import commit, such as a
    job's seed used as baseline, belongs to no job: the next commit decides)."""
    if spec.job is not None:
        return load_job(spec.job)
    for target in spec.commits:
        c = load_commit(store, target).commit
        if c.transition != "import":
            return job_from_store(store, c.job, tmp)
    raise JobError("every --commit is an import commit, which names no job: pass --prepared JOB")


def _check_member(store: Store, job: PreparedJob, cid: str) -> shardstore.LoadedCommit:
    """Commit `cid`, if `job` made it (or it was imported) with the job's model config; else ResumeError."""
    lc = load_commit(store, cid)
    if lc.commit.transition != "import" and lc.commit.job != job.id:
        raise ResumeError(f"commit {cid[:12]} was made by job {lc.commit.job[:12]}, not {job.id[:12]}")
    if commit_config(store, lc) != job.config:
        raise ResumeError(f"commit {cid[:12]} holds another model config than job {job.id[:12]}")
    return lc


def evaluate_worker(ctx: WorkerContext, spec: EvalSpec) -> EvalReport:
    """One slot of `evaluate`: every commit, every held-out set, the same generations."""
    torch.set_num_threads(1)
    rank, world = ctx.rank, ctx.world_size
    store = open_store(spec.store, create=False)
    with tempfile.TemporaryDirectory(prefix="shardtrain-eval-job-") as tmp:
        job = _load_job(spec, store, tmp)
    partition = Partition.even(job.config.num_hidden_layers, world)
    for target in spec.commits:  # every commit belongs to the job before any stage is built
        gate(f"check commit {target[:12]}", rank, world, lambda t=target: _check_member(store, job, store.resolve(t)))
    estimate = for_job(job, job.config, reference=False).estimate(rank, partition.layers(rank))
    gate("admit its slot", rank, world, lambda: admission.admit(rank, estimate, ctx.device))
    stage = build_stage(job.config, partition, rank, seed=0, device=ctx.device)
    ring = Ring(stage, partition, rank, timeout=spec.message_timeout)
    results = []
    for target in spec.commits:
        cid = shardstore.agree_on_commit(store, target) if world > 1 else store.resolve(target)

        def restore(cid: str = cid) -> int:
            lc = _check_member(store, job, cid)
            # only this slot's weights are read (its parameters by name: a declared share); RNG untouched
            shardstore.restore(store, cid, dict(stage.named_parameters()), rng=False)
            return lc.commit.step

        step = gate(f"restore commit {cid[:12]}", rank, world, restore)
        losses = []
        sets = job.eval_sets(spec.role)
        for es in sets:
            dl, dw = ring.losses(job, list(es.docs), spec.batch_size)
            if rank == 0:  # the head, and so the losses, live on slot 0
                losses.append(SetLoss(es.name, sum(dl) / sum(dw), sum(dw), tuple(dl), tuple(dw), es.kind))
        cases, generated, t0 = [], 0, time.perf_counter()
        tok = job.tokenizer
        for es in sets:
            if es.kind != "task":
                continue  # generation is checked on task answers only
            name = es.name
            for i in es.docs[: spec.cases_per_set]:
                rec = job.records[i]
                prompt = tok.encode_prompt(rec.as_dicts()[:-1])
                out = ring.generate(prompt, max_new_tokens=spec.max_new_tokens, stop={tok.end_id, tok.eos_id})
                generated += len(out)
                text = tok.decode([t for t in out if t not in (tok.end_id, tok.eos_id)])
                cases.append(
                    Case(
                        name,
                        rec.family,
                        rec.messages[0].content,
                        rec.answer,
                        text,
                        tuple(out),
                        text.strip() == rec.answer,
                    )
                )
        rate = generated / max(time.perf_counter() - t0, 1e-9)
        results.append(CommitEval(cid, step, tuple(losses), tuple(cases), rate))
    comparisons = []
    for other in results[1:] if rank == 0 else []:
        for base_set, new_set in zip(results[0].losses, other.losses):
            d, lo, hi = paired_bootstrap(base_set, new_set)
            comparisons.append(Comparison(base_set.name, results[0].commit, other.commit, d, lo, hi))
    report = EvalReport(job.id, spec.role, world, tuple(results), tuple(comparisons))
    if spec.out_dir is not None:
        with open(os.path.join(spec.out_dir, f"eval-rank{rank}.json"), "wb") as f:
            f.write(msgspec.json.encode(report))
    return report


def evaluate(
    spec: EvalSpec, workers: int | None = None, *, timeout: float = 60.0, in_process: bool = False
) -> EvalReport:
    """Evaluate `spec.commits` with `workers` processes (default: the first commit's slot count).

    `in_process` (one worker only) runs in this process without a process group.
    """
    store = open_store(spec.store, create=False)
    if not spec.commits:
        raise JobError("no commit to evaluate")
    n = workers if workers is not None else len(load_commit(store, spec.commits[0]).commit.layout)
    if spec.role not in (DEVELOPMENT, FINAL):
        raise JobError(f"unknown evaluation role {spec.role!r} (development or final)")
    if spec.job is not None:  # a prepared job: the commits must be its own, checked before any worker starts
        job = load_job(spec.job)
        Partition.even(job.config.num_hidden_layers, n)
        for target in spec.commits:
            _check_member(store, job, store.resolve(target))
    if spec.role == FINAL:  # the candidate is the last commit; checked (and recorded) before any final record is read
        candidate = load_commit(store, spec.commits[-1])
        open_finals(store, candidate.commit.job, candidate.id)
    if in_process:
        if n != 1:
            raise JobError("in_process evaluation runs one worker")
        ctx = WorkerContext(0, 1, 0, "gloo", torch.device("cpu"), timedelta(seconds=timeout))
        return evaluate_worker(ctx, spec)
    with tempfile.TemporaryDirectory(prefix="shardtrain-eval-") as out:
        run = EvalSpec(**{**spec.__dict__, "out_dir": out})
        try:
            launch_local(evaluate_worker, n, (run,), timeout=timedelta(seconds=timeout), env=DETERMINISTIC_ENV)
        except WorkerFailedError as exc:
            firsts = [m.splitlines()[0] if m else "" for m in exc.failures.values()]
            raise ResumeError("\n".join(firsts)) from exc
        reports = []
        for r in range(n):
            with open(os.path.join(out, f"eval-rank{r}.json"), "rb") as f:
                reports.append(msgspec.json.decode(f.read(), type=EvalReport))
    for r, rep in enumerate(reports[1:], 1):  # every worker saw the same generated tokens
        if [c.cases for c in rep.commits] != [c.cases for c in reports[0].commits]:
            raise ResumeError(f"worker {r} generated other tokens than worker 0")
    return reports[0]
