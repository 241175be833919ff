"""Checking the objects a commit references (SPEC.md §17): each one present, of the size its
entry implies, hashing to its id (deep), and its content decoding as its load path would
decode it (model config, RNG states, extras' state documents).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import (
    CorruptObject,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    ShardstoreError,
)
from ..format.manifest import MAX_MANIFEST_BYTES, TREE_KEY, decode_config
from ..format.rng import MAX_RNG_BYTES, check_rng
from ..format.slices import entry_objects, slot_needs
from ..state.documents import read_tree, tensor_refs
from ..state.extras import extra_objects, read_extra_state
from ..store import Store
from .commits import LoadedCommit

__all__ = [
    "ExpectedObject",
    "Checked",
    "ContentRule",
    "ModelConfigContent",
    "RngContent",
    "StateDocumentContent",
    "TreeContent",
    "expected_objects",
    "check_objects",
    "content_problem",
    "tree_problem",
]


@dataclass(frozen=True)
class ModelConfigContent:
    """Decode the object as a model config (SPEC.md §7)."""


@dataclass(frozen=True)
class RngContent:
    """Decode the object as the RNG state of generator ``kind`` (SPEC.md §10)."""

    kind: str


@dataclass(frozen=True)
class StateDocumentContent:
    """Decode the object as an extra's state document holding ``tensors`` placeholders (SPEC.md §Extras)."""

    tensors: int


@dataclass(frozen=True)
class TreeContent:
    """Decode the object as a state dict's tree (the commit-wide extra ``state_dict``, SPEC.md §9.5)."""


#: How verify decodes an object's content, as its load path would.
ContentRule = ModelConfigContent | RngContent | StateDocumentContent | TreeContent


class ExpectedObject(NamedTuple):
    """One object a commit references, and what its entry expects of it."""

    oid: str
    size: int | None  # the byte size its entry implies (None: not implied by an entry)
    tensor: str | None  # the tensor entry naming it, for messages
    what: str
    rule: ContentRule | None  # how its content is decoded (None: bytes only, a tensor payload)


def _extra_objects(extras: Any, where: str) -> Iterator[ExpectedObject]:
    trees = {x.state for x in extras if x.key == TREE_KEY} if not where else set()  # commit-wide only
    for oid, size, what, placeholders in extra_objects(extras, where):
        rule: ContentRule | None = None
        if placeholders is not None:
            rule = TreeContent() if oid in trees else StateDocumentContent(placeholders)
        yield ExpectedObject(oid, size, None, what, rule)


def expected_objects(lc: LoadedCommit, slot: int | None) -> Iterator[ExpectedObject]:
    """One `ExpectedObject` for every object the commit references (an object named twice: two)."""
    if lc.commit.config is not None:
        yield ExpectedObject(lc.commit.config, None, None, "model config", ModelConfigContent())
    yield from _extra_objects(lc.commit.extras, "")
    needs = slot_needs(lc.shards, slot) if slot is not None else None  # the slot-K selection (SPEC.md §Slices held)
    for s, shard in sorted(lc.shards.items()):
        if slot is None or s == slot:
            for r in shard.rng:
                yield ExpectedObject(r.object, None, None, f"RNG state {r.kind} of slot {s}", RngContent(r.kind))
            yield from _extra_objects(shard.extras, f" of slot {s}")
        for e in shard.entries:
            if needs is not None and e.name not in needs:
                continue
            for oid, n, what in entry_objects(e, needs[e.name] if needs is not None else None):
                yield ExpectedObject(oid, n, e.name, what, None)


class Checked(NamedTuple):
    """What checking one object found."""

    error: ShardstoreError | None
    size: int | None  # its actual size (None: missing or unreadable)
    hashed: int  # bytes hashed


def check_objects(store: Store, expected: list[ExpectedObject], deep: bool, threads: int) -> list[Checked]:
    """``_check_object`` for each expected object, in their order, ``threads`` objects at a time.

    The largest objects start first, so that the pool does not end on one big object while
    the other threads idle. Each object is hashed by one thread, unless there are fewer
    objects than threads: then each gets its share of BLAKE3's own threads.
    """
    threads = max(1, threads)
    each = max(1, threads // len(expected)) if expected else 1
    order = sorted(range(len(expected)), key=lambda i: -(expected[i].size or 0))
    results: list[Checked] = [Checked(None, None, 0)] * len(expected)

    def one(i: int) -> None:
        results[i] = _check_object(store, expected[i].oid, deep, each)

    if threads == 1 or len(expected) <= 1:
        for i in order:
            one(i)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(one, order))
    return results


def _check_object(store: Store, oid: str, deep: bool, threads: int = 1) -> Checked:
    """Presence and (deep) hash of one object, and its actual size; the size rules of the
    entries naming it are checked by the caller, every entry against the same object."""
    try:
        if deep:
            got, n = store.hash_object(oid, threads=threads)  # streamed, never a full copy
            if got != oid:
                return Checked(CorruptObject(f"its {n} bytes hash to {got}"), n, n)
            return Checked(None, n, n)
        have = store.object_size(oid)
        if have is None:
            return Checked(ObjectNotFound("missing from the store"), None, 0)
        return Checked(None, have, 0)
    except ObjectNotFound:
        return Checked(ObjectNotFound("missing from the store"), None, 0)
    except ShardstoreError as e:
        return Checked(e, None, 0)


def content_problem(store: Store, oid: str, rule: ContentRule, have: int | None) -> ShardstoreError | None:
    """Decode a model config, RNG state or state document as its load path will (bounded
    first): what a restore would refuse, verify reports (SPEC.md §17)."""
    limit = MAX_RNG_BYTES if isinstance(rule, RngContent) else MAX_MANIFEST_BYTES
    if have is not None and have > limit:
        return ObjectTooLarge(f"{have} bytes, over the {limit}-byte limit of its kind (SPEC.md §Limits)")
    try:
        if isinstance(rule, ModelConfigContent):
            decode_config(store.get(oid, limit=limit), what="model config")
        elif isinstance(rule, TreeContent):  # a state dict's tree (SPEC.md §9.5)
            read_tree(store.get(oid, limit=limit), "state dict tree")
        elif isinstance(rule, StateDocumentContent):  # with placeholders for its tensors
            read_extra_state(store.get(oid, limit=limit), [None] * rule.tensors, "state document")  # type: ignore[list-item]
        else:
            check_rng({rule.kind: store.get(oid, limit=limit)}, raw_kinds=False)
    except ShardstoreError as e:
        return e
    return None


def tree_problem(store: Store, lc: LoadedCommit) -> ShardstoreError | None:
    """A state dict's tree must reference exactly the commit's tensor entries (SPEC.md §9.6);
    None when it does, or when the commit has no tree or its document is itself unreadable
    (``content_problem`` reports that)."""
    tree = next((x for x in lc.commit.extras if x.key == TREE_KEY), None)
    if tree is None:
        return None
    try:
        names = tensor_refs(read_tree(store.get(tree.state, limit=MAX_MANIFEST_BYTES), "state dict tree"))
    except ShardstoreError:
        return None
    entries = set(lc.entries())
    if sorted(names) != sorted(entries):
        stray = sorted(set(names) - entries)[:3]
        unnamed = sorted(entries - set(names))[:3]
        return ManifestError(
            f"its state dict tree {tree.state} and its tensor entries disagree: the tree names {stray} that are not "
            f"entries, and entries {unnamed} are not in the tree (SPEC.md §9.6)"
        )
    return None
