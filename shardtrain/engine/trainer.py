"""Trainer: one complete optimizer update of one slot, in lock-step with the other slots.

A step is: clear gradients, run the pipeline's forward and backward over the whole batch,
share the step loss from slot 0, compute the global gradient norm in canonical parameter
order, stop (NonFiniteStep, nothing applied) if either is not finite, clip, and apply
shard-local AdamW at the global step. Every slot calls `step` with
the same batch; every slot returns the same `StepResult`, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from shardtrain.engine.batch import Batch
from shardtrain.engine.clipping import clip_coefficient, global_grad_norm, scale_grads_, squared_grad_norms
from shardtrain.engine.optim import AdamW
from shardtrain.engine.partition import canonical_parameter_names
from shardtrain.engine.pipeline import Pipeline
from shardtrain.errors import ConfigError, NonFiniteStep, PeerFailureError

__all__ = ["StepResult", "Trainer"]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one update did, identical on every slot."""

    step: int  # the global step this update was (0-based)
    loss: float  # sum(weight * ce) / sum(weight) over the batch
    grad_norm: float  # global gradient norm before clipping
    clip_coef: float  # factor applied to every gradient (1.0 when not clipped)
    lr_multiplier: float  # schedule factor applied to each group's lr


class Trainer:
    """Drives a slot's pipeline and optimizer; `global_step` counts completed updates."""

    def __init__(
        self,
        pipeline: Pipeline,
        optimizer: AdamW,
        *,
        microbatch_size: int,
        max_grad_norm: float | None = 1.0,
        global_step: int = 0,
    ) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        self.pipeline = pipeline
        self.optimizer = optimizer
        self.microbatch_size = microbatch_size
        self.max_grad_norm = max_grad_norm
        self.global_step = global_step
        self.params = dict(pipeline.stage.named_parameters())
        if set(self.params) != set(optimizer.names):
            raise ConfigError("the optimizer must hold exactly the stage's parameters")
        config, partition = pipeline.config, pipeline.partition
        self.canonical = canonical_parameter_names(config)
        self.owners = [partition.owner(config, name) for name in self.canonical]

    def step(self, batch: Batch) -> StepResult:
        """Run one update on `batch` (the same batch on every slot)."""
        pipe = self.pipeline
        self.optimizer.zero_grad()
        loss = pipe.forward_backward(batch, step=self.global_step, microbatch_size=self.microbatch_size)
        loss = self._share_loss(loss)
        norm = global_grad_norm(
            squared_grad_norms(self.params), self.canonical, self.owners, rank=pipe.slot, world_size=pipe.num_slots
        )
        if not (math.isfinite(loss) and math.isfinite(norm)):  # the same on every slot: all stop here
            raise NonFiniteStep(
                f"step {self.global_step + 1} (slot {pipe.slot}): the loss is {loss!r} and the global "
                f"gradient norm {norm!r}; the update was not applied (docs/SHARDTRAIN-FORMATS.md §3)"
            )
        coef = clip_coefficient(norm, self.max_grad_norm)
        scale_grads_(list(self.params.values()), coef)
        mult = self.optimizer.step(self.global_step)
        result = StepResult(self.global_step, loss, norm, coef, mult)
        self.global_step += 1
        return result

    def _share_loss(self, loss: float | None) -> float:
        if self.pipeline.num_slots == 1:
            assert loss is not None
            return loss
        t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
        try:
            dist.broadcast(t, src=0)
        except RuntimeError as exc:
            raise PeerFailureError(
                f"slot {self.pipeline.slot}: receiving the step loss from slot 0 failed: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
            ) from exc
        return float(t.item())
