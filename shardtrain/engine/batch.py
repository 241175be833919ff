"""Batch: token sequences with per-token target weights, and its split into microbatches.

A batch is three (B, T) tensors: input token ids, target token ids, and float target
weights. Unequal lengths are right padding with weight 0; weights may be any non-negative
values (for example 1 on assistant tokens and 0 on the prompt). The loss of a step is

    sum(weight * cross_entropy) / sum(weight)      over the WHOLE batch,

so each microbatch's contribution is divided by the whole batch's weight, and splitting a
batch (including a smaller last microbatch) does not change the update.
"""

from __future__ import annotations

import dataclasses

import torch

from shardtrain.errors import BatchError

__all__ = ["Batch", "Microbatch", "split_microbatches"]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One optimizer step's data; every worker holds the same batch (only shapes matter off slot 0)."""

    tokens: torch.Tensor  # (B, T) int64 input ids
    targets: torch.Tensor  # (B, T) int64 next-token ids
    weights: torch.Tensor  # (B, T) float32 target weights, 0 on padding

    def validate(self, vocab_size: int, max_positions: int) -> None:
        """Raise `BatchError` unless the batch is well formed for this model."""
        if self.tokens.ndim != 2 or self.tokens.shape[0] < 1 or self.tokens.shape[1] < 1:
            raise BatchError(f"tokens must be a non-empty (B, T) tensor, got shape {tuple(self.tokens.shape)}")
        for name in ("targets", "weights"):
            shape = getattr(self, name).shape
            if shape != self.tokens.shape:
                raise BatchError(f"{name} has shape {tuple(shape)} but tokens have {tuple(self.tokens.shape)}")
        for name in ("tokens", "targets"):
            t = getattr(self, name)
            if t.dtype != torch.int64:
                raise BatchError(f"{name} must be int64, got {t.dtype}")
            if int(t.min()) < 0 or int(t.max()) >= vocab_size:
                raise BatchError(f"{name} hold ids outside [0, {vocab_size})")
        if self.weights.dtype != torch.float32:
            raise BatchError(f"weights must be float32, got {self.weights.dtype}")
        if not bool(torch.isfinite(self.weights).all()) or bool((self.weights < 0).any()):
            raise BatchError("weights must be finite and non-negative")
        if not float(self.weights.sum()) > 0:
            raise BatchError("the batch has no target weight; its loss is undefined")
        if self.tokens.shape[1] > max_positions:
            raise BatchError(f"sequence length {self.tokens.shape[1]} exceeds max_position_embeddings {max_positions}")

    def total_weight(self) -> torch.Tensor:
        """The whole batch's target weight, a float32 scalar (the loss denominator)."""
        return self.weights.sum()


@dataclasses.dataclass(frozen=True)
class Microbatch:
    """Rows [start, stop) of a batch, trimmed to `length` positions."""

    index: int
    start: int
    stop: int
    length: int

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This microbatch's part of a (B, T, ...) tensor."""
        return t[self.start : self.stop, : self.length]


def split_microbatches(batch: Batch, microbatch_size: int) -> list[Microbatch]:
    """Consecutive row chunks of `microbatch_size` (the last may be smaller).

    Each chunk is trimmed after its last weighted position: under causal attention the
    positions after it cannot change any weighted loss term, so trimming is exact and
    saves work on short microbatches. Every worker computes the same list from the batch.
    """
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise BatchError(f"microbatch_size must be a positive int, got {microbatch_size!r}")
    b, t = batch.weights.shape
    positions = torch.arange(1, t + 1).expand(b, t)  # (B, T) 1-based positions
    lengths = torch.where(batch.weights > 0, positions, 0).amax(dim=1)  # (B,) last weighted position
    out = []
    for index, start in enumerate(range(0, b, microbatch_size)):
        stop = min(start + microbatch_size, b)
        out.append(Microbatch(index, start, stop, max(1, int(lengths[start:stop].max()))))
    return out
