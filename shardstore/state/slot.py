"""One slot's state as a commit takes it: ``SlotState`` and ``capture``, which references
(never copies) the named parameters, persistent buffers, optimizer state, RNG and extras a
slot owns (SPEC.md §Manifests: a shard manifest records one slot). A wrapper optimizer is
captured as what it wraps, and every captured optimizer is held to its own ``state_dict()``
(``wrapped``, SPEC.md §9.5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import StateMismatch, UnsupportedOptimizer
from ..format.manifest import Slice
from ..format.rng import capture_rng
from .extras import CapturedExtra, capture_extras
from .module import check_held, named_state
from .optim import ExportsState, OptimState, from_export, from_torch
from .torch_optim import capture_torch, custom_group_keys, is_adam_form
from .wrapped import check_captured, inner_optimizers, split_group_names

__all__ = ["SlotState", "capture", "slot_tensors", "wants_torch_form"]


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
    torch_form: bool = False,
) -> SlotState:
    """Reference (not copy) the named parameters, buffers and optimizer state one slot owns.

    ``torch_form``: hold a torch Adam in the torch form even without group keys of its own (another
    slot's Adam has some, ``wants_torch_form``: a commit holds one form).

    ``model`` is a module (its non-meta parameters and persistent buffers) or a name → tensor
    mapping; ``names`` restricts to a subset (to split one process's state into several
    slots). ``optimizer``: any torch optimizer whose state is tensors and numbers, anything with
    ``state_export()``, or a wrapper of those (``wrapped``: saved as what it wraps). ``extra``: this slot's own extras (SPEC.md §Extras).
    """
    tensors, buffers = named_state(model)
    inner = inner_optimizers(optimizer) if optimizer is not None else []  # a wrapper: what it wraps (SPEC.md §9.5)
    if isinstance(model, torch.nn.Module):  # a mapping names what the slot owns
        for o in inner:
            if isinstance(o, torch.optim.Optimizer):
                check_held(o, tensors)
    if names is not None:
        missing = sorted(set(names) - set(tensors))
        if missing:
            raise StateMismatch(f"names not among the model's parameters: {missing[:5]}")
        tensors = {n: tensors[n] for n in names}
    optim = OptimState()
    if inner:
        # one Adam with group keys of its own puts every wrapped torch optimizer in the torch form: a commit
        # holds one form, and the Adam form would drop that key (``_capture_one``)
        torch_form = torch_form or _has_custom_keys(inner)
        full = _merge(
            [_capture_one(o, tensors, g, torch_form) for o, g in zip(inner, split_group_names(inner, group_names))]
        )
        params = {n: full.params[n] for n in tensors if n in full.params}
        used = {p.group for p in params.values()}
        groups, torch_groups = ({g: h for g, h in d.items() if g in used} for d in (full.groups, full.torch_groups))
        optim = replace(full, groups=groups, params=params, torch_groups=torch_groups)
    return SlotState(
        tensors, optim, capture_rng() if rng else {}, births, buffers & set(tensors), capture_extras(extra)
    )


def wants_torch_form(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or one it wraps) is a torch optimizer with param group keys of its own,
    which the Adam form would drop (``custom_group_keys``); False if it is not one ``capture`` takes."""
    try:
        return _has_custom_keys(inner_optimizers(optimizer) if optimizer is not None else [])
    except Exception:  # noqa: BLE001 - capture raises it, naming it, where it is handled
        return False


def _has_custom_keys(inner: list[Any]) -> bool:
    """Whether one of these (inner) optimizers is a torch optimizer with group keys of its own."""
    return any(isinstance(o, torch.optim.Optimizer) and bool(custom_group_keys(o)) for o in inner)


def _capture_one(
    optimizer: Any, tensors: dict[str, torch.Tensor], group_names: list[str] | None, torch_form: bool = False
) -> OptimState:
    """One (inner) optimizer's state for ``tensors``, held to its own ``state_dict()`` (``check_captured``)."""
    if isinstance(optimizer, ExportsState):
        return from_export(optimizer)
    by_tensor = {t: n for n, t in tensors.items()}
    # an Adam with group keys its form does not hold (torch_form: in it or beside it) is saved in the torch
    # form; a commit restores by the form it holds (use_torch_form), so older Adam-form commits still do
    if isinstance(optimizer, torch.optim.Optimizer) and (not is_adam_form(optimizer) or torch_form):
        state = capture_torch(optimizer, by_tensor, group_names=group_names)
    else:
        state = from_torch(optimizer, by_tensor, group_names=group_names)
    check_captured(optimizer, state, tensors)
    return state


def _merge(states: list[OptimState]) -> OptimState:
    """Several wrapped optimizers as one: their groups and parameters together (one algorithm and class)."""
    if len(states) == 1:
        return states[0]
    kinds = sorted({f"{s.algorithm} {s.class_name or ''}".strip() for s in states})
    if len(kinds) > 1:
        raise UnsupportedOptimizer(
            f"the wrapped optimizers are of different kinds ({kinds}); a commit holds one optimizer algorithm and "
            "class (save them as separate commits or slots; SPEC.md §9.5)"
        )
    out = OptimState(states[0].algorithm, class_name=states[0].class_name)
    for s in states:
        out.groups.update(s.groups)
        out.torch_groups.update(s.torch_groups)
        out.params.update(s.params)
    return out


def slot_tensors(state: SlotState) -> list[torch.Tensor]:
    """Every tensor a slot writes, in the order its payloads are listed: by tensor name, each
    tensor, then its Adam moments, then its torch-form state tensors by key (SPEC.md §5.1)."""
    flat: list[torch.Tensor] = []
    for n in sorted(state.tensors):
        flat.append(state.tensors[n])
        po = state.optim.params.get(n)
        if po is not None and po.exp_avg is not None and po.exp_avg_sq is not None:
            flat += [po.exp_avg, po.exp_avg_sq]
        if po is not None and po.torch_state is not None:
            flat += [t for _, t in sorted(po.torch_state.tensors.items())]
    return flat
