"""Any torch optimizer whose state is tensors and numbers (SPEC.md §Optimizer state, any torch optimizer).

Adam and AdamW keep their own canonical form (``optim.py``: groups of five F64
hyperparameters, Adam age, two moments), unchanged. Every other ``torch.optim.Optimizer``
(SGD with momentum, Adam with AMSGrad, Adagrad, RMSprop, Adafactor, an Adam whose param groups
hold keys of their own: ``custom_group_keys``, ...) is held in the
*torch form*, algorithm ``torch``:

- the optimizer's class (``module.qualname``), so that state is never installed into an
  optimizer of another class;
- each param group by name (its ``name`` key, else ``g<index>``, as for Adam) with every
  hyperparameter but ``params`` / ``param_names``: booleans, integers, strings, null, reals
  as ``"f64:" + F64``, and tuples of those;
- per parameter, by tensor name: its group, every state tensor as a tensor object named by
  (parameter, state key) — written and read by the same code path as the parameters — and
  every scalar (a Python number or a 0-d tensor, such as ``step``) as a number, with the
  0-d tensor's dtype so it comes back as the same tensor.

Anything else in the state (a list, a dict, a string) or a tensor-valued hyperparameter is
refused with ``UnsupportedOptimizer`` naming the group or parameter and the key.

A restore is planned by ``plan_torch_restore`` (a ``plan.RestorePlan``, like every other part
of a restore): it checks everything (class, group names, every parameter's state present and
in the same group) before a byte is read, and its install hands torch's own
``load_state_dict`` a state dict built by name, so torch's device and dtype rules for state
apply. ``decode_value`` gives a stored hyperparameter or state scalar back as Python.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..errors import ManifestError, StateMismatch, UnsupportedOptimizer
from ..format.canonical import REAL_PREFIX, decode_real, encode_scalar, is_real
from ..format.grid import check_stored_all, payload_blocks
from ..format.lazy import torch
from ..format.manifest import (
    HyperGroup,
    OptimizerSpec,
    ParamState,
    Payload,
    ShardManifest,
    StateScalar,
    StateTensor,
    TensorEntry,
    TorchOptimizer,
    state_payloads,
)
from ..format.names import check_group_name
from ..format.tensors import check_storable, dtype_name, is_dtensor, torch_dtype
from .optim import (
    ImportsState,
    OptimState,
    ParamOpt,
    TorchParam,
    param_group_names,
)  # one group-naming rule for both forms
from .plan import ReadItem, RestorePlan

__all__ = [
    "REAL_PREFIX",
    "class_name",
    "is_adam_form",
    "custom_group_keys",
    "capture_torch",
    "plan_torch_restore",
    "decode_value",
    "state_objects",
    "torch_spec",
    "torch_union",
    "use_torch_form",
]

_SKIP_GROUP_KEYS = ("params", "param_names")
_STATE_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")  # manifest.StateKey
_LABEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:+-]{0,127}")  # manifest.Label


def class_name(optimizer: Any) -> str:
    """``module.qualname`` of the optimizer's class; refused if it is not a label (a class defined in a function)."""
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if _LABEL.fullmatch(name) is None:
        raise UnsupportedOptimizer(
            f"optimizer class {name!r} is not a label (SPEC.md §Names); define it at module level"
        )
    return name


#: Param group keys torch's LR schedulers add (their constructors set them again on a resume).
_SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr"})


def custom_group_keys(optimizer: Any) -> list[str]:
    """Keys of a torch optimizer's param groups the Adam form would leave out and nothing sets again:
    all but its own (``defaults``: the five numbers the form holds and the flags its construction
    sets), ``params``, ``param_names``, the group's ``name`` and the LR schedulers' keys. An Adam or
    AdamW with any (a user's ``lr_mult``, timm's ``lr_scale``) is saved in the torch form, which holds
    every key: the Adam form would drop the value (SPEC.md §9)."""
    known = set(getattr(optimizer, "defaults", {})) | {"params", "param_names", "name"} | _SCHEDULER_KEYS
    return sorted({k for g in optimizer.param_groups for k in g} - known)


def is_adam_form(optimizer: Any) -> bool:
    """Whether a torch optimizer is held in the Adam canonical form (Adam/AdamW without amsgrad or maximize)."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        return False
    return not any(g.get("amsgrad", False) or g.get("maximize", False) for g in optimizer.param_groups)


def _scalar(value: Any, where: str) -> bool | int | str | None:
    return encode_scalar(value, where, UnsupportedOptimizer)


def _hyper(value: Any, where: str) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_scalar(v, f"{where}[{i}]") for i, v in enumerate(value))
    return _scalar(value, where)


def decode_value(value: Any, like: Any = None) -> Any:
    """A stored torch-form value (a hyperparameter or a state scalar) as Python: each real
    (``"f64:" + F64``) as a float, a tuple as a list when ``like`` (the live value it
    replaces) is a list, else as a tuple; ManifestError for a malformed real."""
    if isinstance(value, tuple):
        seq = [_decode_scalar(v) for v in value]
        return seq if isinstance(like, list) else tuple(seq)
    return _decode_scalar(value)


def _decode_scalar(value: Any) -> Any:
    return decode_real(value, "optimizer state", ManifestError) if is_real(value) else value


def _state_scalar(key: str, value: Any, where: str) -> StateScalar:
    if isinstance(value, torch.Tensor):
        dtype = dtype_name(value.dtype, where)
        item = value.item()
        v: Any = bool(item) if dtype == "bool" else (int(item) if not value.is_floating_point() else float(item))
        return StateScalar(key=key, value=_scalar(v, where), dtype=dtype)
    if isinstance(value, str) or not (value is None or isinstance(value, (bool, int, float))):
        raise UnsupportedOptimizer(
            f"{where}: a {type(value).__name__} is neither a tensor nor a number (SPEC.md §Optimizer state)"
        )
    return StateScalar(key=key, value=_scalar(value, where))


def capture_torch(
    optimizer: Any, param_names: Mapping[torch.Tensor, str], *, group_names: list[str] | None = None
) -> OptimState:
    """Any torch optimizer in the torch form: class, groups by name, per-parameter state by tensor name.

    State tensors are referenced, not copied. Parameters not in ``param_names`` are skipped.
    """
    cls = class_name(optimizer)
    by_id = {id(p): n for p, n in param_names.items()}
    groups: dict[str, HyperGroup] = {}
    params: dict[str, TorchParam] = {}
    for gname, g in zip(param_group_names(optimizer, group_names), optimizer.param_groups):
        hyper = {}
        for k, v in g.items():
            if k in _SKIP_GROUP_KEYS:
                continue
            if not isinstance(k, str):
                raise UnsupportedOptimizer(f"param group {gname!r}: key {k!r} is not a string")
            hyper[_key(k, f"param group {gname!r}")] = _hyper(v, f"param group {gname!r}, hyperparameter {k!r}")
        groups[gname] = HyperGroup(name=gname, hyper=dict(sorted(hyper.items())))
        for p in g["params"]:
            name = by_id.get(id(p))
            if name is None:
                continue
            tp = TorchParam(gname)
            for k, v in optimizer.state.get(p, {}).items():
                where = f"optimizer state of tensor {name!r}, key {k!r}"
                key = _key(k, where)
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    check_storable(v, where)
                    tp.tensors[key] = v
                else:
                    tp.scalars[key] = _state_scalar(key, v, where)
            params[name] = tp
    return OptimState("torch", {}, {n: ParamOpt(tp.group, 0, None, None, tp) for n, tp in params.items()}, cls, groups)


def torch_spec(state: OptimState) -> TorchOptimizer | None:
    """The shard manifest's torch optimizer of a slot's captured state (None if not the torch form)."""
    if not state.torch_groups or state.class_name is None:
        return None
    return TorchOptimizer(class_name=state.class_name, groups=tuple(h for _, h in sorted(state.torch_groups.items())))


def _key(k: Any, where: str) -> str:
    if not isinstance(k, str) or _STATE_KEY.fullmatch(k) is None:
        raise UnsupportedOptimizer(f"{where}: key {k!r} is not a state key (SPEC.md §Names)")
    return k


def param_state(tp: TorchParam, ids: Iterator[Payload]) -> ParamState:
    """The manifest record of one parameter's state; ``ids`` yields its tensors' payloads in key order.

    A state tensor may be a ``StoredPayload`` (a DTensor the block exchange wrote): its
    dtype and shape are the whole tensor's."""
    tensors = tuple(
        StateTensor(key=k, dtype=dtype_name(t.dtype, k), shape=tuple(t.shape), object=next(ids))
        for k, t in sorted(tp.tensors.items())
    )
    return ParamState(
        group=check_group_name(tp.group), tensors=tensors, scalars=tuple(tp.scalars[k] for k in sorted(tp.scalars))
    )


def state_objects(e: TensorEntry) -> Iterator[tuple[str, int, str]]:
    """(object id, byte size, role) of every object of every state tensor of an entry: one per
    block of a chunked one (for verify, copy and gc)."""
    for key, payload, dtype, shape in state_payloads(e):
        blocks = payload_blocks(payload, dtype, shape)
        for i, (oid, _box, n) in enumerate(blocks):
            yield oid, n, f"optimizer state {key!r}" + (f" block {i}" if len(blocks) > 1 else "")


def _scalar_value(s: StateScalar) -> Any:
    v = decode_value(s.value)
    return v if s.dtype is None else torch.tensor(v, dtype=torch_dtype(s.dtype))


def _state_dest(param: torch.Tensor, t: StateTensor) -> torch.Tensor:
    """A new state tensor to read into: for a DTensor parameter (FSDP2, TP) a state tensor of
    its shape is a DTensor split like it (what torch's optimizers create for it, so a restore
    reads only the blocks this rank's slice overlaps); anything else a plain CPU tensor, of a
    shape only the manifest gives, so allocated only once the objects it names are known to
    hold that many bytes (SPEC.md §Limits): ``plan_torch_restore`` checks them all first."""
    dtype, shape = torch_dtype(t.dtype), tuple(t.shape)
    if _sized_by_param(param, t):
        return torch.empty_like(param, dtype=dtype)  # sized by the caller's own parameter
    return torch.empty(shape, dtype=dtype)  # plan_torch_restore checked its objects first


def _sized_by_param(param: torch.Tensor, t: StateTensor) -> bool:

    return is_dtensor(param) and tuple(param.shape) == tuple(t.shape)


def plan_torch_restore(
    store: object,
    optimizer_spec: OptimizerSpec,
    entries: Mapping[str, TensorEntry],
    optimizer: Any,
    targets: Mapping[str, torch.Tensor],
    group_names: list[str] | None,
    commit_id: str,
) -> RestorePlan:
    """Plan restoring the commit's torch-form state into ``optimizer``: check that it fits (class,
    group names, every parameter's state present and in the same group) and allocate the state
    tensors it reads into; raise before any write. The install hands torch's own
    ``load_state_dict`` a state dict built by name, so torch's device and dtype rules apply."""
    live, spec = class_name(optimizer), optimizer_spec.torch_optimizer
    if spec is None:
        raise StateMismatch(
            f"commit {commit_id} holds {optimizer_spec.algorithm} optimizer state but the optimizer is {live}"
        )
    if spec.class_name != live:
        raise StateMismatch(
            f"commit {commit_id} holds {spec.class_name} state but the optimizer is {live}; refusing to install it"
        )
    groups = {g.name: g for g in spec.groups}
    by_id = {id(t): n for n, t in targets.items()}
    reads: list[ReadItem] = []
    saved_groups: list[dict[str, Any]] = []
    state: dict[int, dict[str, Any]] = {}
    dests: list[tuple[dict[str, Any], torch.Tensor, StateTensor, str]] = []
    index = 0
    for gname, g in zip(param_group_names(optimizer, group_names), optimizer.param_groups):
        h = groups.get(gname)
        if h is None and g["params"]:
            raise StateMismatch(f"optimizer group {gname!r} is not in commit {commit_id} (groups: {sorted(groups)})")
        saved = {k: v for k, v in g.items() if k not in _SKIP_GROUP_KEYS}  # an empty group saves no hyperparameters
        saved.update({k: decode_value(v, g.get(k)) for k, v in (h.hyper.items() if h is not None else ())})
        saved["params"] = list(range(index, index + len(g["params"])))
        saved_groups.append(saved)
        for p in g["params"]:
            name = by_id.get(id(p))
            if name is None:
                raise StateMismatch(
                    f"optimizer group {gname!r} holds a parameter that is not among the model's owned tensors"
                )
            e = entries.get(name)
            if e is None or e.state is None:
                raise StateMismatch(f"tensor {name!r} has no {spec.class_name} state in commit {commit_id}")
            if e.state.group != gname:
                raise StateMismatch(
                    f"tensor {name!r} is in group {e.state.group!r} in commit {commit_id} but in {gname!r} here"
                )
            st: dict[str, Any] = {s.key: _scalar_value(s) for s in e.state.scalars}
            dests += [(st, p, t, f"optimizer state {t.key!r} of {name!r}") for t in e.state.tensors]
            if st or e.state.tensors:
                state[index] = st
            index += 1
    # every shape only the manifest gives is checked against its objects' sizes, the size
    # queries together, before any state tensor is allocated (SPEC.md §Limits)
    check_stored_all(
        store, [(t.object, t.dtype, tuple(t.shape), what) for _, p, t, what in dests if not _sized_by_param(p, t)]
    )
    for st, p, t, what in dests:
        st[t.key] = dest = _state_dest(p, t)
        reads.append(ReadItem(t.object, dest, what))
    state_dict = {"state": state, "param_groups": saved_groups}
    return RestorePlan(tuple(reads), (lambda: optimizer.load_state_dict(state_dict),))


def torch_union(shards: Iterable[ShardManifest]) -> TorchOptimizer | None:
    """The commit's torch-form optimizer: the one class, and the union of the slots' groups."""
    specs = [s.torch_optimizer for s in shards if s.torch_optimizer is not None]
    if not specs:
        return None
    classes = sorted({t.class_name for t in specs})
    if len(classes) > 1:
        raise StateMismatch(f"slots use different optimizer classes: {classes}")
    groups: dict[str, Any] = {}
    for t in specs:
        for g in t.groups:
            if groups.setdefault(g.name, g) != g:
                raise StateMismatch(f"slots disagree on the hyperparameters of optimizer group {g.name!r}")
    return TorchOptimizer(class_name=classes[0], groups=tuple(groups[k] for k in sorted(groups)))


def use_torch_form(commit_id: str, spec: OptimizerSpec, optimizer: Any) -> bool:
    """Whether restore goes through the torch form (any torch optimizer but Adam/AdamW's canonical form)."""
    if spec.algorithm == "torch" and not isinstance(optimizer, torch.optim.Optimizer):
        name = spec.torch_optimizer.class_name if spec.torch_optimizer else "torch"
        raise StateMismatch(f"commit {commit_id} holds {name} state; it restores into that torch optimizer class only")
    if isinstance(optimizer, ImportsState):
        return False
    return spec.algorithm == "torch" or (isinstance(optimizer, torch.optim.Optimizer) and not is_adam_form(optimizer))
