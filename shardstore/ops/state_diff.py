"""What ``diff`` reports about the state beyond Adam: torch-form optimizer state and extras (SPEC.md §Diff).

- per tensor entry: ``kind`` (parameter or buffer) is compared by ``diff`` itself; here, the
  torch form's per-parameter state, key by key (``state momentum_buffer``, ``state step``),
  and its group (``state group``); with ``--stats``, each changed state tensor's statistics;
- per optimizer group of the torch form: every hyperparameter, decoded to Python values;
- per extra (commit-wide ``extra.<key>``, a slot's own ``slot_extra.<slot>.<key>``): added or
  removed (the state document's id), or each top-level field of its state that differs
  (``extra.scheduler.last_epoch: 3 -> 4``); a tensor inside a state shows as
  ``tensor <dtype>[shape] <object id>``, so a changed tensor is a changed value; a DCP
  commit's document (the extra ``torch.distributed.checkpoint``, SPEC.md §9.4) item by item
  (``dcp.<fqn>``: a bytes item's object, a tensor's dtype, size or chunks), its chunks' bytes
  being tensor entries that ``diff`` compares itself;
- a state dict's tree (SPEC.md §9.6): every value that differs by its key path
  (``state_dict.epoch: 3 -> 4``, ``state_dict.optimizer_states[0].param_groups[0].lr``); its
  tensors are tensor entries, which ``diff`` compares by name like any other.
"""

from __future__ import annotations

from typing import Any

from ..errors import ShardstoreError
from ..format.canonical import f64_encode
from ..format.dcp import DCP_EXTRA
from ..format.manifest import MAX_MANIFEST_BYTES, TREE_KEY, ExtraEntry, ParamState, StateTensor, TorchOptimizer
from ..state.documents import TensorRef, read_tree
from ..state.extras import read_extra_state
from ..state.torch_optim import decode_value
from ..store import Store

__all__ = ["state_changes", "state_pairs", "hyper_groups", "extras_changes", "extra_state_view", "tree_changes"]

_MISSING = object()


def state_changes(a: ParamState | None, b: ParamState | None) -> list[str]:
    """Names of what differs between two parameters' torch-form states."""
    if a is None and b is None:
        return []
    if a is None or b is None:
        return ["optimizer state"]
    out = ["state group"] if a.group != b.group else []
    ta, tb = {t.key: t for t in a.tensors}, {t.key: t for t in b.tensors}
    sa, sb = {x.key: x for x in a.scalars}, {x.key: x for x in b.scalars}
    for key in sorted(set(ta) | set(tb) | set(sa) | set(sb)):
        if ta.get(key) != tb.get(key) or sa.get(key) != sb.get(key):
            out.append(f"state {key}")
    return out


def state_pairs(a: ParamState | None, b: ParamState | None) -> dict[str, tuple[StateTensor, StateTensor]]:
    """State tensors in both states, with the same dtype and shape and different objects (for ``--stats``)."""
    if a is None or b is None:
        return {}
    tb = {t.key: t for t in b.tensors}
    return {
        t.key: (t, tb[t.key])
        for t in a.tensors
        if t.key in tb and (t.dtype, t.shape) == (tb[t.key].dtype, tb[t.key].shape) and t.object != tb[t.key].object
    }


def hyper_groups(spec: TorchOptimizer | None) -> dict[str, dict[str, Any]]:
    """Torch-form groups by name, hyperparameters decoded (reals as floats, tuples as lists)."""
    if spec is None:
        return {}
    return {g.name: {k: decode_value(v, like=[]) for k, v in g.hyper.items()} for g in spec.groups}


def extra_state_view(store: Store, x: ExtraEntry) -> dict[str, Any]:
    """An extra's state for people: decoded, each tensor shown as ``tensor <dtype>[shape] <object id>``."""
    marks = [f"tensor {t.dtype}{list(t.shape)} {t.object}" for t in x.tensors]
    return read_extra_state(
        store.get(x.state, limit=MAX_MANIFEST_BYTES), marks, f"state document {x.state} of extra {x.key!r}"
    )  # type: ignore[arg-type]


def extras_changes(
    store: Store, prefix: str, xa: tuple[ExtraEntry, ...], xb: tuple[ExtraEntry, ...]
) -> list[tuple[str, Any, Any]]:
    """(dotted name, before, after) for every extra, or top-level field of one, that differs."""
    da, db = {x.key: x for x in xa}, {x.key: x for x in xb}
    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(da) | set(db)):
        a, b = da.get(key), db.get(key)
        if a == b:
            continue
        if a is None or b is None:
            out.append((f"{prefix}.{key}", a.state if a else None, b.state if b else None))
            continue
        if key == TREE_KEY and prefix == "extra":  # a state dict's tree: every value by key path (SPEC.md §9.6)
            try:
                ta, tb = (read_tree(store.get(x.state, limit=MAX_MANIFEST_BYTES), "state dict tree") for x in (a, b))
            except ShardstoreError:
                out.append((key, a.state, b.state))
            else:
                out += tree_changes(ta, tb, key)
            continue
        try:
            va, vb = extra_state_view(store, a), extra_state_view(store, b)
        except ShardstoreError:
            out.append((f"{prefix}.{key}", a.state, b.state))  # not decodable: the ids say it changed
            continue
        if key == DCP_EXTRA:  # one line per DCP item, not the whole document (SPEC.md §9.4)
            ia, ib = va.pop("items", {}), vb.pop("items", {})
            for fqn in sorted(set(ia) | set(ib)):
                if ia.get(fqn, _MISSING) != ib.get(fqn, _MISSING):
                    out.append((f"dcp.{fqn}", _dcp_item(ia.get(fqn)), _dcp_item(ib.get(fqn))))
        for k in sorted(set(va) | set(vb)):
            if va.get(k, _MISSING) != vb.get(k, _MISSING):
                out.append((f"{prefix}.{key}.{k}", va.get(k), vb.get(k)))
    return out


def _dcp_item(item: Any) -> Any:
    """A DCP document's item for people: ``bytes uint8[n] <object id>``, or a tensor's dtype, size and chunks."""
    if not isinstance(item, dict):
        return item
    if item.get("kind") == "bytes":
        return "bytes " + str(item.get("object", "")).removeprefix("tensor ")
    chunks = [f"{c.get('offsets')}+{c.get('sizes')}" for c in item.get("chunks", [])]
    return f"{item.get('dtype')}{item.get('size')} chunks {' '.join(chunks)}"


def _shown(v: Any) -> Any:
    """A tree's value as JSON can print it: typed values as their text (``tensor <entry>``, ``torch.bfloat16``)."""
    if isinstance(v, TensorRef):
        return f"tensor {v.name}"
    if isinstance(v, dict):
        return {str(k): _shown(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_shown(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def tree_changes(a: Any, b: Any, path: str) -> list[tuple[str, Any, Any]]:
    """(key path, before, after) of every value that differs between two trees, containers of one
    type walked key by key (a key on one side only: before or after is None)."""
    if type(a) is type(b) and isinstance(a, dict):
        out = []
        for k in sorted({*a, *b}, key=lambda k: (isinstance(k, str), k if isinstance(k, str) else str(k).zfill(24))):
            where = f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]"
            if k not in a or k not in b:
                out.append((where, _shown(a.get(k)), _shown(b.get(k))))
            else:
                out += tree_changes(a[k], b[k], where)
        return out
    if type(a) is type(b) and isinstance(a, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in tree_changes(x, y, f"{path}[{i}]")]
    same = type(a) is type(b) and (a == b or (isinstance(a, float) and f64_encode(a) == f64_encode(b)))  # NaN is NaN
    if not same:
        return [(path, _shown(a), _shown(b))]
    return []
