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
path (``extra 'scheduler' at $.lr_lambdas[0]``), before anything is written. The document's
encoder and decoder are ``documents`` (``encode_state`` / ``read_state``), which also writes
the tree of a state dict: the commit-wide extra ``state_dict`` is reserved for that (SPEC.md §9.6).

The state is taken (``state_dict()`` called and encoded) when ``capture_extras`` runs, so a
background save (``AsyncSaver``) stores the state as it was when ``save`` was called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import StateMismatch, UnsupportedState
from ..format.grid import check_stored_all
from ..format.lazy import torch
from ..format.manifest import MAX_MANIFEST_BYTES, TREE_KEY, ExtraEntry, StateTensor, extra_objects, is_chunked
from ..format.names import check_group_name
from ..format.tensors import dtype_name, torch_dtype
from ..store.tensors import WRITE_THREADS
from .documents import encode_state, read_state
from .plan import ReadItem, RestorePlan
from .stateful import GeneratorState, LoaderState, PreparedLoaderState, stateful

if TYPE_CHECKING:
    from ..store import Store

__all__ = [
    "CapturedExtra",
    "capture_extras",
    "write_extras",
    "extra_objects",
    "read_extra_state",
    "plan_extras_restore",
    "extras_rules",
]


@dataclass
class CapturedExtra:
    """One extra's state, taken: its canonical document and the tensors it references (by index)."""

    key: str
    document: bytes
    tensors: list[torch.Tensor]


def capture_extras(extra: Mapping[str, Any] | None) -> dict[str, CapturedExtra]:
    """Take every extra's state now (``state_dict()``, encoded); tensors are referenced, not copied."""
    out: dict[str, CapturedExtra] = {}
    for key, obj in sorted((extra or {}).items()):
        check_group_name(key)
        if isinstance(obj, CapturedExtra):
            out[key] = obj
            continue
        if key == TREE_KEY:
            raise UnsupportedState(
                f"extra key {TREE_KEY!r} is reserved for the tree of a state dict (save_state_dict; SPEC.md §9.6)"
            )
        obj = stateful(obj)  # a torch.Generator or DataLoader: its generators' states (``stateful``)
        fn = getattr(obj, "state_dict", None)
        if not callable(fn):
            raise UnsupportedState(f"extra {key!r}: a {type(obj).__name__} has no state_dict() (SPEC.md §Extras)")
        try:
            state = fn()
        except UnsupportedState as e:  # an adapter that cannot take the object whole (``stateful``)
            raise UnsupportedState(f"extra {key!r}: {e}") from None
        if not isinstance(state, Mapping):
            raise UnsupportedState(f"extra {key!r}: state_dict() returned a {type(state).__name__}, not a dict")
        document, tensors = encode_state(state, f"extra {key!r}")
        out[key] = CapturedExtra(key, document, tensors)
    return out


def write_extras(
    store: Store, captured: Mapping[str, CapturedExtra], *, threads: int = WRITE_THREADS
) -> tuple[ExtraEntry, ...]:
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


def read_extra_state(raw: bytes | memoryview, tensors: list[torch.Tensor], what: str) -> dict[str, Any]:
    """Strictly decode a state document (bounded, canonical, every tensor referenced once, in order)."""
    return read_state(raw, tensors, what)


def plan_extras_restore(
    store: Store, entries: Iterable[ExtraEntry], objects: Mapping[str, Any] | None, where: str
) -> RestorePlan:
    """Plan loading each of ``objects`` (key -> an object with ``load_state_dict()``) from the
    extra of its key: check that it is stored and its document decodes, and allocate the tensors
    it reads into; raise before any write. The installs call each ``load_state_dict`` in key order."""
    have = {x.key: x for x in entries}
    reads: list[ReadItem] = []
    installs: list[Callable[[], None]] = []
    for key, obj in sorted((objects or {}).items()):
        x = have.get(key)
        if key == TREE_KEY:
            raise UnsupportedState(
                f"extra {key!r} is the tree of a state dict: read it with read_state_dict (SPEC.md §9.6)"
            )
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
        if isinstance(obj, (GeneratorState, LoaderState, PreparedLoaderState)):  # the state fits (``stateful``)
            obj.check(decoded)
        reads += [ReadItem(t.object, dest, f"tensor {t.key} of extra {key!r}") for t, dest in zip(x.tensors, tensors)]
        installs.append(partial(_load, obj, raw, tensors, what))
    return RestorePlan(tuple(reads), tuple(installs))


def _load(obj: Any, raw: bytes, tensors: list[torch.Tensor], what: str) -> None:
    """An extra's install: its document decoded again around the tensors now read, then loaded."""
    obj.load_state_dict(read_extra_state(raw, tensors, what))


def extras_rules(extras: tuple[ExtraEntry, ...]) -> Iterator[str]:
    """Structural rules of an extras list (messages of ``ManifestError``s)."""
    keys = [x.key for x in extras]
    if any(a >= b for a, b in zip(keys, keys[1:])):
        yield "extras are not sorted by key and unique (SPEC.md §Extras)"
    for x in extras:
        if x.key == TREE_KEY and x.tensors:
            yield f"extra {x.key!r} is a state dict's tree, whose tensors are tensor entries; it lists {len(x.tensors)} of its own (SPEC.md §9.6)"
        if [t.key for t in x.tensors] != [str(i) for i in range(len(x.tensors))]:
            yield f"extra {x.key!r}: tensor keys are not 0, 1, ... in order"
        for t in x.tensors:
            if is_chunked(t.object):
                yield f"extra {x.key!r}: tensor {t.key} has a chunked payload; an extra's tensor is one object (SPEC.md §Chunked payloads)"
