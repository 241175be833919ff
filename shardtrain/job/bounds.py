"""The bounds every value of a job file must meet (docs/SHARDTRAIN-FORMATS.md §2), checked when it is decoded.

msgspec's schema fixes types and integer ranges as the bytes are parsed; the reals of a
job file are IEEE-754 bit patterns (16 hex digits), so NaN, ±inf and out-of-range reals
decode fine and would otherwise reach the workers: a NaN temperature trains a model of
NaNs, a NaN learning rate or a warm-up longer than the run fails inside every worker
after the job was pinned, 2^40 bootstrap resamples allocate terabytes after a whole
evaluation, and 10^6 layers make the planner's layout search (workers × layers²) run for
hours. Each check here names the field; `load_job` and `decode_job` run them before
anything reads records, starts a worker, writes or pins.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from shardstore.format.manifest import f64_decode
from shardtrain.errors import JobError


class Job(Protocol):
    """What the bounds read of a job file (``job.Job`` is one; it checks itself through this
    module when it is decoded, so the role is named here instead of imported)."""

    model: Any
    recipe: Any
    seed: Any


__all__ = ["check_bounds", "BOUNDS"]

#: Inclusive integer bounds on the model's sizes (so that memory and the planner's time are bounded).
BOUNDS = {
    "model.vocab_size": 1 << 20,
    "model.hidden_size": 1 << 16,
    "model.intermediate_size": 1 << 18,
    "model.num_hidden_layers": 512,
    "model.num_attention_heads": 1024,
    "model.num_key_value_heads": 1024,
    "model.head_dim": 1024,
    "model.max_position_embeddings": 1 << 20,
    "recipe.total_steps": 1 << 24,
    "recipe.batch_size": 1 << 16,
    "gates.resamples": 100_000,
}


def _real(hexbits: str, field: str, *, lo: float, hi: float, lo_open: bool = False) -> float:
    """The real a field holds, if finite and within [lo, hi] ((lo, hi] with ``lo_open``)."""
    x = f64_decode(hexbits)
    if not math.isfinite(x) or x > hi or x < lo or (lo_open and x == lo):
        left = "(" if lo_open else "["
        raise JobError(
            f"job field {field} is {x!r}; it must be finite and in {left}{lo:g}, {hi:g}] (docs/SHARDTRAIN-FORMATS.md §2)"
        )
    return x


def _count(value: int, field: str, hi: int) -> None:
    if value > hi:
        raise JobError(f"job field {field} is {value}; at most {hi} (docs/SHARDTRAIN-FORMATS.md §2)")


def check_bounds(job: Job) -> None:
    """Refuse (JobError naming the field) any value of ``job`` outside docs/SHARDTRAIN-FORMATS.md §2's bounds."""
    m, r = job.model, job.recipe
    for name, hi in BOUNDS.items():
        part, attr = name.split(".")
        owner = m if part == "model" else r.gates if part == "gates" else r
        _count(getattr(owner, attr), name, hi)
    if m.num_attention_heads % m.num_key_value_heads:
        raise JobError(
            f"job field model.num_key_value_heads ({m.num_key_value_heads}) must divide "
            f"model.num_attention_heads ({m.num_attention_heads}) (docs/SHARDTRAIN-FORMATS.md §2)"
        )
    _real(m.rms_norm_eps, "model.rms_norm_eps", lo=0.0, hi=1.0, lo_open=True)
    _real(m.rope_theta, "model.rope_theta", lo=0.0, hi=1e12, lo_open=True)
    for g in r.groups:
        _real(g.lr, f"recipe.groups[{g.name}].lr", lo=0.0, hi=10.0, lo_open=True)
        for attr in ("beta1", "beta2"):
            if _real(getattr(g, attr), f"recipe.groups[{g.name}].{attr}", lo=0.0, hi=1.0) == 1.0:
                raise JobError(
                    f"job field recipe.groups[{g.name}].{attr} is 1.0; it must be below 1 (docs/SHARDTRAIN-FORMATS.md §2)"
                )
        _real(g.eps, f"recipe.groups[{g.name}].eps", lo=0.0, hi=1.0, lo_open=True)
        _real(g.weight_decay, f"recipe.groups[{g.name}].weight_decay", lo=0.0, hi=10.0)
    if r.warmup_steps > r.total_steps:
        raise JobError(
            f"job field recipe.warmup_steps ({r.warmup_steps}) exceeds recipe.total_steps "
            f"({r.total_steps}) (docs/SHARDTRAIN-FORMATS.md §2)"
        )
    _real(r.min_ratio, "recipe.min_ratio", lo=0.0, hi=1.0)
    if r.max_grad_norm is not None:  # null: clipping disabled, explicitly
        _real(r.max_grad_norm, "recipe.max_grad_norm", lo=0.0, hi=1e6, lo_open=True)
    if r.microbatch_size > r.batch_size:
        raise JobError(
            f"job field recipe.microbatch_size ({r.microbatch_size}) exceeds recipe.batch_size "
            f"({r.batch_size}) (docs/SHARDTRAIN-FORMATS.md §2)"
        )
    _real(r.distill.kl_coef, "recipe.distill.kl_coef", lo=0.0, hi=1e6)
    _real(r.distill.temperature, "recipe.distill.temperature", lo=0.01, hi=100.0)
    _real(r.gates.gain_bound, "recipe.gates.gain_bound", lo=-1e6, hi=1e6)
    _real(r.gates.retention_bound, "recipe.gates.retention_bound", lo=-1e6, hi=1e6)
    std = job.seed.init_std
    if std is not None:
        _real(std, "seed.init_std", lo=0.0, hi=10.0, lo_open=True)
