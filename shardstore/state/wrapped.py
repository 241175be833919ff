"""What of an optimizer a save must hold: the optimizers a wrapper wraps, and the check that a
capture took all of each one's ``state_dict()`` (SPEC.md §9.5).

Frameworks hand trainers wrappers, not torch optimizers: accelerate's
``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer`` wrap one (``.optimizer``),
torchtitan's ``OptimizersContainer`` several (``.optimizers``, one per model part and
optimizer type). A wrapper's own ``state`` is empty or its inner optimizer's, so capturing
the wrapper itself stores hyperparameters and no per-parameter state: a checkpoint that
verifies and restores nothing. Wrappers are recognised by shape (the Protocols below), never
by importing a framework, and saved as what they wrap: the inner optimizers taken as one
optimizer whose param groups are theirs in order (``g0``, ``g1``, ... across all of them),
so the same commit restores into the wrapper or into a plain optimizer over the same groups.

Beyond known shapes, ``check_captured`` holds any torch optimizer to its own word: whatever
per-parameter state its ``state_dict()`` holds for a parameter the save covers must have been
captured, else the save is refused (``UnsupportedOptimizer`` naming the optimizer and the first
parameter and key) before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..errors import StateMismatch, UnsupportedOptimizer
from ..format.lazy import torch
from ..format.names import check_group_name
from .optim import OptimState

__all__ = ["WrapsOptimizer", "WrapsOptimizers", "inner_optimizers", "split_group_names", "check_captured"]

_MAX_DEPTH = 8


@runtime_checkable
class WrapsOptimizer(Protocol):
    """One optimizer around another (accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``): ``optimizer`` is the one it wraps, and it holds no state of its own."""

    optimizer: Any


@runtime_checkable
class WrapsOptimizers(Protocol):
    """A container of optimizers (torchtitan's ``OptimizersContainer``): ``optimizers`` in order."""

    optimizers: Sequence[Any]


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) or hasattr(obj, "state_export")


def _wrapped(obj: Any) -> list[Any] | None:
    """The optimizers ``obj`` wraps, or None if it is not a wrapper of a recognised shape."""
    if isinstance(obj, WrapsOptimizers) and not isinstance(obj, (str, bytes)):
        inner = list(obj.optimizers)
        if inner and all(_is_optimizer(o) or _wrapped(o) is not None for o in inner):
            return inner
    if isinstance(obj, WrapsOptimizer) and obj.optimizer is not obj:
        inner_one = obj.optimizer
        if _is_optimizer(inner_one) or _wrapped(inner_one) is not None:
            return [inner_one]
    return None


def _own_state(wrapper: Any, inner: list[Any]) -> bool:
    """Whether a wrapper holds per-parameter state besides what it wraps (it would be dropped)."""
    own = getattr(wrapper, "state", None)
    if not isinstance(own, Mapping) or not own:
        return False
    return all(own is not getattr(o, "state", None) for o in inner)


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers a save captures for ``optimizer``: itself, or (recursively) what it wraps."""
    out: list[Any] = []

    def walk(obj: Any, depth: int) -> None:
        inner = _wrapped(obj) if depth < _MAX_DEPTH else None
        if inner is None:
            out.append(obj)
            return
        if _own_state(obj, inner):
            raise UnsupportedOptimizer(
                f"optimizer {_label(obj)} wraps {len(inner)} optimizer(s) but holds per-parameter state of its own, "
                "which saving what it wraps would drop (SPEC.md §9.5)"
            )
        for o in inner:
            walk(o, depth + 1)

    walk(optimizer, 0)
    if len(out) > 1 and any(not isinstance(o, torch.optim.Optimizer) for o in out):
        raise UnsupportedOptimizer(
            f"optimizer {_label(optimizer)} wraps {len(out)} optimizers; several are saved together only when each is "
            "a torch.optim.Optimizer (SPEC.md §9.5)"
        )
    return out


def split_group_names(optimizers: list[Any], group_names: list[str] | None) -> list[list[str] | None]:
    """Each inner optimizer's group names: ``group_names`` (one per group of all of them, in order)
    cut to each, or, for several optimizers, each group's ``name`` key or ``g<index>`` counted
    across all of them. One optimizer keeps its own rule (``group_names`` or None)."""
    if len(optimizers) == 1:
        return [group_names]
    sizes = [len(o.param_groups) for o in optimizers]
    if group_names is None:
        index = 0
        group_names = []
        for o in optimizers:
            for g in o.param_groups:
                name = g.get("name")
                group_names.append(name if isinstance(name, str) else f"g{index}")
                index += 1
    if len(group_names) != sum(sizes) or len(set(group_names)) != len(group_names):
        raise StateMismatch(
            f"group names {list(group_names)[:8]} do not name the {sum(sizes)} param groups of the "
            f"{len(optimizers)} wrapped optimizers once each"
        )
    out: list[list[str] | None] = []
    start = 0
    for n in sizes:
        out.append([check_group_name(x) for x in group_names[start : start + n]])
        start += n
    return out


def _label(optimizer: Any) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _captured_keys(state: OptimState, name: str) -> set[str]:
    po = state.params.get(name)
    if po is None:
        return set()
    if po.torch_state is not None:
        return {*po.torch_state.tensors, *po.torch_state.scalars}
    if po.exp_avg is not None and po.exp_avg_sq is not None:
        return {"step", "exp_avg", "exp_avg_sq"}
    return set()


def _is_torch_form(sd: Any) -> bool:
    return (
        isinstance(sd, Mapping)
        and isinstance(sd.get("state"), Mapping)
        and isinstance(sd.get("param_groups"), list)
        and all(isinstance(k, int) for k in sd["state"])
    )


def _tensors_in(value: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif depth < 32 and isinstance(value, Mapping):
        for k, v in value.items():
            yield from _tensors_in(v, f"{path}[{k!r}]", depth + 1)
    elif depth < 32 and isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors_in(v, f"{path}[{i}]", depth + 1)


def check_captured(optimizer: Any, state: OptimState, tensors: Mapping[str, Any]) -> None:
    """Refuse a capture that holds less than ``optimizer.state_dict()`` for the tensors it covers.

    Torch's format (``{"state": {index: {...}}, "param_groups": [...]}``, indices counting the
    parameters of ``param_groups`` in order): every key of every parameter's state must be
    captured for each parameter among ``tensors`` (another slot's are skipped by design).
    Any other format: every tensor of one or more dimensions in it must be one the capture
    holds. Optimizers with ``state_export()`` are held by their own export and not checked.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    sd = optimizer.state_dict()
    label = _label(optimizer)
    if not _is_torch_form(sd):
        _check_other_form(label, sd, state)
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_id = {id(t): n for n, t in tensors.items()}
    for index in sorted(sd["state"]):
        st = sd["state"][index]
        if not st:
            continue
        if not 0 <= index < len(params):
            raise UnsupportedOptimizer(
                f"optimizer {label}: its state_dict() holds state for parameter {index}, but its param_groups list "
                f"{len(params)} parameters; save cannot tell whose state it is (SPEC.md §9.5)"
            )
        name = by_id.get(id(params[index]))
        if name is None:
            continue
        missing = sorted(set(map(str, st)) - _captured_keys(state, name))
        if missing:
            raise UnsupportedOptimizer(
                f"optimizer {label}: its state_dict() holds state {missing[0]!r} of parameter {name!r} that save "
                f"would not capture (it captured {sorted(_captured_keys(state, name))}); pass the optimizer that "
                "holds the state, or a wrapper of a known shape (SPEC.md §9.5)"
            )


def _check_other_form(label: str, sd: Any, state: OptimState) -> None:
    held: set[tuple[int, tuple[int, ...], Any]] = set()
    for po in state.params.values():
        ts = [po.exp_avg, po.exp_avg_sq, *(po.torch_state.tensors.values() if po.torch_state else ())]
        held |= {_key(t) for t in ts if t is not None}
    for path, t in _tensors_in(sd, "state_dict()"):
        if t.dim() > 0 and _key(t) not in held:
            raise UnsupportedOptimizer(
                f"optimizer {label}: {path} is a tensor {list(t.shape)} that save would not capture (its state "
                "lives outside its param_groups' state); pass the optimizer that holds it (SPEC.md §9.5)"
            )


def _key(t: Any) -> tuple[int, tuple[int, ...], Any]:
    local = t.to_local() if hasattr(t, "to_local") else t
    return (local.data_ptr(), tuple(t.shape), t.dtype)
