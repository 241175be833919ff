"""Lifecycle: train a prepared job across worker processes, committing through shardstore.

Each worker is one slot of the pipeline. It builds only its own stage and its own AdamW,
and starts in one of three ways, decided once for the whole group:

- fresh: every parameter from the job's seed, RNGs seeded per slot, and a step-0 commit
  (transition ``init``) so the starting point is itself a commit;
- from an imported commit (transition ``import``, weights only): each worker restores the
  weights it owns and AdamW starts at the first update;
- resume from an explicit commit: every worker resolves the target and all must name the
  same commit (``shardstore.agree_on_commit``); the commit must belong to this job,
  schedule and model; each worker restores only its slot (weights, Adam moments, ages,
  RNG) from the store, or from its own copy of the commit (``slot_stores``, e.g. made
  by ``shardstore.copy_commit(..., slot=K)`` on a replacement host).

Each worker builds its stage from the start commit's layout and model config (a grown
commit has more layers than its job); a commit laid out for another worker count is
refused by the workers, while `train` (the local launcher) first writes its repartition
commit (`regroup`) and resumes from that. Before allocating its stage every worker checks
the planner's estimate of its slot against the memory it really has free (`admission`),
and at the end the estimate, the actual peak and the parameters each held go to the
journal of the run's last commit.

Every check runs on every worker before the first update, and a worker that fails one
makes all of them stop (``_gate``), so a mismatched shard never trains half a group.
Commits happen between complete updates only, every ``every`` steps and at ``until``,
with the two-phase protocol of ``shardstore.save_distributed`` and an explicit parent,
so a replayed run writes byte-identical manifests and so identical commit ids. By
default a commit is written in the background from a staged copy while training goes on
(``shardtrain.run.committer``); ``async_commits=False`` makes the step loop wait for it.

When a peer is lost mid-update the survivors' pipeline waits fail within their timeout,
and each survivor raises ``RunAborted`` naming the last committed step: nothing after it
reached the store's ref. ``SHARDTRAIN_FAULT=slot=S,step=N,microbatch=M`` makes slot S
exit abruptly after that microbatch's forward, once any commit it has in flight has
landed (the fault injection used by the demo and the tests; ``SHARDTRAIN_COMMIT_FAULT``
in ``shardtrain.run.committer`` loses a worker while a commit is being written).
"""

from __future__ import annotations

import os
import random
import resource
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import msgspec
import numpy as np
import torch
import torch.distributed as dist

import shardstore
from shardstore import CommitInfo, LoadedCommit, Store, load_commit, open_store
from shardstore.format.manifest import MAX_MANIFEST_BYTES, decode_config
from shardtrain.engine.model import LlamaConfig
from shardtrain.engine.optim import AdamW
from shardtrain.engine.partition import build_stage, parameter_inventory
from shardtrain.engine.pipeline import Pipeline
from shardtrain.engine.profile import compute_context
from shardtrain.engine.profile import label as profile_label
from shardtrain.engine.schedule import build as build_schedule
from shardtrain.engine.trainer import Trainer
from shardtrain.errors import (
    AdmissionError,
    JobError,
    LaunchError,
    ResumeError,
    RunAborted,
    ShardtrainError,
    TransitionError,
    WorkerFailedError,
)
from shardtrain.job.hf_tokenizer import commit_config_dict
from shardtrain.job.job import PreparedJob, load_job
from shardtrain.reshape import admission
from shardtrain.reshape.planner import for_job
from shardtrain.reshape.regroup import grown_from, regroup, start_layout
from shardtrain.run.committer import CommitBook, CommitRecord, Committer
from shardtrain.run.dependencies import check_dependencies, check_shared_store, pin_references
from shardtrain.run.distill import Distiller, check_reference_depths, reference_steps
from shardtrain.run.faults import FAULT_ENV, Fault, fault_from_env, inject_fault
from shardtrain.run.tiers import AUTO_TIER, RestoreBytes, SlotTiers, TierSpec
from shardtrain.workers.launch import WorkerContext, launch_local

__all__ = [
    "DETERMINISTIC_ENV",
    "FAULT_ENV",
    "PROFILE",
    "RunSpec",
    "StepEvent",
    "RunResult",
    "train",
    "train_worker",
    "start_slot",
    "raise_failure",
    "REFUSALS",
    "SlotStart",
    "check_commit",
    "open_start",
    "store_job_files",
    "gate",
    "Fault",
    "fault_from_env",
    "check_tiers",
]

T = TypeVar("T")
PROFILE = "fp32"
DETERMINISTIC_ENV = {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
AUTO_RESUME = "auto"
"""``--resume auto``: the run's ref if it exists (a restarted group), else the job's start."""


@dataclass(frozen=True)
class RunSpec:
    """One launch of `train`: what to train, where to commit, and from where to start."""

    job: str  # path of job.json
    store: str  # the run's store: every commit goes here
    until: int  # train until this many updates are complete
    every: int | None = None  # commit every `every` steps (and always at `until`)
    resume: str | None = None  # an explicit commit (id, prefix or ref) to resume from, or AUTO_RESUME
    ref: str = "main"  # the ref that follows this run's commits
    slot_stores: tuple[tuple[int, str], ...] = ()  # (slot, store): restore that slot from its own copy
    message_timeout: float = 60.0  # seconds a pipeline message may take before the peer counts as lost
    out_dir: str | None = None  # where each worker writes rank{r}.json
    progress: Callable[[StepEvent], None] | None = None  # called on the coordinator (must be importable)
    schedule: str = "overlapped"  # the pipeline schedule (shardtrain.engine.schedule); not bound: results are identical
    async_commits: bool = True  # write commits in the background from a staged copy (shardtrain.run.committer)
    memory_tier: str | None = (
        AUTO_TIER  # every host's memory tier root ('auto': /dev/shm, named for the store; None: none)
    )
    memory_tiers: tuple[tuple[int, str], ...] = ()  # (slot, dir): that slot's host's tier root (tests' stand-in hosts)
    peer_replicas: int | None = None  # buddies holding each slot's objects (None: 1 with >= 2 workers; 0: none)
    tier_commits: int = 1  # commits each memory tier holds (the closure of the last K)

    def tier_spec(self) -> TierSpec:
        return TierSpec(self.store, self.memory_tier, self.memory_tiers, self.peer_replicas, self.tier_commits)


@dataclass(frozen=True)
class StepEvent:
    """One completed update, as the coordinator reports it."""

    step: int  # updates complete after it
    until: int
    loss: float
    grad_norm: float
    tokens: int
    seconds: float
    commit: str | None  # a commit that became durable (acknowledged, ref moved) by the end of this update
    commit_step: int | None = None  # the step that commit holds (earlier than `step` for a background commit)


class StepRecord(msgspec.Struct, frozen=True):
    step: int
    loss: float
    grad_norm: float
    tokens: int
    seconds: float


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker did: commits, per-step numbers, peak memory and what it held."""

    rank: int
    job: str
    start_step: int
    start_commit: str | None
    commits: tuple[CommitRecord, ...]
    steps: tuple[StepRecord, ...]
    parameters: int  # elements this worker owned
    parameter_bytes: int
    peak_rss_bytes: int
    seconds: float
    estimate_bytes: int = 0  # the planner's estimate of this slot's peak (admission checked it)
    used_bytes: int = 0  # the actual peak above the memory in use at admission (CPU: RSS; CUDA: allocated)
    restore_seconds: float = 0.0  # restoring this worker's slot of the start commit (0: fresh)
    restore: RestoreBytes = RestoreBytes()  # bytes of objects its start read from each tier (SPEC.md §19.3)
    restore_rejected: tuple[str, ...] = ()  # tier or peer copies refused (verified against their ids): where from
    tier_bytes: int = 0  # bytes its host's memory tiers held for it at the end (its slot's and the replicas it keeps)
    tier_errors: tuple[str, ...] = ()  # tier fills or replications that failed (the commits are durable regardless)


def start_target(job: PreparedJob, store: Store, spec: RunSpec) -> str | None:
    """What a run starts from: ``--resume`` as given, or for ``auto`` the commit the run's ref
    names (resolved to its id) if the ref exists, else the job's seed (None: fresh)."""
    if spec.resume == AUTO_RESUME:
        current = store.ref(spec.ref)
        return current if current is not None else job.job.seed.commit
    return spec.resume if spec.resume is not None else job.job.seed.commit


def gate(what: str, rank: int, world: int, fn: Callable[[], T]) -> T:
    """Run `fn` on every worker; if it fails on any, every worker raises (collective)."""
    err: BaseException | None = None
    out: Any = None
    try:
        out = fn()
    except Exception as exc:  # reported to every worker below, then re-raised here
        err = exc
    failed = [rank] if err is not None else []
    if world > 1:
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(flags, torch.tensor([0 if err is None else 1], dtype=torch.int64))
        failed = [r for r, f in enumerate(flags) if int(f.item())]
    if err is not None:
        raise err
    if failed:
        raise ResumeError(
            f"slot {rank}: slot(s) {failed} could not {what}; nothing was trained (their own errors name the cause)"
        )
    return out


def _same_on_all(flag: bool, rank: int, world: int) -> bool:
    """``flag`` if every worker has the same value; ResumeError otherwise."""
    if world > 1:
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(flags, torch.tensor([int(flag)], dtype=torch.int64))
        if len({int(f.item()) for f in flags}) != 1:
            raise ResumeError(f"slot {rank}: workers disagree on whether the run starts fresh; refusing to start")
    return flag


def commit_config(store: Store, lc: LoadedCommit) -> LlamaConfig | None:
    if lc.commit.config is None:
        return None
    return LlamaConfig.from_hf_dict(decode_config(store.get(lc.commit.config, limit=MAX_MANIFEST_BYTES)))


def check_commit(job: PreparedJob, store: Store, lc: LoadedCommit, *, until: int) -> None:
    """Refuse a start commit that does not belong to this job (before any training)."""
    c = lc.commit
    short = lc.id[:12]
    config = commit_config(store, lc)
    if config != job.config and not grown_from(job.config, config):
        raise ResumeError(f"commit {short} holds model config {config} but the job's is {job.config}")
    if c.transition == "import":
        return  # weights only: no job, schedule or optimizer state to match
    if c.job != job.id:
        raise ResumeError(
            f"commit {short} was made by job {c.job[:12]}, not by this job {job.id[:12]} "
            f"(a different job file, records, schedule or tokenizer asset); refusing to resume"
        )
    if c.schedule != job.schedule_id:
        raise ResumeError(f"commit {short} follows schedule {c.schedule}, the job's is {job.schedule_id}")
    if c.step > until:
        raise ResumeError(f"commit {short} is at step {c.step}, past --until {until}")
    if c.data_cursor != job.cursor(c.step):
        raise ResumeError(
            f"commit {short} has data cursor {c.data_cursor}, the job's schedule gives "
            f"{job.cursor(c.step)} at step {c.step}"
        )


def open_start(job: PreparedJob, store: Store, target: str | None, *, until: int) -> LoadedCommit | None:
    """The commit a run starts from (None: fresh), verified against the job."""
    if target is None:
        return None
    lc = load_commit(store, target)
    check_commit(job, store, lc, until=until)
    return lc


def check_ref(store: Store, ref: str, start: str | None) -> None:
    """A run may only move a ref that is absent or points at the commit it starts from."""
    current = store.ref(ref)
    if current is not None and current != start:
        step = store.commit(current).step
        raise ResumeError(
            f"ref {ref!r} points at commit {current[:12]} (step {step}), not at this run's start "
            f"{start[:12] if start else '(fresh)'}; continuing would move it elsewhere: pass --resume "
            f"{ref} or choose another --ref"
        )


#: Tries at pinning a job another run of the same job is pinning at the same moment (~2 s in all).
_PIN_ATTEMPTS = 14


def store_job_files(job: PreparedJob, store: Store) -> None:
    """Keep the job file and everything it binds in the store, as objects named by their hash,
    pinned as ``jobs/<job id>`` so that gc keeps them for ``evaluate`` (SPEC.md §Pins)."""
    ids = [store.put(data) for data in job.files.values()]
    store.sync()  # durable before the pin names them
    store.add_to_pin(f"jobs/{job.id}", ids, attempts=_PIN_ATTEMPTS)  # CAS: another run's additions are kept


def _seed_rng(job: PreparedJob, slot: int) -> None:
    seed = (job.job.seed.init_seed * 1_000_003 + slot) % (2**32)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _tokens(batch: Any) -> int:
    t = batch.weights.shape[1]
    pos = torch.arange(1, t + 1).expand_as(batch.weights)
    return int(torch.where(batch.weights > 0, pos, 0).amax(dim=1).sum())


@dataclass
class SlotStart:
    """What a worker's start phase settled: its job and stores, the commit the whole group
    agreed to start from (None: a fresh start), its admitted memory, and its slot of the model
    and optimizer, restored."""

    job: PreparedJob
    store: Store  # the run's store: every commit goes here
    own: Store  # where this slot's start is read from (the run's store or the slot's own copy)
    config: LlamaConfig
    partition: Any
    estimate: Any  # the planner's SlotEstimate of this slot, which admission checked
    free: int
    baseline: int
    stage: torch.nn.Module
    optimizer: AdamW
    start: LoadedCommit | None
    restore_seconds: float
    tiers: SlotTiers  # its memory tier and the replicas it keeps
    restore_bytes: RestoreBytes  # what its restore read from each tier

    @property
    def step(self) -> int:
        """Updates complete at the start (an imported model starts at 0)."""
        lc = self.start
        return 0 if lc is None or lc.commit.transition == "import" else lc.commit.step

    @property
    def parent(self) -> str | None:
        return None if self.start is None else self.start.id


def start_slot(ctx: WorkerContext, spec: RunSpec) -> SlotStart:
    """A worker's start: agree with the group on one start commit, admit the slot's memory,
    build the slot and restore it (collective: every worker runs it)."""
    rank, world = ctx.rank, ctx.world_size
    job = load_job(spec.job)
    store = open_store(spec.store)
    durable = open_store(dict(spec.slot_stores).get(rank, spec.store))
    check_shared_store(store, rank, world)  # every commit goes to one store: private ones are refused here
    # One start for the whole group: every worker resolves it, and all must agree (a fresh
    # start included), before anything is restored.
    target = start_target(job, store, spec)
    fresh = gate("agree on a fresh start", rank, world, lambda: _same_on_all(target is None, rank, world))
    cid = None if fresh else shardstore.agree_on_commit(durable, target)  # type: ignore[arg-type]
    # Its slot's objects from its memory tier, else from its buddies, else from the store.
    tiers = gate("open its memory tier", rank, world, lambda: SlotTiers.open(spec.tier_spec(), rank, world))
    if cid is not None:
        tiers.fetch(cid)  # collective: a worker whose tier lacks the start gets it from its buddies
    own = tiers.reader(durable)
    config, partition = gate("read the start commit's layout", rank, world, lambda: start_layout(job, own, cid, world))
    # The estimate counts what its host's memory tiers will hold (its slot's commits and the
    # replicas it keeps), less what they hold already.
    model = for_job(job, config, tier_commits=tiers.kept_commits, replicas=tiers.replicas)
    estimate = model.estimates(partition)[rank]
    held = sum(tiers.held_bytes())
    free, baseline = gate("admit its slot", rank, world, lambda: admission.admit(rank, estimate, ctx.device, held))
    stage = build_stage(
        config, partition, rank, seed=job.job.seed.init_seed, device=ctx.device, init_std=job.init_std()
    )
    optimizer = AdamW(stage.named_parameters(), job.groups(), schedule=job.lr_schedule())
    t_restore = time.perf_counter()
    lc = gate(
        "restore the start commit",
        rank,
        world,
        lambda: _restore_slot(job, store, own, cid, spec, rank, world, stage, optimizer),
    )
    restore_seconds = time.perf_counter() - t_restore if lc is not None else 0.0
    same_layout = lc is not None and lc.commit.transition != "import" and len(lc.shards) == world
    restored = tiers.restored(lc, same_layout)
    return SlotStart(
        job,
        store,
        own,
        config,
        partition,
        estimate,
        free,
        baseline,
        stage,
        optimizer,
        lc,
        restore_seconds,
        tiers,
        restored,
    )


def _restore_slot(
    job: PreparedJob,
    store: Store,
    own: Store,
    cid: str | None,
    spec: RunSpec,
    rank: int,
    world: int,
    stage: torch.nn.Module,
    optimizer: AdamW,
) -> LoadedCommit | None:
    """Restore this slot of the start commit `cid` (None: seed the RNG for a fresh start)."""
    lc = open_start(job, own, cid, until=spec.until)
    if rank == 0:
        check_ref(store, spec.ref, cid)
        check_dependencies(store, job, lc, spec.until)  # frozen references, the seed: before any update
    if lc is None:
        _seed_rng(job, rank)
    elif lc.commit.transition == "import":
        # weights only; AdamW starts at the first update. The stage is a piece of the imported
        # model: its parameters by name are its declared share (a strict restore of the module
        # would refuse the other stages' tensors as unexpected)
        shardstore.restore(own, lc.id, dict(stage.named_parameters()), rng=False)
        _seed_rng(job, rank)
    else:
        same_layout = len(lc.shards) == world and bool(lc.shards[rank].rng)
        piece = stage if same_layout else dict(stage.named_parameters())  # slot=rank covers exactly the stage
        shardstore.restore(own, lc.id, piece, optimizer, rng=same_layout, slot=rank if same_layout else None)
        if not same_layout:
            _seed_rng(job, rank)
    return lc


def _usage(ctx: WorkerContext, slot: SlotStart) -> admission.Usage:
    """This worker's memory and what it holds now (the journal's and the result's figures)."""
    tier, replicas = slot.tiers.held_bytes()
    return admission.Usage(
        slot=ctx.rank,
        estimate=slot.estimate.total,
        free=slot.free,
        baseline=slot.baseline,
        peak=admission.peak_bytes(ctx.device),
        parameters=sum(p.numel() for p in slot.stage.parameters()),
        parameter_bytes=sum(parameter_inventory(slot.stage).values()),
        tier_bytes=tier,
        replica_bytes=replicas,
        tier_estimate=slot.estimate.tier,
        restore_memory=slot.restore_bytes.memory,
        restore_peers=slot.restore_bytes.peers,
        restore_store=slot.restore_bytes.store,
    )


def train_worker(ctx: WorkerContext, spec: RunSpec) -> None:
    """One slot of `train` (started by `launch_local` or under torchrun), in three phases: the
    start (`start_slot`: agree, admit, restore), the step loop (`_step_loop`, committing
    through a `CommitBook`), and the worker's result."""
    started = time.monotonic()
    torch.set_num_threads(1)
    rank, world = ctx.rank, ctx.world_size
    slot = start_slot(ctx, spec)
    written = slot.tiers.writer(slot.store)  # every object it commits is kept in its memory tier as well
    committer = Committer(
        written,
        slot.stage,
        slot.optimizer,
        rank=rank,
        ref=spec.ref,
        last=(slot.step, slot.parent),
        asynchronous=spec.async_commits,
        timeout=timedelta(seconds=spec.message_timeout),
        after=lambda cid, group: slot.tiers.landed(written, cid, group),
    )
    book = CommitBook(committer, slot.store, rank=rank, world=world, usage=lambda: _usage(ctx, slot))
    try:
        steps = _step_loop(ctx, spec, slot, book)
    except (ShardtrainError, shardstore.ShardstoreError, RuntimeError) as exc:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        cause = cause.split(" This is typically caused")[0]  # Gloo's advice is not about this run
        last = committer.settle()  # a commit in flight has landed or failed (its error is not the cause)
        step = max(book.losses, default=slot.step)  # updates complete when it failed (the loop records each)
        where = f"commit {last[1]}" if last[1] else "no commit"
        raise RunAborted(
            f"slot {rank}: run aborted during step {step} ({type(exc).__name__}: {cause}); the last "
            f"committed step is {last[0]} ({where}); later updates were not committed and no ref "
            f"names them; resume with --resume {last[1] or '(fresh)'}"
        ) from exc
    if spec.out_dir is not None:
        final = _usage(ctx, slot)
        result = RunResult(
            rank=rank,
            job=slot.job.id,
            start_step=slot.step,
            start_commit=slot.parent,
            commits=tuple(book.commits),
            steps=tuple(steps),
            parameters=final.parameters,
            parameter_bytes=final.parameter_bytes,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            seconds=time.monotonic() - started,
            estimate_bytes=slot.estimate.total,
            used_bytes=final.used,
            restore_seconds=slot.restore_seconds,
            restore=slot.restore_bytes,
            restore_rejected=tuple(slot.tiers.rejected),
            tier_bytes=final.tier_bytes + final.replica_bytes,
            tier_errors=tuple(slot.tiers.errors),
        )
        with open(os.path.join(spec.out_dir, f"rank{rank}.json"), "wb") as f:
            f.write(msgspec.json.encode(result))


def _step_loop(ctx: WorkerContext, spec: RunSpec, slot: SlotStart, book: CommitBook) -> list[StepRecord]:
    """Train from the start to ``spec.until``, committing at the run's commit steps and at the
    end; return every update's numbers. Nothing is in flight when it returns."""
    rank, world, job, committer = ctx.rank, ctx.world_size, slot.job, book.committer
    step = slot.step
    pipe = Pipeline(
        slot.stage,
        slot.partition,
        rank,
        timeout=timedelta(seconds=spec.message_timeout),
        schedule=spec.schedule,
        compute=compute_context(job.job.profile, ctx.device),  # the profile's autocast (or none), forward only
        recompute=bool(job.job.profile and job.job.profile.recompute),
    )
    faults = {(f.step, f.microbatch): f for f in fault_from_env() if f.slot in (rank, -1)}
    if faults:
        pipe.after_forward = lambda s, m: (committer.settle(), inject_fault(faults[s, m])) if (s, m) in faults else None
    distiller = Distiller(job, slot.store, slot=rank, num_slots=world, device=ctx.device, timeout=spec.message_timeout)
    must_commit = reference_steps(job, step, spec.until)  # endpoints a later cohort of this run distils toward
    trainer = Trainer(
        pipe,
        slot.optimizer,
        microbatch_size=job.job.recipe.microbatch_size,
        max_grad_norm=job.max_grad_norm(),
        global_step=step,
    )
    hf, profile = commit_config_dict(slot.config, job.tokenizer), profile_label(job.job.profile)

    def commit(at: int, transition: str) -> None:
        book.commit(
            CommitInfo(
                step=at,
                job=job.id,
                schedule=job.schedule_id,
                profile=profile,
                config=hf,
                data_cursor=job.cursor(at),
                transition=transition,
            )
        )

    steps: list[StepRecord] = []
    if slot.start is None:
        commit(0, "init")
        book.landed(wait=True)  # the start of the chain, before a cohort distils toward the seed
    if rank == 0 and step == 0 and committer.last[1] is not None:  # the seed: what copy --with-deps brings
        pin_references(slot.store, job, [committer.last[1]])
    while step < spec.until:
        t0 = time.perf_counter()
        batch = job.batch(step)
        with pipe.compute():  # the frozen reference's pass, under the profile's computation like the student's
            pipe.distill = distiller.targets(step, batch, committer.last[1])
        r = trainer.step(batch)
        seconds = time.perf_counter() - t0  # the update alone, not the commit after it
        step += 1
        book.losses[step] = r.loss
        if step == spec.until or (spec.every and step % spec.every == 0) or step in must_commit:
            commit(step, "train")
        # A reference endpoint must be on the chain before the next cohort distils toward it.
        made = book.landed(wait=step == spec.until or step in must_commit)
        if rank == 0 and step in must_commit and made is not None:
            pin_references(slot.store, job, [made[1]])
        steps.append(StepRecord(step, r.loss, r.grad_norm, _tokens(batch), seconds))
        if rank == 0 and spec.progress is not None:
            spec.progress(
                StepEvent(
                    step,
                    spec.until,
                    r.loss,
                    r.grad_norm,
                    _tokens(batch),
                    seconds,
                    made[1] if made else None,
                    made[0] if made else None,
                )
            )
    book.landed(wait=True)  # nothing is left in flight
    committer.close()
    return steps


#: What a worker raises when it refuses its start (a wrong commit, job, store, layout): the
#: whole group refusing these is a refused start (`ResumeError`), not a lost worker.
REFUSALS: tuple[type[BaseException], ...] = (
    ResumeError,
    JobError,
    AdmissionError,
    TransitionError,
    shardstore.CommitProtocolError,
    shardstore.CorruptObject,
    shardstore.ObjectNotFound,
    shardstore.BindingError,
    shardstore.TensorMismatch,
    shardstore.StateMismatch,
    shardstore.ManifestError,
    shardstore.TargetNotFound,
    shardstore.CursorError,
    shardstore.LayoutError,
)


def raise_failure(err: WorkerFailedError) -> None:
    """A lost worker becomes `RunAborted`; a refused admission `AdmissionError`; a start every
    worker refused `ResumeError`; anything else stays as is. Routed by the classes each worker
    recorded for what it raised (`WorkerFailedError.ranks_raising`), not by its text."""
    firsts = {rank: (msg.splitlines()[0] if msg else "") for rank, msg in err.failures.items()}
    known = set(err.ranks_raising(RunAborted, *REFUSALS))
    lines = [f if r in known else f"worker {r}: {f}" for r, f in firsts.items()]
    if err.ranks_raising(RunAborted):
        raise RunAborted("\n".join(lines)) from err
    if err.ranks_raising(AdmissionError):
        raise AdmissionError("\n".join(lines)) from err
    if set(err.ranks_raising(*REFUSALS)) == set(firsts):
        raise ResumeError("\n".join(lines)) from err
    raise err


def train(
    spec: RunSpec,
    workers: int = 2,
    *,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    join_timeout: float = 900.0,
) -> list[RunResult]:
    """Launch `workers` local processes to run `spec`; return every worker's result.

    Checks what can be checked without tensors first (job files, the start commit's
    manifests and binding, the ref), so a wrong resume fails before any worker starts.
    Raises `RunAborted` if a worker is lost, naming the last committed step.
    """
    job = load_job(spec.job)
    if not 0 <= spec.until <= job.num_steps:
        raise JobError(f"--until {spec.until} is outside the job's schedule of {job.num_steps} steps")
    if spec.every is not None and spec.every < 1:
        raise JobError(f"--every must be >= 1, got {spec.every}")
    build_schedule(spec.schedule, 1, 1)  # an unknown schedule is refused before any worker starts
    check_tiers(spec, workers)
    store = open_store(spec.store)
    lc = open_start(job, store, start_target(job, store, spec), until=spec.until)
    check_dependencies(store, job, lc, spec.until)
    check_ref(store, spec.ref, None if lc is None else lc.id)
    check_reference_depths(
        job, store, None if lc is None else lc.id, 0 if lc is None else lc.commit.step, spec.until, workers
    )  # a reference no worker could build is refused here, not inside step 1
    if lc is not None and lc.commit.transition != "import" and len(lc.shards) != workers:
        if spec.slot_stores:
            raise ResumeError(
                f"commit {lc.id[:12]} is laid out for {len(lc.shards)} workers, not {workers}, and slots "
                f"are restored from their own stores: run shardtrain regroup first, then copy --slot"
            )
        made = regroup(store, lc.id, workers=workers, ref=spec.ref if store.ref(spec.ref) == lc.id else None)
        spec, lc = RunSpec(**{**spec.__dict__, "resume": made.commit}), load_commit(store, made.commit)
    store_job_files(job, store)
    with tempfile.TemporaryDirectory(prefix="shardtrain-run-") as out:
        run = RunSpec(**{**spec.__dict__, "out_dir": out})
        try:
            launch_local(
                train_worker,
                workers,
                (run,),
                timeout=timedelta(seconds=timeout),
                env={**DETERMINISTIC_ENV, **(env or {})},
                join_timeout=join_timeout,
            )
        except WorkerFailedError as exc:
            raise_failure(exc)
        return _read_results(out, workers)


def check_tiers(spec: RunSpec, workers: int) -> None:
    """Refuse tier options no worker could use before any starts: a slot outside the group, a
    negative replica count, a tier holding no commit, a directory that is not this user's own."""
    if spec.tier_commits < 1:
        raise JobError(f"a memory tier holds at least one commit, not {spec.tier_commits}")
    if spec.peer_replicas is not None and spec.peer_replicas < 0:
        raise JobError(f"--peer-replicas must be >= 0, got {spec.peer_replicas}")
    for slot, _dir in spec.memory_tiers:
        if not 0 <= slot < workers:
            raise JobError(f"--memory-tier {slot}=...: there is no slot {slot} among {workers} workers")
    for slot in range(workers):  # makes each directory (0700) or refuses it (TierError)
        SlotTiers.open(spec.tier_spec(), slot, workers)


def _read_results(out: str, workers: int) -> list[RunResult]:
    """Every worker's result file; LaunchError naming the worker if one does not decode (docs/SHARDTRAIN-FORMATS.md §3)."""
    results = []
    for r in range(workers):
        try:
            with open(os.path.join(out, f"rank{r}.json"), "rb") as f:
                results.append(msgspec.json.decode(f.read(), type=RunResult))
        except (OSError, msgspec.ValidationError, msgspec.DecodeError) as e:  # never a traceback
            raise LaunchError(f"worker {r}'s result file could not be read: {e}") from None
    return results
