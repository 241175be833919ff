"""Optimizer state in canonical form, and adapters to and from torch optimizers (SPEC.md §Optimizer state).

The canonical form names things instead of indexing them: named groups with
hyperparameters as numbers (not torch's ``param_groups`` dicts), and per-parameter state
keyed by tensor name — group, Adam age (updates received) and both moments. Adapters:

- ``torch.optim.Adam`` / ``torch.optim.AdamW`` (``from_torch`` / ``into_torch``);
- every other torch optimizer through ``torch_optim`` (the *torch form*, algorithm ``torch``);
- any optimizer exposing ``state_export()`` / ``state_import(groups, params)`` with plain
  dicts (shardtrain's shard-local AdamW does), via ``from_export`` / ``into_export``.

A restore of the Adam form into either is planned by ``plan_adam_restore``: a
``plan.RestorePlan``, like every other part of a restore, checked before any read.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import StateMismatch, UnsupportedOptimizer
from ..format.lazy import torch
from ..format.manifest import (
    CommitManifest,
    GroupSpec,
    HyperGroup,
    StateScalar,
    TensorEntry,
    f64_decode,
    f64_encode,
)
from ..format.names import check_group_name
from ..format.tensors import is_dtensor, same_split, torch_dtype
from .plan import ReadItem, RestorePlan

__all__ = [
    "Hyper",
    "ParamOpt",
    "OptimState",
    "from_torch",
    "into_torch",
    "from_export",
    "into_export",
    "group_spec",
    "hyper_of",
    "CommitView",
    "TorchParam",
    "param_group_names",
    "plan_adam_restore",
]


class CommitView(Protocol):
    """What restoring optimizer state needs of a loaded commit (``verification.LoadedCommit`` is one)."""

    commit: CommitManifest

    def entries(self) -> dict[str, TensorEntry]: ...


@dataclass(frozen=True)
class Hyper:
    """One group's hyperparameters as Python floats."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@dataclass
class TorchParam:
    """One parameter's state in the torch form, before its tensors are written."""

    group: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, StateScalar] = field(default_factory=dict)


@dataclass
class ParamOpt:
    """One parameter's optimizer state."""

    group: str
    age: int
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    torch_state: TorchParam | None = None  # the torch form's state (algorithm "torch"); then age is unused


@dataclass
class OptimState:
    """A whole optimizer (or one slot's part of it) in canonical form."""

    algorithm: str = "none"
    groups: dict[str, Hyper] = field(default_factory=dict)
    params: dict[str, ParamOpt] = field(default_factory=dict)
    class_name: str | None = None  # the torch form: the optimizer's class and its groups
    torch_groups: dict[str, HyperGroup] = field(default_factory=dict)


def group_spec(name: str, h: Hyper) -> GroupSpec:
    return GroupSpec(
        name=check_group_name(name),
        lr=f64_encode(h.lr),
        beta1=f64_encode(h.beta1),
        beta2=f64_encode(h.beta2),
        eps=f64_encode(h.eps),
        weight_decay=f64_encode(h.weight_decay),
    )


def hyper_of(g: GroupSpec) -> Hyper:
    return Hyper(
        f64_decode(g.lr), f64_decode(g.beta1), f64_decode(g.beta2), f64_decode(g.eps), f64_decode(g.weight_decay)
    )


def _algorithm(optimizer: torch.optim.Optimizer) -> str:
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        decoupled = any(g.get("decoupled_weight_decay", False) for g in optimizer.param_groups)
        return "adamw" if decoupled else "adam"
    raise UnsupportedOptimizer(
        f"{type(optimizer).__name__} has no canonical form; use a torch.optim.Optimizer or an optimizer "
        "with state_export()/state_import() (SPEC.md §Optimizer state)"
    )


def param_group_names(optimizer: Any, group_names: list[str] | None = None) -> list[str]:
    """The names of a torch optimizer's param groups, in order: ``group_names`` if given (one
    distinct name per group), else each group's ``name`` key, else ``g<index>``; checked as
    group names. The one naming rule of both the Adam form and the torch form (SPEC.md §9).
    """
    n = len(optimizer.param_groups)
    if group_names is not None:
        if len(group_names) != n or len(set(group_names)) != n:
            raise StateMismatch(f"group_names has {len(group_names)} distinct-or-not names for {n} param groups")
        return [check_group_name(x) for x in group_names]
    names = [g.get("name") if isinstance(g.get("name"), str) else f"g{i}" for i, g in enumerate(optimizer.param_groups)]
    if len(set(names)) != n:
        raise StateMismatch(f"optimizer param group names are not unique: {names}")
    return [check_group_name(x) for x in names]


def from_torch(
    optimizer: torch.optim.Optimizer, param_names: Mapping[torch.Tensor, str], *, group_names: list[str] | None = None
) -> OptimState:
    """Canonical state of a torch Adam/AdamW for the parameters named in ``param_names``.

    Parameters of the optimizer that are not in ``param_names`` (another slot's) are skipped.
    """
    algorithm = _algorithm(optimizer)
    out = OptimState(algorithm=algorithm)
    by_id = {id(p): n for p, n in param_names.items()}
    for gname, g in zip(param_group_names(optimizer, group_names), optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if g.get(flag, False):
                raise UnsupportedOptimizer(
                    f"param group {gname!r} uses {flag}=True, which the canonical form does not represent"
                )
        beta1, beta2 = (float(b) for b in g["betas"])
        out.groups[gname] = Hyper(float(g["lr"]), beta1, beta2, float(g["eps"]), float(g["weight_decay"]))
        for p in g["params"]:
            name = by_id.get(id(p))
            if name is None:
                continue
            st = optimizer.state.get(p, {})
            if "step" in st:
                step = st["step"]
                age = int(step.item() if torch.is_tensor(step) else step)
                out.params[name] = ParamOpt(gname, age, st["exp_avg"], st["exp_avg_sq"])
            else:
                out.params[name] = ParamOpt(gname, 0, None, None)
    return out


def _scalar_step(age: int) -> torch.Tensor:
    import torch.optim.optimizer as _opt_mod

    get = getattr(_opt_mod, "_get_scalar_dtype", None)
    dtype = get() if get is not None else torch.float32
    return torch.tensor(float(age), dtype=dtype)


def into_torch(
    optimizer: torch.optim.Optimizer,
    param_names: Mapping[torch.Tensor, str],
    state: OptimState,
    *,
    group_names: list[str] | None = None,
) -> None:
    """Install canonical state into an already-built torch Adam/AdamW, in place, by name."""
    algorithm = _algorithm(optimizer)
    if state.algorithm != algorithm:
        raise StateMismatch(f"commit holds {state.algorithm} state but the optimizer is {algorithm}")
    by_id = {id(p): n for p, n in param_names.items()}
    for gname, g in zip(param_group_names(optimizer, group_names), optimizer.param_groups):
        owned = [p for p in g["params"] if id(p) in by_id]
        if not owned:
            continue
        h = state.groups.get(gname)
        if h is None:
            raise StateMismatch(f"optimizer group {gname!r} is not in the commit (groups: {sorted(state.groups)})")
        g["lr"] = h.lr if not torch.is_tensor(g["lr"]) else g["lr"].fill_(h.lr)
        g["betas"] = (h.beta1, h.beta2)
        g["eps"] = h.eps
        g["weight_decay"] = h.weight_decay
        for p in owned:
            name = by_id[id(p)]
            po = state.params.get(name)
            if po is None:
                raise StateMismatch(f"tensor {name!r} has no optimizer state in the commit")
            if po.group != gname:
                raise StateMismatch(f"tensor {name!r} is in group {po.group!r} in the commit but in {gname!r} here")
            optimizer.state.pop(p, None)
            if po.exp_avg is not None and po.exp_avg_sq is not None:
                optimizer.state[p] = {
                    "step": _scalar_step(po.age),
                    "exp_avg": po.exp_avg.to(device=p.device, dtype=p.dtype, copy=True),
                    "exp_avg_sq": po.exp_avg_sq.to(device=p.device, dtype=p.dtype, copy=True),
                }


def from_export(exporter: Any) -> OptimState:
    """Canonical state of an optimizer exposing ``state_export() -> (groups, params)``."""
    groups, params = exporter.state_export()
    out = OptimState(algorithm=getattr(exporter, "algorithm", "adamw"))
    for name, g in groups.items():
        out.groups[check_group_name(name)] = Hyper(
            float(g["lr"]), float(g["beta1"]), float(g["beta2"]), float(g["eps"]), float(g["weight_decay"])
        )
    for name, p in params.items():
        out.params[name] = ParamOpt(p["group"], int(p["age"]), p.get("exp_avg"), p.get("exp_avg_sq"))
    return out


def into_export(importer: Any, state: OptimState, names: list[str]) -> None:
    """Install canonical state into an optimizer exposing ``state_import(groups, params)``."""
    groups = {
        n: {"lr": h.lr, "beta1": h.beta1, "beta2": h.beta2, "eps": h.eps, "weight_decay": h.weight_decay}
        for n, h in state.groups.items()
    }
    params = {}
    for n in names:
        po = state.params.get(n)
        if po is None:
            raise StateMismatch(f"tensor {n!r} has no optimizer state in the commit")
        params[n] = {"group": po.group, "age": po.age, "exp_avg": po.exp_avg, "exp_avg_sq": po.exp_avg_sq}
    importer.state_import(groups, params)


# -- restoring Adam/AdamW's canonical form, as a restore plan (``plan``) ---------------------------


def _reusable(t: Any, dtype: torch.dtype, shape: tuple[int, ...], param: torch.Tensor | None = None) -> bool:
    """Whether an existing optimizer state tensor can be overwritten in place by a moment
    (a DTensor only if it is split exactly like its parameter)."""

    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.dtype == dtype
        and tuple(t.shape) == shape
        and t.is_contiguous()
        and not t.requires_grad
        and is_dtensor(t) == is_dtensor(param)
        and (not is_dtensor(t) or same_split(t, param))
    )


def _empty_like(param: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new moment tensor: a DTensor split like ``param`` if it is one (FSDP2, TP)."""

    return torch.empty_like(param, dtype=dtype) if is_dtensor(param) else torch.empty(shape, dtype=dtype)


def plan_adam_restore(
    lc: CommitView, names: list[str], optimizer: Any, targets: dict[str, torch.Tensor], group_names: list[str] | None
) -> RestorePlan:
    """Plan restoring the commit's Adam/AdamW canonical form into ``optimizer`` (a torch
    Adam/AdamW, or an optimizer with ``state_import``) for the parameters ``names``
    (``targets``: name -> the caller's parameter), checked before any read: a torch
    optimizer's algorithm, groups and every parameter's group are checked on a stand-in
    (``into_torch``'s checks), so a mismatch is refused before a byte lands (SPEC.md §19.2).

    A moment is read into the optimizer's existing state tensor when that has the right
    dtype, shape and device (restore into an already-built optimizer without allocating);
    otherwise into a new tensor. The install then sets the groups and hands the moments
    read to the optimizer without another copy.
    """
    state = _adam_state(lc, names, optimizer, targets)
    entries = lc.entries()
    reads = tuple(
        ReadItem(getattr(entries[n].optim, k), m, f"{k} of {n!r}")  # payloads: an id or blocks
        for n, po in state.params.items()
        for k, m in (("exp_avg", po.exp_avg), ("exp_avg_sq", po.exp_avg_sq))
        if m is not None
    )
    if hasattr(optimizer, "state_import"):
        held = [n for n in names if n in state.params]
        return RestorePlan(reads, (lambda: into_export(optimizer, state, held),))
    _probe_torch(optimizer, targets, state, group_names)
    return RestorePlan(reads, (lambda: _install_torch(optimizer, targets, state, group_names),))


def _adam_state(lc: CommitView, names: list[str], optimizer: Any, targets: dict[str, torch.Tensor]) -> OptimState:
    """The commit's canonical state of ``names``, each moment a destination tensor to read into."""
    entries = lc.entries()
    state = OptimState(lc.commit.optimizer.algorithm, {g.name: hyper_of(g) for g in lc.commit.optimizer.groups})
    live = getattr(optimizer, "state", None) if not hasattr(optimizer, "state_import") else None
    for n in names:
        o = entries[n].optim
        if o is None:
            continue
        m1 = m2 = None
        if o.exp_avg is not None and o.exp_avg_sq is not None and o.moment_dtype is not None:
            shape, dtype = tuple(entries[n].shape), torch_dtype(o.moment_dtype)
            old = live.get(targets[n], {}) if isinstance(live, Mapping) else {}
            m1, m2 = (
                old[k] if _reusable(old.get(k), dtype, shape, targets[n]) else _empty_like(targets[n], dtype, shape)
                for k in ("exp_avg", "exp_avg_sq")
            )
        state.params[n] = ParamOpt(o.group, o.age, m1, m2)
    return state


def _install_torch(
    optimizer: Any, params: dict[str, torch.Tensor], state: OptimState, group_names: list[str] | None
) -> None:
    """``into_torch`` checks and sets groups; the moments already read are then installed without another copy."""
    bare = OptimState(
        state.algorithm, state.groups, {n: ParamOpt(po.group, po.age, None, None) for n, po in state.params.items()}
    )
    into_torch(optimizer, {t: n for n, t in params.items()}, bare, group_names=group_names)
    for n, po in state.params.items():
        if po.exp_avg is None or po.exp_avg_sq is None:
            continue
        p = params[n]
        m1, m2 = (
            m if m.device == p.device and m.dtype == p.dtype else m.to(device=p.device, dtype=p.dtype)
            for m in (po.exp_avg, po.exp_avg_sq)
        )
        optimizer.state[p] = {"step": _scalar_step(po.age), "exp_avg": m1, "exp_avg_sq": m2}


def _probe_torch(
    optimizer: Any, params: dict[str, torch.Tensor], state: OptimState, group_names: list[str] | None
) -> None:
    """Run ``_install_torch``'s checks (algorithm, groups, every tensor's state and group) on a
    stand-in sharing nothing mutable with ``optimizer``, so that a mismatch is raised before a
    byte is read into the caller's tensors (SPEC.md §19.2)."""
    probe = copy.copy(optimizer)
    probe.param_groups = [
        {k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items()} for g in optimizer.param_groups
    ]
    probe.state = defaultdict(dict)
    bare = OptimState(
        state.algorithm, state.groups, {n: ParamOpt(po.group, po.age, None, None) for n, po in state.params.items()}
    )
    into_torch(probe, {t: n for n, t in params.items()}, bare, group_names=group_names)
