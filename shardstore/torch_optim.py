"""Any torch optimizer whose state is tensors and numbers (SPEC.md §Optimizer state, any torch optimizer).

Adam and AdamW keep their own canonical form (``optim.py``: groups of five F64
hyperparameters, Adam age, two moments), unchanged. Every other ``torch.optim.Optimizer``
(SGD with momentum, Adam with AMSGrad, Adagrad, RMSprop, Adafactor, ...) is held in the
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

Restore checks everything (class, group names, every parameter's state present and in the
same group) before a byte is read, then hands torch's own ``load_state_dict`` a state dict
built by name, so torch's device and dtype rules for state apply.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import BindingError, ManifestError, ShardstoreError, StateMismatch, UnsupportedOptimizer
from .extras import extras_rules
from .grid import check_stored_all, grid_problems, payload_blocks
from .manifest import (
    STATE_CHUNKED_VERSION,
    CommitManifest,
    HyperGroup,
    OptimizerSpec,
    ParamState,
    Payload,
    ShardManifest,
    StateScalar,
    StateTensor,
    TensorEntry,
    TorchOptimizer,
    f64_decode,
    f64_encode,
    is_chunked,
    state_payloads,
)
from .names import check_group_name
from .optim import OptimState, ParamOpt, _group_names  # one group-naming rule for both forms
from .tensors import check_storable, dtype_name, expected_nbytes, torch_dtype

__all__ = ["REAL_PREFIX", "class_name", "is_adam_form", "capture_torch", "TorchRestore", "plan_torch_restore", "state_objects", "state_problems", "torch_spec", "torch_union", "use_torch_form", "shard_rules", "commit_rules"]

REAL_PREFIX = "f64:"
_SKIP_GROUP_KEYS = ("params", "param_names")
_STATE_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")  # manifest.StateKey
_LABEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:+-]{0,127}")  # manifest.Label
_INT_RANGE = (-(2**63), 2**64 - 1)  # what the canonical JSON encoder writes as an integer


def class_name(optimizer: Any) -> str:
    """``module.qualname`` of the optimizer's class; refused if it is not a label (a class defined in a function)."""
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if _LABEL.fullmatch(name) is None:
        raise UnsupportedOptimizer(f"optimizer class {name!r} is not a label (SPEC.md §Names); define it at module level")
    return name


def is_adam_form(optimizer: Any) -> bool:
    """Whether a torch optimizer is held in the Adam canonical form (Adam/AdamW without amsgrad or maximize)."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        return False
    return not any(g.get("amsgrad", False) or g.get("maximize", False) for g in optimizer.param_groups)


def _scalar(value: Any, where: str) -> bool | int | str | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise UnsupportedOptimizer(f"{where}: integer {value} is outside the 64-bit range the canonical form holds")
        return value
    if isinstance(value, float):
        return REAL_PREFIX + f64_encode(value)
    if isinstance(value, str):
        if value.startswith(REAL_PREFIX):
            raise UnsupportedOptimizer(f"{where}: string {value!r} starts with the reserved prefix {REAL_PREFIX!r}")
        return value
    raise UnsupportedOptimizer(f"{where}: a {type(value).__name__} is neither a number nor a string (SPEC.md §Optimizer state)")


def _hyper(value: Any, where: str) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_scalar(v, f"{where}[{i}]") for i, v in enumerate(value))
    return _scalar(value, where)


def _unscalar(value: Any) -> Any:
    if isinstance(value, str) and value.startswith(REAL_PREFIX):
        return f64_decode(value[len(REAL_PREFIX):])
    return value


def _unhyper(value: Any, live: Any) -> Any:
    if isinstance(value, tuple):
        seq = [_unscalar(v) for v in value]
        return list(seq) if isinstance(live, list) else tuple(seq)
    return _unscalar(value)


def _state_scalar(key: str, value: Any, where: str) -> StateScalar:
    if isinstance(value, torch.Tensor):
        dtype = dtype_name(value.dtype, where)
        item = value.item()
        v: Any = bool(item) if dtype == "bool" else (int(item) if not value.is_floating_point() else float(item))
        return StateScalar(key=key, value=_scalar(v, where), dtype=dtype)
    if isinstance(value, str) or not (value is None or isinstance(value, (bool, int, float))):
        raise UnsupportedOptimizer(f"{where}: a {type(value).__name__} is neither a tensor nor a number (SPEC.md §Optimizer state)")
    return StateScalar(key=key, value=_scalar(value, where))


@dataclass
class TorchParam:
    """One parameter's state in the torch form, before its tensors are written."""

    group: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, StateScalar] = field(default_factory=dict)


def capture_torch(optimizer: Any, param_names: Mapping[torch.Tensor, str], *, group_names: list[str] | None = None) -> OptimState:
    """Any torch optimizer in the torch form: class, groups by name, per-parameter state by tensor name.

    State tensors are referenced, not copied. Parameters not in ``param_names`` are skipped.
    """
    cls = class_name(optimizer)
    by_id = {id(p): n for p, n in param_names.items()}
    groups: dict[str, HyperGroup] = {}
    params: dict[str, TorchParam] = {}
    for gname, g in zip(_group_names(optimizer, group_names), optimizer.param_groups):
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
        StateTensor(key=k, dtype=dtype_name(t.dtype, k), shape=tuple(t.shape), object=next(ids)) for k, t in sorted(tp.tensors.items())
    )
    return ParamState(group=check_group_name(tp.group), tensors=tensors, scalars=tuple(tp.scalars[k] for k in sorted(tp.scalars)))


def state_objects(e: TensorEntry) -> Iterator[tuple[str, int, str]]:
    """(object id, byte size, role) of every object of every state tensor of an entry: one per
    block of a chunked one (for verify, copy and gc)."""
    for key, payload, dtype, shape in state_payloads(e):
        blocks = payload_blocks(payload, dtype, shape)
        for i, (oid, _box, n) in enumerate(blocks):
            yield oid, n, f"optimizer state {key!r}" + (f" block {i}" if len(blocks) > 1 else "")


def state_problems(e: TensorEntry, version: int) -> Iterator[str]:
    """What is wrong with the payloads of an entry's state tensors in a manifest of ``version``:
    from version 3 they follow the canonical grid (SPEC.md §Chunked payloads); before, each is
    one object whatever its size (what versions 1 and 2 wrote, still read)."""
    for key, payload, dtype, shape in state_payloads(e):
        if version >= STATE_CHUNKED_VERSION:
            for msg in grid_problems(payload, dtype, shape):
                yield f"optimizer state {key!r} payload: {msg}"
        elif is_chunked(payload):  # the version rule reports it too; say which tensor
            yield f"optimizer state {key!r} is chunked in a version {version} manifest (chunked state needs version {STATE_CHUNKED_VERSION})"


def _scalar_value(s: StateScalar) -> Any:
    v = _unscalar(s.value)
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
    from .dtensor import is_dtensor

    return is_dtensor(param) and tuple(param.shape) == tuple(t.shape)


@dataclass
class TorchRestore:
    """A checked plan: reads into fresh state tensors, then ``install`` loads them with ``load_state_dict``."""

    optimizer: Any
    reads: list[tuple[Payload, torch.Tensor, str]]
    state_dict: dict[str, Any]

    def install(self) -> None:
        self.optimizer.load_state_dict(self.state_dict)


def plan_torch_restore(
    store: object,
    optimizer_spec: OptimizerSpec,
    entries: Mapping[str, TensorEntry],
    optimizer: Any,
    targets: Mapping[str, torch.Tensor],
    group_names: list[str] | None,
    commit_id: str,
) -> TorchRestore:
    """Check that the commit's torch-form state fits ``optimizer`` and plan its reads; raise before any write."""
    live, spec = class_name(optimizer), optimizer_spec.torch_optimizer
    if spec is None:
        raise StateMismatch(f"commit {commit_id} holds {optimizer_spec.algorithm} optimizer state but the optimizer is {live}")
    if spec.class_name != live:
        raise StateMismatch(f"commit {commit_id} holds {spec.class_name} state but the optimizer is {live}; refusing to install it")
    groups = {g.name: g for g in spec.groups}
    by_id = {id(t): n for n, t in targets.items()}
    reads: list[tuple[Payload, torch.Tensor, str]] = []
    saved_groups: list[dict[str, Any]] = []
    state: dict[int, dict[str, Any]] = {}
    dests: list[tuple[dict[str, Any], torch.Tensor, StateTensor, str]] = []
    index = 0
    for gname, g in zip(_group_names(optimizer, group_names), optimizer.param_groups):
        h = groups.get(gname)
        if h is None and g["params"]:
            raise StateMismatch(f"optimizer group {gname!r} is not in commit {commit_id} (groups: {sorted(groups)})")
        saved = {k: v for k, v in g.items() if k not in _SKIP_GROUP_KEYS}  # an empty group saves no hyperparameters
        saved.update({k: _unhyper(v, g.get(k)) for k, v in (h.hyper.items() if h is not None else ())})
        saved["params"] = list(range(index, index + len(g["params"])))
        saved_groups.append(saved)
        for p in g["params"]:
            name = by_id.get(id(p))
            if name is None:
                raise StateMismatch(f"optimizer group {gname!r} holds a parameter that is not among the model's owned tensors")
            e = entries.get(name)
            if e is None or e.state is None:
                raise StateMismatch(f"tensor {name!r} has no {spec.class_name} state in commit {commit_id}")
            if e.state.group != gname:
                raise StateMismatch(f"tensor {name!r} is in group {e.state.group!r} in commit {commit_id} but in {gname!r} here")
            st: dict[str, Any] = {s.key: _scalar_value(s) for s in e.state.scalars}
            dests += [(st, p, t, f"optimizer state {t.key!r} of {name!r}") for t in e.state.tensors]
            if st or e.state.tensors:
                state[index] = st
            index += 1
    # every shape only the manifest gives is checked against its objects' sizes, the size
    # queries together, before any state tensor is allocated (SPEC.md §Limits)
    check_stored_all(store, [(t.object, t.dtype, tuple(t.shape), what) for _, p, t, what in dests if not _sized_by_param(p, t)])
    for st, p, t, what in dests:
        st[t.key] = dest = _state_dest(p, t)
        reads.append((t.object, dest, what))
    return TorchRestore(optimizer, reads, {"state": state, "param_groups": saved_groups})


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
    if hasattr(optimizer, "state_import"):
        return False
    return spec.algorithm == "torch" or (isinstance(optimizer, torch.optim.Optimizer) and not is_adam_form(optimizer))


def _sorted_unique(names: list[str]) -> bool:
    return all(a < b for a, b in zip(names, names[1:]))


def shard_rules(shard: ShardManifest) -> Iterator[tuple[type[ManifestError], str, str | None]]:
    """Structural rules of buffers and of the torch form in one shard manifest: (error, message, tensor)."""
    spec = shard.torch_optimizer
    if (shard.algorithm == "torch") != (spec is not None):
        yield ManifestError, "torch_optimizer must be present exactly under algorithm 'torch' (SPEC.md §Optimizer state)", None
    if spec is not None and shard.groups:
        yield ManifestError, "algorithm 'torch' with Adam groups", None
    gnames = [g.name for g in spec.groups] if spec is not None else []
    if not _sorted_unique(gnames):
        yield ManifestError, "torch optimizer groups are not sorted by name and unique", None
    for msg in _hyper_rules(spec):
        yield ManifestError, msg, None
    used: set[str] = set()
    for e in shard.entries:
        if e.kind == "buffer" and (e.optim is not None or e.state is not None):
            yield ManifestError, "a buffer has optimizer state (SPEC.md §Buffers)", e.name
        if e.optim is not None and shard.algorithm == "torch":
            yield ManifestError, "Adam state under algorithm 'torch'", e.name
        st = e.state
        if st is None:
            continue
        used.add(st.group)
        if shard.algorithm != "torch":
            yield ManifestError, f"torch-form optimizer state under algorithm {shard.algorithm!r}", e.name
        if st.group not in gnames:
            yield ManifestError, f"group {st.group!r} is not among the shard's torch optimizer groups {gnames}", e.name
        tkeys, skeys = [t.key for t in st.tensors], [x.key for x in st.scalars]
        if not (_sorted_unique(tkeys) and _sorted_unique(skeys)) or set(tkeys) & set(skeys):
            yield ManifestError, "optimizer state keys are not sorted, unique and each either a tensor or a scalar", e.name
        for x in st.scalars:
            if not _in_range(x.value):  # the writer's range (``_scalar``), enforced when reading too (SPEC.md §9a)
                yield ManifestError, f"optimizer state {x.key!r}: integer {x.value} is outside the 64-bit range -2^63 <= n < 2^64", e.name
            kind = None if x.dtype is None else ("bool" if x.dtype == "bool" else ("real" if torch_dtype(x.dtype).is_floating_point else "int"))
            have = "bool" if isinstance(x.value, bool) else ("int" if isinstance(x.value, int) else ("real" if isinstance(x.value, str) else None))
            if kind is not None and have != kind:
                yield ManifestError, f"optimizer state {x.key!r}: a {x.dtype} 0-d tensor must hold a {kind}, not {have}", e.name
    if set(gnames) - used:
        yield ManifestError, f"torch optimizer groups {sorted(set(gnames) - used)} are not used by any tensor entry", None


def _in_range(value: Any) -> bool:
    """Whether a state scalar or hyperparameter (a tuple of them, too) holds no integer outside ``_INT_RANGE``."""
    if isinstance(value, tuple):
        return all(_in_range(v) for v in value)
    return not isinstance(value, int) or isinstance(value, bool) or _INT_RANGE[0] <= value <= _INT_RANGE[1]


def _hyper_rules(spec: TorchOptimizer | None) -> Iterator[str]:
    for g in spec.groups if spec is not None else ():
        for k, v in sorted(g.hyper.items()):
            if not _in_range(v):
                yield f"torch optimizer group {g.name!r}: hyperparameter {k!r} holds an integer outside the 64-bit range -2^63 <= n < 2^64"


def commit_rules(commit: CommitManifest, shards: Mapping[int, ShardManifest]) -> Iterator[tuple[type[ShardstoreError], str, str | None]]:
    """Rules of the torch form and extras binding a commit to its shards: (error, message, shard manifest id)."""
    spec = commit.optimizer.torch_optimizer
    tgroups = {g.name: g for g in spec.groups} if spec is not None else {}
    if (commit.optimizer.algorithm == "torch") != (spec is not None) or (spec is not None and commit.optimizer.groups):
        yield ManifestError, "torch_optimizer must be present exactly under algorithm 'torch', without Adam groups", None
    if spec is not None and [g.name for g in spec.groups] != sorted(tgroups):
        yield ManifestError, "torch optimizer groups are not sorted by name and unique", None
    for msg in _hyper_rules(spec):
        yield ManifestError, msg, None
    for msg in extras_rules(commit.extras):
        yield ManifestError, msg, None
    used: set[str] = set()
    sids = {lay.slot: lay.shard for lay in commit.layout}
    for slot, shard in sorted(shards.items()):
        t = shard.torch_optimizer
        if t is None:
            continue
        if spec is None or t.class_name != spec.class_name:
            want = spec.class_name if spec else None
            yield BindingError, f"shard's optimizer class is {t.class_name!r} but the commit's is {want!r} (SPEC.md §Binding)", sids.get(slot)
        for g in t.groups:
            if tgroups.get(g.name) != g:
                yield BindingError, f"group {g.name!r} differs from the commit's torch optimizer group of that name", sids.get(slot)
            used.add(g.name)
    if set(tgroups) - used and len(shards) == len(commit.layout):
        yield ManifestError, f"torch optimizer groups {sorted(set(tgroups) - used)} are used by no tensor", None
