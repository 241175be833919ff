"""Numerical profiles: how a job computes, bound into the job and recorded in every commit.

Two profiles, after the seed study's CPU and GPU runs (docs/SHARDTRAIN-FORMATS.md §5):

- ``fp32``: weights, gradients, Adam moments, activations and every computation in FP32.
- ``bf16-autocast``: weights, gradients and Adam moments stay FP32 (the optimizer, the
  gradient norm and clipping never see a reduced dtype), while the forward pass, and so
  the backward pass autograd records from it, runs under
  ``torch.autocast(device_type, dtype=torch.bfloat16)`` on CPU and CUDA alike: matrix
  products take bf16 copies of their FP32 inputs; RMSNorm, softmax and the loss stay in
  FP32 (autocast's own op lists, and RMSNorm's explicit upcast). The activations and
  gradients sent between slots are FP32, because every block's residual sum promotes.

Either may add **activation recomputation** (``recompute``): each decoder block's
forward runs under `torch.utils.checkpoint.checkpoint` (``use_reentrant=False``), which
keeps only the block's input and runs the block again during backward, with the same
autocast state. The recomputed forward is the same sequence of kernels on the same
inputs, so gradients, and with them every learned value, are bitwise those of the run
without it (tests/test_own_model.py checks the learned-state root).

The label a commit records (its ``profile`` field, SPEC.md §8.3) is the profile's name,
with ``+recompute`` appended when recomputation is on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import torch
import torch.utils.checkpoint

__all__ = ["PROFILES", "Profile", "FP32", "label", "compute_context", "run_block"]

PROFILES = ("fp32", "bf16-autocast")


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A job's numerical profile: its name and whether decoder blocks are recomputed in backward.

    (The options of every job value: strictly decoded, unknown fields an error, every field named.)

    Absent from a job file (None) means plain ``fp32`` without recomputation, so job files
    prepared before profiles were named keep their bytes and their ids.
    """

    name: Literal["fp32", "bf16-autocast"]
    recompute: bool = False


FP32 = Profile(name="fp32")


def label(profile: Profile | None) -> str:
    """What a commit records as its profile: ``fp32``, ``bf16-autocast``, either ``+recompute``."""
    p = profile or FP32
    return p.name + ("+recompute" if p.recompute else "")


def compute_context(
    profile: Profile | None, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A factory of the context every forward computation of `profile` runs in."""
    if profile is None or profile.name == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def run_block(block: Callable[..., torch.Tensor], *args: Any, recompute: bool) -> torch.Tensor:
    """`block(*args)`, keeping only its inputs for backward when `recompute` (and gradients are on)."""
    if recompute and torch.is_grad_enabled():
        out = torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
        assert isinstance(out, torch.Tensor)
        return out
    return block(*args)
