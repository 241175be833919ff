"""Distillation toward a frozen reference partitioned across the same workers as the student.

The recipe names one reference per cohort (`job.CohortReference`): the job's **seed**
(the step-0 ``init`` commit of a fresh job, or the imported seed commit), or the
committed **endpoint** of an earlier cohort (cohort B: the end of cohort A, with what
cohort A learned). The reference is found on the run's own chain of commits: walking
parents back from the newest commit to the seed, or to the commit at the earlier
cohort's last step. Its id is therefore bound by the hash chain of every later commit.

Each worker builds only the reference layers of its own slot (`Partition.even` over the
reference's own depth: the student's split while the depths agree; after growth the
reference keeps its depth and its layers are split evenly over the same workers) and
restores them from the reference commit's objects. Nothing is written: a frozen
reference costs no bytes in the store. No worker holds a whole student or reference.

Before the student's forward and backward of a step whose cohort declares replay
records, the replay rows of the batch go once round the ring through the reference,
forward only (`Ring`, message kind ``REFERENCE``), and slot 0 keeps the reference's
log-probabilities at the recipe's temperature; `shardtrain.engine.loss` then adds
``coef * T**2 * KL(p_ref || p_student)`` on those rows only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardstore
from shardstore import ShardstoreError, Store, load_commit
from shardstore.format.manifest import MAX_MANIFEST_BYTES, decode_config
from shardtrain.engine.batch import Batch
from shardtrain.engine.loss import DistillTargets
from shardtrain.engine.messages import REFERENCE
from shardtrain.engine.model import Llama, LlamaConfig
from shardtrain.engine.partition import Partition, build_stage
from shardtrain.engine.ring import Ring
from shardtrain.errors import DistillError
from shardtrain.job.job import PreparedJob

__all__ = ["find_reference", "Reference", "Distiller", "reference_steps", "reference_bytes", "check_reference_depths"]


def find_reference(store: Store, job: PreparedJob, cohort: str, head: str | None) -> str | None:
    """The id of `cohort`'s reference commit on the chain ending at `head` (None: no reference)."""
    ref = job.reference_of(cohort)
    if ref is None:
        return None
    if ref.source == "seed" and job.job.seed.kind == "import":
        assert job.job.seed.commit is not None
        return job.job.seed.commit
    want = None if ref.source == "seed" else job.cohort_end(ref.of or "")
    cid = head
    while cid is not None:
        c = store.commit(cid)
        if (want is None and (c.parent is None or c.transition in ("init", "import"))) or c.step == want:
            return cid
        if want is not None and c.step < want:
            break
        cid = c.parent
    what = "the seed" if want is None else f"cohort {ref.of}'s endpoint (step {want})"
    raise DistillError(
        f"cohort {cohort}'s reference, {what}, is not on the chain of commits ending at "
        f"{head[:12] if head else '(none)'}; it must be committed before cohort {cohort} trains"
    )


def reference_steps(job: PreparedJob, start: int, until: int) -> set[int]:
    """Steps in (start, until] that must be committed because a later cohort in the run distils toward them."""
    cohorts = {s.cohort for s in job.job.schedule.steps[start:until]}
    out = set()
    for c in cohorts:
        ref = job.reference_of(c)
        if ref is not None and ref.source == "endpoint" and start < job.cohort_end(ref.of or "") <= until:
            out.add(job.cohort_end(ref.of or ""))
    return out


def check_reference_depths(
    job: PreparedJob, store: Store, head: str | None, start: int, until: int, workers: int
) -> None:
    """Refuse, before any worker starts, a run whose cohorts in (start, until] distil toward a
    committed reference too shallow to split over `workers` (each worker builds
    `Partition.even(reference depth, workers)`; README §Distillation). A reference this run
    commits itself is the student's own depth, which the student's split already allows."""
    for cohort in sorted({s.cohort for s in job.job.schedule.steps[start:until]}):
        try:
            cid = find_reference(store, job, cohort, head)
        except (DistillError, ShardstoreError):
            continue  # an endpoint this run commits first, or a chain not all here: the workers decide, as before
        if cid is None or not store.has(cid):
            continue
        config_id = store.commit(cid).config
        if config_id is None:
            raise DistillError(f"cohort {cohort}'s reference commit {cid[:12]} has no model config")
        depth = LlamaConfig.from_hf_dict(
            decode_config(store.get(config_id, limit=MAX_MANIFEST_BYTES))
        ).num_hidden_layers
        if depth < workers:
            raise DistillError(
                f"cohort {cohort}'s distillation reference {cid[:12]} has {depth} layers, which cannot "
                f"be split over {workers} workers (each holds a non-empty share); train with at most "
                f"{depth} workers"
            )


def reference_bytes(config: LlamaConfig, num_slots: int, slot: int) -> int:
    """Bytes of FP32 weights slot `slot` holds for a frozen reference of `config` (no
    gradients, no moments), without allocating them: what a capacity planner adds per slot."""
    partition = Partition.even(config.num_hidden_layers, num_slots)
    with torch.device("meta"):
        stage = Llama(config, layers=partition.layers(slot), embedding=slot == 0, head=slot == 0)
    return sum(p.numel() for p in stage.parameters()) * 4


class Reference:
    """One slot's share of a frozen reference commit, run forward-only round the ring."""

    def __init__(
        self,
        store: Store,
        commit: str,
        *,
        slot: int,
        num_slots: int,
        device: torch.device,
        timeout: float,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """`dtype` is the stage's, and must be the reference commit's (restore refuses any other):
        float32 in training, float64 in parity tests."""
        lc = load_commit(store, commit)
        if lc.commit.config is None:
            raise DistillError(f"reference commit {commit[:12]} has no model config")
        config = LlamaConfig.from_hf_dict(decode_config(store.get(lc.commit.config, limit=MAX_MANIFEST_BYTES)))
        partition = Partition.even(config.num_hidden_layers, num_slots)
        self.commit = lc.id
        self.stage = build_stage(config, partition, slot, seed=0, device=device, dtype=dtype)
        for p in self.stage.parameters():
            p.requires_grad_(False)
        # this slot's reference tensors only (its parameters by name: a declared share of the commit),
        # nothing is written, and the training run's RNG is left alone
        shardstore.restore(store, lc.id, dict(self.stage.named_parameters()), rng=False)
        self.ring = Ring(self.stage, partition, slot, timeout=timeout, kind=REFERENCE)

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor, temperature: float) -> torch.Tensor | None:
        """(R, T) token ids -> (R, T, V) log softmax(reference logits / T) on slot 0, None elsewhere (collective)."""
        logits = self.ring.forward(tokens.to(next(self.stage.parameters()).device))
        if logits is None:
            return None
        # At least float32 (logits of a reduced-precision pass are widened), never narrowed.
        return F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)


class Distiller:
    """Per step: the reference its cohort names (restored once per reference) and the step's targets."""

    def __init__(
        self, job: PreparedJob, store: Store, *, slot: int, num_slots: int, device: torch.device, timeout: float
    ) -> None:
        self.job, self.store = job, store
        self.slot, self.num_slots, self.device, self.timeout = slot, num_slots, device, timeout
        self.coef, self.temperature = job.kl()
        self.reference: Reference | None = None

    def targets(self, step: int, batch: Batch, head: str | None) -> DistillTargets | None:
        """What slot 0's loss needs for global step `step` (collective; None off slot 0 or without replay)."""
        s = self.job.job.schedule.steps[step]
        if not s.replay or self.job.reference_of(s.cohort) is None:
            return None
        commit = find_reference(self.store, self.job, s.cohort, head)
        assert commit is not None
        if self.reference is None or self.reference.commit != commit:
            self.reference = None  # drop the previous cohort's reference before building the next
            self.reference = Reference(
                self.store, commit, slot=self.slot, num_slots=self.num_slots, device=self.device, timeout=self.timeout
            )
        replay = set(s.replay)
        mask = torch.tensor([d in replay for d in s.docs], dtype=torch.bool)  # (B,)
        if mask.shape[0] != batch.tokens.shape[0]:
            raise DistillError(f"step {step}'s batch has {batch.tokens.shape[0]} rows, its schedule {mask.shape[0]}")
        ref = self.reference.logprobs(batch.tokens[mask], self.temperature)  # (R, T, V) on slot 0
        if ref is None:
            return None
        return DistillTargets(mask, ref, self.coef, self.temperature)
