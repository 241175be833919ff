"""One slot's state as a commit takes it: ``SlotState`` and ``capture``, which references
(never copies) the named parameters, persistent buffers, optimizer state, RNG and extras a
slot owns (SPEC.md §Manifests: a shard manifest records one slot).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import StateMismatch
from ..format.manifest import Slice
from ..format.rng import capture_rng
from .extras import CapturedExtra, capture_extras
from .module import check_held, named_state
from .optim import OptimState, from_export, from_torch
from .torch_optim import capture_torch, is_adam_form

__all__ = ["SlotState", "capture", "slot_tensors"]


@dataclass
class SlotState:
    """What one slot contributes to a commit. Tensors are referenced, not copied."""

    tensors: dict[str, torch.Tensor]
    optim: OptimState = field(default_factory=OptimState)
    rng: dict[str, bytes] = field(default_factory=dict)
    births: dict[str, int] | None = None
    buffers: set[str] = field(default_factory=set)  # which tensors are persistent buffers
    extra: dict[str, CapturedExtra] = field(default_factory=dict)  # this slot's own extras
    slices: tuple[
        Slice, ...
    ] = ()  # the boxes of sharded tensors this slot held (SPEC.md §Slices held; set by the block exchange)


def capture(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    optimizer: Any = None,
    *,
    names: list[str] | None = None,
    rng: bool = True,
    group_names: list[str] | None = None,
    births: dict[str, int] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> SlotState:
    """Reference (not copy) the named parameters, buffers and optimizer state one slot owns.

    ``model`` is a module (its non-meta parameters and persistent buffers) or a name → tensor
    mapping; ``names`` restricts to a subset (to split one process's state into several
    slots). ``optimizer``: any torch optimizer whose state is tensors and numbers, or
    anything with ``state_export()``. ``extra``: this slot's own extras (SPEC.md §Extras).
    """
    tensors, buffers = named_state(model)
    if isinstance(optimizer, torch.optim.Optimizer) and isinstance(
        model, torch.nn.Module
    ):  # a mapping names what the slot owns
        check_held(optimizer, tensors)
    if names is not None:
        missing = sorted(set(names) - set(tensors))
        if missing:
            raise StateMismatch(f"names not among the model's parameters: {missing[:5]}")
        tensors = {n: tensors[n] for n in names}
    optim = OptimState()
    if optimizer is not None:
        if hasattr(optimizer, "state_export"):
            full = from_export(optimizer)
        elif isinstance(optimizer, torch.optim.Optimizer) and not is_adam_form(optimizer):
            full = capture_torch(optimizer, {t: n for n, t in tensors.items()}, group_names=group_names)
        else:
            full = from_torch(optimizer, {t: n for n, t in tensors.items()}, group_names=group_names)
        params = {n: full.params[n] for n in tensors if n in full.params}
        used = {p.group for p in params.values()}
        groups, torch_groups = ({g: h for g, h in d.items() if g in used} for d in (full.groups, full.torch_groups))
        optim = replace(full, groups=groups, params=params, torch_groups=torch_groups)
    return SlotState(
        tensors, optim, capture_rng() if rng else {}, births, buffers & set(tensors), capture_extras(extra)
    )


def slot_tensors(state: SlotState) -> list[torch.Tensor]:
    """Every tensor a slot writes, in the order its payloads are listed: by tensor name, each
    tensor, then its Adam moments, then its torch-form state tensors by key (SPEC.md §5a)."""
    flat: list[torch.Tensor] = []
    for n in sorted(state.tensors):
        flat.append(state.tensors[n])
        po = state.optim.params.get(n)
        if po is not None and po.exp_avg is not None and po.exp_avg_sq is not None:
            flat += [po.exp_avg, po.exp_avg_sq]
        if po is not None and po.torch_state is not None:
            flat += [t for _, t in sorted(po.torch_state.tensors.items())]
    return flat
