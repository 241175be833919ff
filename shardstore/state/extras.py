"""Stateful extras: any object with ``state_dict()`` / ``load_state_dict()`` (SPEC.md §Extras).

LR schedulers, ``torch.amp.GradScaler``, a data loader's position, a user's own counters:
whatever a run needs besides the model and the optimizer, passed by key::

    shardstore.save(store, model, opt, step=s, extra={"scheduler": sched, "scaler": scaler})
    shardstore.restore(store, "main", model, opt, extra={"scheduler": sched, "scaler": scaler})

An extra's ``state_dict()`` is stored without pickle as a *state document*: an object
holding canonical JSON (sorted keys, no whitespace) of a dict with string keys whose values
are null, booleans, integers (64-bit), strings, lists, dicts, reals written as the string
``"f64:" + F64`` and tensors written as ``"tensor:<i>"``, where ``i`` indexes the extra's
tensor list: each tensor is a tensor object, stored by the same code path as parameters.
Tensor references are numbered in the order a walk with sorted keys meets them, so one
state has exactly one document. Tuples come back as lists, NumPy scalars as Python
numbers, and tensors as CPU tensors (``load_state_dict`` moves what it needs). Anything else
— a function, a generator, a set, an instance of a custom class, a non-string key, a string
that starts with a reserved prefix — is refused with ``UnsupportedState`` naming the key
path (``extra 'scheduler' at $.lr_lambdas[0]``), before anything is written.

The state is taken (``state_dict()`` called and encoded) when ``capture_extras`` runs, so a
background save (``AsyncSaver``) stores the state as it was when ``save`` was called.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from ..errors import ManifestError, StateMismatch, UnsupportedState
from ..format.bounded import check_json_nesting
from ..format.canonical import REAL_PREFIX, TENSOR_PREFIX, decode_real, encode_scalar, in_int_range, is_real
from ..format.grid import check_stored_all
from ..format.lazy import torch
from ..format.manifest import MAX_MANIFEST_BYTES, ExtraEntry, StateTensor, check_writable, extra_objects, is_chunked
from ..format.names import check_group_name
from ..format.tensors import check_storable, dtype_name, is_dtensor, torch_dtype
from .stateful import GeneratorState, LoaderState, stateful

if TYPE_CHECKING:
    from ..store import Store

__all__ = [
    "CapturedExtra",
    "capture_extras",
    "write_extras",
    "extra_objects",
    "read_extra_state",
    "ExtrasRestore",
    "plan_extras_restore",
    "extras_rules",
]

_TENSOR = TENSOR_PREFIX
_MAX_DEPTH = 64
_ENC = msgspec.json.Encoder(order="sorted")


@dataclass
class CapturedExtra:
    """One extra's state, taken: its canonical document and the tensors it references (by index)."""

    key: str
    document: bytes
    tensors: list[torch.Tensor]


def _encode_value(value: Any, path: str, tensors: list[torch.Tensor], depth: int, key: str) -> Any:
    where = f"extra {key!r} at {path}"
    if depth > _MAX_DEPTH:
        raise UnsupportedState(f"{where}: nested deeper than {_MAX_DEPTH} levels")
    if isinstance(value, torch.Tensor):
        if is_dtensor(value):  # one process's slice of it: storing that as the whole would be wrong
            raise UnsupportedState(
                f"{where}: a DTensor holds only this process's slice; an extra's tensors are stored whole, "
                "by one process (pass full_tensor() or a plain tensor; SPEC.md §Extras)"
            )
        check_storable(value, where)
        tensors.append(value)
        return f"{_TENSOR}{len(tensors) - 1}"
    if isinstance(value, (list, tuple)):
        return [_encode_value(v, f"{path}[{i}]", tensors, depth + 1, key) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str):
                raise UnsupportedState(
                    f"{where}: key {k!r} is a {type(k).__name__}; state keys must be strings (SPEC.md §Extras)"
                )
        return {k: _encode_value(value[k], f"{path}.{k}", tensors, depth + 1, key) for k in sorted(value)}
    np_value = _numpy_scalar(value)
    if np_value is not None:
        return _encode_value(np_value, path, tensors, depth, key)
    if value is None or isinstance(value, (bool, int, float, str)):
        return encode_scalar(value, where, UnsupportedState, reserved=(REAL_PREFIX, _TENSOR))
    raise UnsupportedState(
        f"{where}: a {type(value).__module__}.{type(value).__qualname__} is not storable without pickle "
        "(allowed: null, bool, int, float, str, list, dict with str keys, tensor; SPEC.md §Extras)"
    )


def _numpy_scalar(value: Any) -> bool | int | float | None:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return None
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return None


def capture_extras(extra: Mapping[str, Any] | None) -> dict[str, CapturedExtra]:
    """Take every extra's state now (``state_dict()``, encoded); tensors are referenced, not copied."""
    out: dict[str, CapturedExtra] = {}
    for key, obj in sorted((extra or {}).items()):
        check_group_name(key)
        if isinstance(obj, CapturedExtra):
            out[key] = obj
            continue
        obj = stateful(obj)  # a torch.Generator or DataLoader: its generators' states (``stateful``)
        fn = getattr(obj, "state_dict", None)
        if not callable(fn):
            raise UnsupportedState(f"extra {key!r}: a {type(obj).__name__} has no state_dict() (SPEC.md §Extras)")
        state = fn()
        if not isinstance(state, Mapping):
            raise UnsupportedState(f"extra {key!r}: state_dict() returned a {type(state).__name__}, not a dict")
        tensors: list[torch.Tensor] = []
        doc = _encode_value(state, "$", tensors, 0, key)
        out[key] = CapturedExtra(key, check_writable(_ENC.encode(doc), f"state document of extra {key!r}"), tensors)
    return out


def write_extras(store: Store, captured: Mapping[str, CapturedExtra], *, threads: int = 2) -> tuple[ExtraEntry, ...]:
    """Write each extra's tensors and document (no barrier: the caller's comes before any manifest)."""
    entries = []
    for key, c in sorted(captured.items()):
        ids = store.put_tensors(c.tensors, threads=threads) if c.tensors else []
        refs = tuple(
            StateTensor(key=str(i), dtype=dtype_name(t.dtype, key), shape=tuple(t.shape), object=oid)
            for i, (t, oid) in enumerate(zip(c.tensors, ids))
        )
        entries.append(ExtraEntry(key=key, state=store.put(c.document), tensors=refs))
    return tuple(entries)


def _decode_value(value: Any, tensors: list[torch.Tensor], seen: list[int], what: str, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:  # the encoder's rule, value for value (a leaf too)
        raise ManifestError(f"{what}: nested deeper than {_MAX_DEPTH} levels (SPEC.md §Limits)")
    if isinstance(value, float):
        raise ManifestError(f"{what}: holds a plain JSON real; reals must be f64 strings (SPEC.md §Extras)")
    if isinstance(value, int) and not in_int_range(value):
        # the writer refuses these (``_encode_value``); a reader that let them through would hand
        # load_state_dict a number no saved state could hold (SPEC.md §Extras, §Limits)
        raise ManifestError(f"{what}: integer {value} is outside the 64-bit range -2^63 <= n < 2^64 (SPEC.md §Extras)")
    if isinstance(value, str):
        if is_real(value):
            return decode_real(value, what, ManifestError)
        if value.startswith(_TENSOR):
            i = len(seen)
            if value != f"{_TENSOR}{i}" or i >= len(tensors):
                raise ManifestError(
                    f"{what}: tensor reference {value!r} is not the next of {len(tensors)} ({_TENSOR}{i} expected)"
                )
            seen.append(i)
            return tensors[i]
        return value
    if isinstance(value, list):
        return [_decode_value(v, tensors, seen, what, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: _decode_value(value[k], tensors, seen, what, depth + 1) for k in sorted(value)}
    return value


def read_extra_state(raw: bytes | memoryview, tensors: list[torch.Tensor], what: str) -> dict[str, Any]:
    """Strictly decode a state document (bounded, canonical, every tensor referenced once, in order)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{what}: {len(raw)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit (SPEC.md §Limits)")
    raw = bytes(raw)
    # the encoder's depth counts containers below the top-level object: 64 levels are 65 brackets;
    # checked before msgspec or the walk below sees it, so deeper is refused, never a RecursionError
    check_json_nesting(raw, _MAX_DEPTH + 1, what)
    try:
        doc = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{what}: not a state document ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{what}: a state document is a JSON object")
    if _ENC.encode(doc) != raw:
        raise ManifestError(f"{what}: not in canonical encoding (SPEC.md §Canonical encoding)")
    seen: list[int] = []
    try:
        out = _decode_value(doc, tensors, seen, what)
    except RecursionError:
        raise ManifestError(f"{what}: nested too deeply") from None
    if len(seen) != len(tensors):
        raise ManifestError(f"{what}: references {len(seen)} of its {len(tensors)} tensors")
    return out


@dataclass
class ExtrasRestore:
    """A checked plan: reads into fresh tensors, then ``install`` calls each ``load_state_dict``."""

    reads: list[tuple[str, torch.Tensor, str]]
    pending: list[tuple[str, Any, bytes, list[torch.Tensor], str]]

    def install(self) -> list[str]:
        for key, obj, raw, tensors, what in self.pending:
            obj.load_state_dict(read_extra_state(raw, tensors, what))
        return [p[0] for p in self.pending]


def plan_extras_restore(
    store: Store, entries: Iterable[ExtraEntry], objects: Mapping[str, Any] | None, where: str
) -> ExtrasRestore:
    """Check that every requested extra is stored and decodes, and plan its tensor reads; raise before any write."""
    have = {x.key: x for x in entries}
    reads: list[tuple[str, torch.Tensor, str]] = []
    pending = []
    for key, obj in sorted((objects or {}).items()):
        x = have.get(key)
        if x is None:
            raise StateMismatch(f"{where} holds no extra {key!r} (extras: {sorted(have)}; SPEC.md §Extras)")
        obj = stateful(obj)
        if not callable(getattr(obj, "load_state_dict", None)):
            raise UnsupportedState(f"extra {key!r}: a {type(obj).__name__} has no load_state_dict()")
        what = f"state document {x.state} of extra {key!r} in {where}"
        raw = bytes(store.get(x.state, limit=MAX_MANIFEST_BYTES))  # re-hashed, bounded
        # a manifest's shapes: the objects' sizes bound the allocations (SPEC.md §Limits)
        check_stored_all(
            store,
            [(t.object, t.dtype, tuple(t.shape), f"tensor {t.key} of extra {key!r} in {where}") for t in x.tensors],
        )
        tensors = [torch.empty(tuple(t.shape), dtype=torch_dtype(t.dtype)) for t in x.tensors]
        decoded = read_extra_state(raw, tensors, what)  # decodes before anything is written (the tensors not yet read)
        if isinstance(obj, (GeneratorState, LoaderState)):  # the state fits this generator (``stateful``)
            obj.check(decoded)
        reads += [(t.object, dest, f"tensor {t.key} of extra {key!r}") for t, dest in zip(x.tensors, tensors)]
        pending.append((key, obj, raw, tensors, what))
    return ExtrasRestore(reads, pending)


def extras_rules(extras: tuple[ExtraEntry, ...]) -> Iterator[str]:
    """Structural rules of an extras list (messages of ``ManifestError``s)."""
    keys = [x.key for x in extras]
    if any(a >= b for a, b in zip(keys, keys[1:])):
        yield "extras are not sorted by key and unique (SPEC.md §Extras)"
    for x in extras:
        if [t.key for t in x.tensors] != [str(i) for i in range(len(x.tensors))]:
            yield f"extra {x.key!r}: tensor keys are not 0, 1, ... in order"
        for t in x.tensors:
            if is_chunked(t.object):
                yield f"extra {x.key!r}: tensor {t.key} has a chunked payload; an extra's tensor is one object (SPEC.md §Chunked payloads)"
