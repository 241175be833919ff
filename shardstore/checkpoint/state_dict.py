"""State dicts as frameworks hand them over (SPEC.md §9.6): ``save_state_dict``, ``read_state_dict``
(the ``torch.load`` of a commit) and ``load_state_dict_into`` (DCP's in-place load).

Lightning's ``CheckpointIO``, DCP-style trainers and hand-written loops hold their state as
one nested dict — model weights, optimizer ``state_dict()``s with integer keys, scheduler
states, loop counters, hyperparameters holding paths and dtypes. A commit of such a dict
holds each tensor as a tensor entry named by its key path (``optimizer_states/0/state/3/exp_avg``;
``documents.tree_name``), written, chunked, deduplicated, exchanged across ranks and verified
exactly as a model's parameters are, and the rest of the dict as its *tree*: a state document
in the commit-wide extra ``state_dict`` whose typed values come back as exactly what they
were, without pickle (``documents.encode_tree``). Such a commit verifies, logs, diffs (tensors
by entry name, every other value by key path) and is collected like any other::

    cid = shardstore.save_state_dict(store, checkpoint, step=checkpoint["global_step"])
    checkpoint = shardstore.read_state_dict(store, "main")         # fresh tensors, on the CPU
    shardstore.load_state_dict_into(store, model.state_dict())     # into existing tensors, in place
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..errors import StateMismatch, TensorMismatch
from ..format.grid import Box, check_stored_all, payload_blocks, read_parts, staging
from ..format.manifest import MAX_MANIFEST_BYTES, TREE_KEY, TensorEntry
from ..format.tensors import dtype_name, is_dtensor, torch_dtype
from ..sharded.read_exchange import grouped
from ..state.documents import TensorRef, encode_tree, fill_tree, read_tree, tensor_refs
from ..state.extras import CapturedExtra
from ..state.module import tensor_profile
from ..state.plan import ReadItem, RestorePlan
from ..state.slot import SlotState
from ..store import Store
from ..store.tensors import WRITE_THREADS
from ..verification.commits import LoadedCommit, load_commit
from .distributed import commit_state
from .info import CommitInfo
from .restore import read_plan
from .slots import AUTO, save_slots

__all__ = ["save_state_dict", "read_state_dict", "open_state_dict", "StoredStateDict", "load_state_dict_into"]


def save_state_dict(
    store: Store,
    state_dict: Mapping[Any, Any],
    *,
    step: int | None = None,
    ref: str | None = "main",
    job: str = "default",
    config: Mapping[Any, Any] | None = None,
    data_cursor: int | None = None,
    parent: str | None = AUTO,
    transition: str = "train",
    profile: str | None = None,
    group: Any = None,
    threads: int = WRITE_THREADS,
) -> str:
    """Commit a nested state dict and move ``ref``; return the commit id (SPEC.md §9.6).

    Tensors anywhere (plain or DTensor); dicts and OrderedDicts with string or integer keys,
    lists, tuples, None, bool, int, float, str, ``torch.Size``/``dtype``/``device`` and
    ``pathlib`` paths, each coming back as exactly its type and value; anything else is refused
    by its key path (``UnsupportedState``) before anything is written. ``step``: the global step
    to record (default 0: a state dict carries its own counters). ``group``: a process group
    every rank of which calls this with its own share (DTensors are written by the block
    exchange, plain tensors and every other value must be equal on all ranks); by default the
    save is collective over the default group exactly when the state dict holds a DTensor, and
    otherwise made by this process alone (as Lightning's rank 0 saves).
    """
    document, tensors = encode_tree(state_dict, "state dict")
    tree = CapturedExtra(TREE_KEY, document, [])
    if profile is None:
        profile = tensor_profile(dtype_name(t.dtype, n) for n, t in tensors.items())
    info = CommitInfo(
        step=0 if step is None else step,
        job=job,
        profile=profile,
        config=config,
        data_cursor=data_cursor,
        transition=transition,
    )
    if group is not None or any(is_dtensor(t) for t in tensors.values()):
        return commit_state(
            store,
            lambda: SlotState(dict(tensors)),
            info=info,
            group=group,
            ref=ref,
            parent=parent,
            threads=threads,
            extra={TREE_KEY: tree},
        )
    return save_slots(
        store, [SlotState(dict(tensors))], info=info, ref=ref, parent=parent, threads=threads, extra={TREE_KEY: tree}
    )


def _tree(store: Store, lc: LoadedCommit) -> Any:
    """The commit's tree, strictly decoded, its tensor references exactly the commit's entries."""
    x = next((x for x in lc.commit.extras if x.key == TREE_KEY), None)
    if x is None:
        raise StateMismatch(
            f"commit {lc.id} holds no state dict tree (it was not made by save_state_dict); restore it into a "
            "model and optimizer with shardstore.restore (SPEC.md §9.6)"
        )
    what = f"state dict tree {x.state} of commit {lc.id}"
    value = read_tree(store.get(x.state, limit=MAX_MANIFEST_BYTES), what)
    names, entries = tensor_refs(value), lc.entries()
    if sorted(names) != sorted(entries):
        raise StateMismatch(
            f"{what} names tensors {sorted(set(names) - set(entries))[:3]} the commit lacks, or the commit holds "
            f"tensors {sorted(set(entries) - set(names))[:3]} the tree does not name (SPEC.md §9.6)"
        )
    return value


class StoredStateDict:
    """A state dict commit opened once (``open_state_dict``): its id, its checked manifests and its
    tree, with each tensor a ``TensorRef`` (its entry name) until ``read`` reads them. ``tree`` is
    the caller's copy: ``read`` reads the commit's own, whatever was done to it.

    For a caller that decides what to read into from the tree (a framework's resume: which of the
    stored weights its module holds) and then reads: the commit and its shard manifests are read
    and checked, and the tree decoded, once for both (``read_state_dict(..., tensors=False)`` and
    then ``read_state_dict(..., into=...)`` would do each twice). Opening reads no tensor bytes.
    """

    def __init__(self, store: Store, target: str = "main") -> None:
        self.store = store
        self._lc = load_commit(store, target)
        self._tree = _tree(store, self._lc)  # what ``read`` fills: the commit's, never handed out
        self.tree: Any = fill_tree(self._tree, TensorRef)  # the caller's copy, to look at or change

    @property
    def commit(self) -> str:
        """The commit's id (what ``target`` resolved to when it was opened)."""
        return self._lc.id

    def read(
        self,
        *,
        map_location: str | torch.device | None = None,
        threads: int = 8,
        into: Mapping[Any, Any] | None = None,
    ) -> Any:
        """The state dict with its tensors read: ``read_state_dict``'s ``map_location``, ``threads`` and
        ``into``, on the commit as opened; each call returns containers of its own (``fill_tree``
        rebuilds them), so ``tree`` is left as it was, and what the caller did to ``tree`` (a copy)
        changes nothing read."""
        value = self._tree
        entries = self._lc.entries()
        dests: dict[str, torch.Tensor] = {}
        if into is not None and _holds_tensor(into):
            _match(into, value, "$", entries, dests, None, None)  # the caller's other values are not replaced
        fresh = _read_all(self.store, entries, dests, _reads(entries, dests), threads)
        if map_location is not None:
            fresh = {n: t.to(map_location) for n, t in fresh.items()}
        return fill_tree(value, {**fresh, **dests}.__getitem__)


def open_state_dict(store: Store, target: str = "main") -> StoredStateDict:
    """Open state dict commit ``target`` (``StoredStateDict``): its manifests read and checked and its
    tree decoded, no tensor bytes read. A commit not made by ``save_state_dict`` is refused
    (``StateMismatch``)."""
    return StoredStateDict(store, target)


def read_state_dict(
    store: Store,
    target: str = "main",
    *,
    map_location: str | torch.device | None = None,
    threads: int = 8,
    into: Mapping[Any, Any] | None = None,
    tensors: bool = True,
) -> Any:
    """The state dict commit ``target`` holds, with fresh tensors (the ``torch.load`` of a commit).

    Every object is verified as it is read; tensors come back on the CPU, or on
    ``map_location``. ``into``: tensors the caller already holds, placed as in the state dict
    (``{"model": model.state_dict()}``), matched as ``load_state_dict_into`` matches its dict
    (the stored tensor at each one's key path must exist with its dtype and shape; checked
    before any byte is written, as is that no two of them share memory unless they are one
    tensor under several key paths holding one stored tensor, read once, and that each has
    memory of its own for every element): each is filled in place and is the returned dict's tensor at
    its path, so a model's weights land in the model instead of in a fresh tensor copied over
    afterwards (``into``'s other values are not used; ``map_location`` moves only the fresh
    tensors). A ``TensorRef`` in ``into`` is no destination: that tensor is read fresh, so an
    opened ``tree`` with some of its references replaced by the caller's tensors (or none) is an
    ``into``; one where the commit holds another value is refused (``StateMismatch``, by key path).
    ``tensors=False``: nothing but the manifests and the tree is read (``into`` is
    not used), and each tensor stays a ``TensorRef`` (its entry name), for a caller deciding
    what to read into (``open_state_dict`` does that and then reads, opening the commit once).
    A corrupt object found part way (``CorruptObject``) leaves the caller's
    tensors read before it filled and the one it was read into holding unverified bytes: the
    load is to be repeated, those tensors never used.
    A commit not made by ``save_state_dict`` is refused (``StateMismatch``).
    """
    opened = open_state_dict(store, target)
    if not tensors:
        return opened.tree
    return opened.read(map_location=map_location, threads=threads, into=into)


def load_state_dict_into(
    store: Store, state_dict: MutableMapping[Any, Any], target: str = "main", *, threads: int = 8, group: Any = None
) -> str:
    """Load commit ``target`` into ``state_dict`` in place, as DCP's ``load`` does; return the commit id.

    The caller's dict says what to load: each of its tensors is filled from the stored tensor
    at the same key path (a DTensor: only its local share, from the blocks that overlaps),
    which must exist with its dtype and (global) shape; each of its other values is replaced
    by the stored value at that path, where the commit has one (an item of a tuple cannot be
    replaced: it must already be equal; a stored tensor is loaded into a tensor only, so a value of
    another kind where the commit holds tensors is refused). Stored values the dict has no place for
    are left out.
    A ``TensorRef`` (an opened tree's) has no memory to load into: refused by its key path.
    Everything is checked before the first byte is written (``StateMismatch`` /
    ``TensorMismatch``, naming the key path), the destinations as for ``read_state_dict``'s
    ``into``; a corrupt object found part way leaves what ``read_state_dict`` says it leaves.
    ``group``: a process group whose ranks load together, each its own dict (collective, as
    ``restore``'s ``group``): each block read once in the group (SPEC.md §16.2), and the commit's
    manifests too, ``target`` resolved by group rank 0 (§16.3).
    """
    failure: Exception | None = None
    plan = RestorePlan()
    sets: list[tuple[Any, Any, Any]] = []
    lc = None
    try:
        lc = load_commit(store, target, group=group)  # in a group: its manifests read once in it (SPEC.md §16.3)
        value = _tree(store, lc)
        entries = lc.entries()
        dests: dict[str, torch.Tensor] = {}
        _match(state_dict, value, "$", entries, dests, sets, None)
        plan = _reads(entries, dests)
    except Exception as e:  # noqa: BLE001 - in a group: still take part, so every rank raises, none waits
        if not grouped(group):
            raise
        failure = e
    read_plan(store, plan, threads, group=group, failure=failure)
    assert lc is not None  # read_plan raised the failure otherwise
    for container, key, v in sets:
        container[key] = v
    return lc.id


def _read_all(
    store: Store, entries: Mapping[str, TensorEntry], dests: Mapping[str, torch.Tensor], plan: RestorePlan, threads: int
) -> dict[str, torch.Tensor]:
    """Read every entry: into ``dests`` where it has one (``plan``: their reads, ``_reads``), else
    into a fresh tensor (returned). Each
    object's size is checked before its fresh tensor is allocated (a manifest's shapes never drive
    an allocation unchecked, SPEC.md §Limits) and all of them before any byte lands in one of the
    caller's tensors (§16); every block is verified as it lands.

    A store that answers many sizes at once (S3's listings) is asked once, then everything is
    read. Elsewhere each size is a query of its own (a stat), and a cold one waits on the disk:
    the checks run ahead in a pool of their own, and each fresh tensor is allocated and queued
    for reading once its own objects pass, so the reads start after the first check, not the last.
    """
    names = sorted(entries)
    checks = {n: (entries[n].param, entries[n].dtype, tuple(entries[n].shape), f"tensor {n!r}") for n in names}
    if store.lists_sizes() or threads <= 1:
        check_stored_all(store, list(checks.values()))
        fresh = {n: _empty(entries[n]) for n in names if n not in dests}
        read_plan(store, _reads(entries, fresh) + plan, threads, sizes_checked=True)  # sizes just checked
        return fresh
    fresh: dict[str, torch.Tensor] = {}
    late: dict[str, torch.Tensor] = {}  # fresh tensors read with the plan (``shared``)
    queued: list[Future[int]] = []
    stage = staging()
    # an object more than one block names (equal tensors or tiles: zeros, ones) is read once, by
    # read_plan's run_reads (once_per_object) after every check: a peer's copy is handed to one read
    # and let go (SPEC.md §19.3), so a second read of it, queued here on its own, went to the store
    objects = {n: [b[0] for b in payload_blocks(*checks[n][:3])] for n in names if n not in dests}
    named = Counter(oid for ids in objects.values() for oid in ids)
    named.update(b[0] for item in plan.reads for b in _blocks(item))
    shared = {oid for oid, k in named.items() if k > 1}
    with ThreadPoolExecutor(16) as checker, ThreadPoolExecutor(threads) as reader:
        try:
            checked: dict[Any, Future[None]] = {}  # (payload, dtype, shape): its check, asked once however many entries
            for n in names:
                key = checks[n][:3]
                if key not in checked:
                    checked[key] = checker.submit(check_stored_all, store, [checks[n]], threads=1)
            for n in names:  # in order: the first failure raised
                checked[checks[n][:3]].result()
                if n in dests:
                    continue
                # allocated on this thread, as read_plan's callers allocate (on the pool's threads it
                # measured twice the CPU time)
                e = entries[n]
                t = fresh[n] = _empty(e)
                if shared and any(oid in shared for oid in objects[n]):
                    late[n] = t
                    continue
                jobs = read_parts(store, e.param, e.dtype, e.shape, [(t, (0,) * t.ndim)], f"tensor {n!r}")
                queued += [reader.submit(job, stage) for job in jobs]
            # all checked: the caller's now, with the fresh tensors of objects named more than once
            read_plan(store, _reads(entries, late) + plan if late else plan, threads, sizes_checked=True)
            for f in queued:
                f.result()
        except BaseException:
            for f in [*queued, *checked.values()]:
                f.cancel()
            raise
    return fresh


def _blocks(item: ReadItem) -> list[tuple[str, Box, int]]:
    """``payload_blocks`` of a read item (its destination's dtype and global shape, as ``read_plan`` reads it)."""
    return payload_blocks(item.payload, dtype_name(item.dest.dtype, item.what), tuple(item.dest.shape))


def _empty(e: TensorEntry) -> torch.Tensor:
    return torch.empty(tuple(e.shape), dtype=torch_dtype(e.dtype))


def _reads(entries: Mapping[str, TensorEntry], dests: Mapping[str, torch.Tensor]) -> RestorePlan:
    """Each destination read from its tensor entry, nothing to install (the caller places them).
    A destination that is the very tensor of another one with the same payload (a tied weight
    under two key paths) is read once. Any other two whose memory overlaps are refused
    (``StateMismatch`` naming both, before any byte lands): the stored tensors differ, and the one
    read last would silently replace the other (read at once, the blocks of both would mix into
    bytes neither object holds), or they view one memory differently, which cannot be checked
    without reading (conservatively: byte ranges that overlap, however their strides interleave)."""
    spans = sorted(
        (str(t.device), t.data_ptr(), t.data_ptr() + _extent(t), n) for n, t in dests.items() if _alias(t) is not None
    )
    once: set[str] = set()  # read through another destination: the same view, the same payload
    reach: tuple[str, int, str] | None = None  # (device, end, name) of the span reaching furthest so far
    for device, lo, hi, n in spans:
        if reach is not None and reach[0] == device and lo < reach[1]:
            m = reach[2]
            if _alias(dests[m]) != _alias(dests[n]) or entries[m].param != entries[n].param:
                a, b = sorted((m, n))
                why = (
                    "the commit holds different tensors there, and one would overwrite the other"
                    if entries[m].param != entries[n].param
                    else "they view it differently"
                )
                raise StateMismatch(
                    f"tensors {a!r} and {b!r}: their destinations share memory, but {why}; nothing was written "
                    "(SPEC.md §9.6)"
                )
            once.add(n)
        if reach is None or reach[0] != device or hi > reach[1]:
            reach = (device, hi, n)
    return RestorePlan(
        tuple(ReadItem(entries[n].param, dests[n], f"tensor {n!r}") for n in sorted(dests) if n not in once)
    )


def _extent(t: torch.Tensor) -> int:
    """The bytes from a non-empty plain tensor's first element to the end of its last in memory."""
    return (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


def _unwritable(t: torch.Tensor) -> str | None:
    """Why the plain tensor ``t`` cannot be read into, or None: on the meta device it has no memory
    (a read would write nothing), and elements that share memory cannot hold distinct bytes
    (conservatively: each stride, smallest first, past the reach of the smaller ones)."""
    if t.device.type == "meta":
        return "is on the meta device, with no memory to read into"
    reach = 0
    for size, stride in sorted(((s, d) for s, d in zip(t.shape, t.stride()) if s > 1), key=lambda x: x[1]):
        if stride <= reach:
            return f"has elements that overlap in memory (shape {list(t.shape)}, strides {list(t.stride())})"
        reach += (size - 1) * stride
    return None


def _alias(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two plain tensors one destination (the same memory, viewed alike); None for a
    DTensor or an empty tensor (never merged)."""
    if is_dtensor(t) or t.numel() == 0:
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _holds_tensor(v: Any, depth: int = 0) -> bool:
    if isinstance(v, (torch.Tensor, TensorRef)):
        return True
    if depth > 128:
        return False
    items = v.values() if isinstance(v, Mapping) else v if isinstance(v, (list, tuple)) else ()
    return any(_holds_tensor(x, depth + 1) for x in items)


def _match(
    dst: Any,
    stored: Any,
    path: str,
    entries: Mapping[str, TensorEntry],
    dests: dict[str, torch.Tensor],
    sets: list[tuple[Any, Any, Any]] | None,
    place: tuple[Any, Any] | None,
) -> None:
    """Pair each of the caller's tensors with its stored tensor, and each of its other values
    with the stored value replacing it (at ``place``: its container and key); raise before any write.
    ``sets`` None: a read's ``into``, whose other values are not replaced and whose ``TensorRef``s
    (an opened tree's) are no destinations."""
    if not _holds_tensor(dst) and not (place is None and isinstance(dst, Mapping)):
        if place is not None:
            if sets is not None:
                if _holds_tensor(stored):  # a TensorRef: a name, no bytes; in place, a tensor loads into a tensor
                    raise StateMismatch(
                        f"state dict at {path}: a {type(dst).__name__}, where the commit holds tensors "
                        f"({', '.join(repr(n) for n in tensor_refs(stored)[:3])}); load_state_dict_into fills "
                        "tensors in place: put a tensor of the stored dtype and shape there, or read it fresh "
                        "with read_state_dict"
                    )
                sets.append((*place, stored))
        elif dst != stored:
            raise StateMismatch(f"state dict at {path}: an item of a tuple differs from the commit's ({stored!r})")
        return
    if isinstance(dst, TensorRef):
        if sets is not None:
            raise StateMismatch(
                f"state dict at {path}: a TensorRef ({dst.name!r}), with no memory to load into in place; "
                "put a tensor there, or read it fresh with read_state_dict"
            )
        if dst != stored:
            raise StateMismatch(f"state dict at {path}: a TensorRef ({dst.name!r}), where the commit holds {stored!r}")
        return  # no destination: read into a fresh tensor
    if isinstance(dst, torch.Tensor):
        if not isinstance(stored, TensorRef):
            raise StateMismatch(f"state dict at {path}: a tensor, where the commit holds a {type(stored).__name__}")
        e = entries[stored.name]
        if dtype_name(dst.dtype, path) != e.dtype or tuple(dst.shape) != tuple(e.shape):
            raise TensorMismatch(
                f"state dict at {path}: the commit holds {e.dtype}{list(e.shape)}, the destination is "
                f"{dtype_name(dst.dtype, path)}{list(dst.shape)}"
            )
        problem = None if is_dtensor(dst) else _unwritable(dst)
        if problem is not None:
            raise TensorMismatch(f"state dict at {path}: the destination {problem}; nothing was written")
        dests[stored.name] = dst
        return
    if isinstance(dst, Mapping):
        if not isinstance(stored, dict):
            raise StateMismatch(f"state dict at {path}: a dict, where the commit holds a {type(stored).__name__}")
        for k, v in dst.items():
            where = f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]"
            if k in stored:
                _match(v, stored[k], where, entries, dests, sets, (dst, k) if isinstance(dst, MutableMapping) else None)
            elif _holds_tensor(v):
                raise StateMismatch(
                    f"commit holds no value at {where}, where the state dict has tensors (SPEC.md §9.6)"
                )
        return
    if not isinstance(stored, (list, tuple)) or len(stored) != len(dst):
        raise StateMismatch(
            f"state dict at {path}: a {type(dst).__name__} of {len(dst)}, where the commit holds a "
            f"{type(stored).__name__}" + (f" of {len(stored)}" if isinstance(stored, (list, tuple)) else "")
        )
    for i, (v, w) in enumerate(zip(dst, stored)):
        _match(v, w, f"{path}[{i}]", entries, dests, sets, (dst, i) if isinstance(dst, list) else None)
