"""The recipe of a prepared job: optimizer groups and schedule, clipping, batch split,
distillation (the KL term and each cohort's frozen reference) and the experiment's gates.

Part of `job.json` (`shardtrain.job.job`), so every value is fixed before training and bound
by the job id. Reals are the 16 hex digits of their IEEE-754 bits, like every real in a
job file; decoding is strict (unknown fields refused).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "JobStruct",
    "F64",
    "FileName",
    "Count",
    "Positive",
    "GroupRecipe",
    "CohortReference",
    "Distillation",
    "GateRecipe",
    "Recipe",
]

# The value types of a job file: a real as its F64 hex, a file name, a count, a positive count.
F64 = Annotated[str, Meta(pattern=r"^[0-9a-f]{16}$")]
FileName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")]
Count = Annotated[int, Meta(ge=0, le=2**40)]
Positive = Annotated[int, Meta(ge=1, le=2**40)]


class JobStruct(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The base of every Struct of a job file (here and in `job`): values, strictly decoded.

    ``frozen``: a decoded job is a value, bound by its hash; ``forbid_unknown_fields``: a field
    this reader does not know is an error, not ignored; ``kw_only``: every field is named.
    """


class GroupRecipe(JobStruct):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")]
    lr: F64
    beta1: F64
    beta2: F64
    eps: F64
    weight_decay: F64


class CohortReference(JobStruct):
    """The frozen reference of one cohort: the job's seed, or the committed endpoint of cohort `of`."""

    cohort: FileName
    source: Literal["seed", "endpoint"]
    of: FileName | None


class Distillation(JobStruct):
    """KL(reference || student) at `temperature` on declared replay records, times `kl_coef` (shardtrain.engine.loss)."""

    kl_coef: F64
    temperature: F64
    references: tuple[CohortReference, ...]


class GateRecipe(JobStruct):
    """The experiment's gates (shardtrain.run.gates), fixed before training."""

    gain_bound: F64  # the new-task upper bound must lie below this (nats per assistant token)
    retention_bound: F64  # the retention upper bound must be at most this
    resamples: Positive  # paired-bootstrap resamples
    seed: Count  # paired-bootstrap seed


class Recipe(JobStruct):
    """The recipe: AdamW groups, warm-up/cosine schedule, clipping, batch split, distillation, gates."""

    algorithm: Literal["adamw"]
    groups: tuple[GroupRecipe, ...]
    warmup_steps: Count
    total_steps: Positive
    min_ratio: F64
    max_grad_norm: F64 | None
    batch_size: Positive
    microbatch_size: Positive
    distill: Distillation
    gates: GateRecipe
