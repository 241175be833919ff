"""Copying a commit's closure from one store to another (SPEC.md §Write ordering).

A commit's *closure* is everything a reader needs to restore it: the commit manifest,
all its shard manifests, the model config object, the commit-wide extras' objects, and the
tensor (parameters and buffers), optimizer state and RNG objects and own extras of every slot (or, with ``slot=K``, of slot K only: what a replacement host needs
to restore that one slot; of a tensor slot K held a slice of, only the blocks that slice
overlaps, ``slices.slot_needs``). The parent commit is a pointer, not part of the closure.

``copy_commit`` sends only objects the destination lacks, and verifies every byte on
arrival: what was received is hashed, and written under its id only if it hashes to it
(and, for tensor payloads, has the byte size its entry needs). Writes follow the store's
ordering, so an interrupted copy never leaves a ref (or a manifest) naming data the
destination does not hold: data objects, a durability barrier, shard manifests, a
barrier, the commit manifest, a barrier, and only then, optionally, a ref moved by
compare-and-swap. Objects move concurrently on a bounded thread pool (the S3 backend
bounds its own requests further).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from ..errors import CorruptObject, RefConflict, TargetNotFound, TensorMismatch
from ..format.closure import Closure, commit_closure
from ..format.names import check_ref_name
from ..store import Store, object_key
from ..verification.commits import LoadedCommit, load_commit

__all__ = ["DEFAULT_THREADS", "Closure", "CopyResult", "commit_closure", "copy_commit", "pool_map"]

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_THREADS = 16


@dataclass
class CopyResult:
    """What ``copy_commit`` did: the commit, and objects (and bytes) sent or already present."""

    commit: str
    slot: int | None
    objects_copied: int = 0
    bytes_copied: int = 0
    objects_skipped: int = 0
    bytes_skipped: int = 0
    ref: str | None = None
    pins: list[str] = field(default_factory=list)
    dependencies: list[str] = field(default_factory=list)  # commits copied whole first (``with_deps``)

    def _add(self, copied: bool, n: int) -> None:
        if copied:
            self.objects_copied += 1
            self.bytes_copied += n
        else:
            self.objects_skipped += 1
            self.bytes_skipped += n


def pool_map(fn: Callable[[T], R], items: Iterable[T], threads: int) -> list[R]:
    """``fn`` of each item, in order, ``threads`` at a time (copy's and gc's object work, a
    request each on S3); the first failure is raised once the calls already running end, and
    no further call starts."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    pool = ThreadPoolExecutor(max_workers=threads)
    try:
        return list(pool.map(fn, items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on the first failure, start nothing new


#: Bytes of objects held in memory at once by a copy's threads (beyond one object larger than this).
_IN_FLIGHT_BYTES = 1 << 30


class _ByteBudget:
    """Admits readers while the bytes they hold stay under a limit (one larger reader alone):
    copy reads each object whole into memory of its own, so threads × object size would
    otherwise be the peak."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.used > 0 and self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


def _copy_object(
    src: Store, dst: Store, oid: str, size: int | None, what: str, budget: _ByteBudget | None = None
) -> tuple[bool, int]:
    """Copy one object unless ``dst`` has it whole; verify the bytes received before writing them.

    An object already at ``dst`` is refreshed (``Store.ensure``: gc then treats it as just
    written) and its size checked against its entry (or, where the format fixes none, against
    the source's): a torn or truncated object there is replaced by the verified source bytes
    instead of being trusted (SPEC.md §19.1)."""
    have = dst.ensure(oid)
    if have is not None:
        want = size if size is not None else src.object_size(oid)
        if want is None or have == want:
            return False, have
    need = size or 0  # objects whose size the format fixes; the others are manifest-sized or pinned files
    if budget is not None:
        budget.acquire(need)
    try:
        return _fetch_and_put(src, dst, oid, size, what, have)
    finally:
        if budget is not None:
            budget.release(need)


def _fetch_and_put(src: Store, dst: Store, oid: str, size: int | None, what: str, have: int | None) -> tuple[bool, int]:
    data, got = src.read_hashed(oid)  # hashed as it arrives where the backend streams
    if got != oid:
        raise CorruptObject(
            f"{what} object {oid} read from {src.url} is corrupt: its {len(data)} bytes hash to {got}; "
            f"nothing was written to {dst.url} (SPEC.md §Objects)"
        )
    if size is not None and len(data) != size:
        raise TensorMismatch(f"{what} object {oid} in {src.url} holds {len(data)} bytes, its entry needs {size}")
    if have is not None:  # present with the wrong size: it cannot hash to its id; replace it
        dst.storage.delete(object_key(oid))
    if not dst.put_with_id(oid, data) and dst.object_size(oid) != len(data):
        raise CorruptObject(
            f"{what} object {oid} in {dst.url} has the wrong size and could not be replaced (SPEC.md §19.1)"
        )
    return True, len(data)


def _move_ref(dst: Store, ref: str, cid: str, needs: set[str], attempts: int = 40) -> None:
    """Move ``ref`` to ``cid`` by compare-and-swap against the value read just before.

    Losing to an identical copy (the ref now holds ``cid``) is success; losing to another
    writer's lock while the value is unchanged is retried; a ref moved elsewhere meanwhile
    is a RefConflict, as for any compare-and-swap."""
    current = dst.ref(ref)
    for attempt in range(attempts):
        if current == cid:
            return
        try:
            dst.set_ref(ref, cid, expected=current, needs=needs)  # a slot copy needs its slot's closure only
            return
        except RefConflict:
            now = dst.ref(ref)
            if now == cid:
                return  # an identical copy won the race: the ref holds exactly what this one wanted
            if now != current or attempt == attempts - 1:
                raise
            time.sleep(0.005 * (attempt + 1))  # the same value under another writer's lock: wait for it


def check_copy(
    src: Store, target: str, *, slot: int | None = None, ref: str | None = None, pins: Sequence[str] = ()
) -> tuple[LoadedCommit, dict[str, tuple[str, ...]]]:
    """What ``copy_commit`` checks at the source before it touches the destination: the
    target commit, its slot ``slot``, the ref name and every pin; (the commit, the pins' ids).
    The command line runs it before it creates a destination store."""
    if ref is not None:
        check_ref_name(ref)
    lc = load_commit(src, target)
    if slot is not None and slot not in lc.shards:
        raise TargetNotFound(f"commit {lc.id} in {src.url} has slots 0..{len(lc.shards) - 1}; it has no slot {slot}")
    pinned: dict[str, tuple[str, ...]] = {}
    for name in pins:
        ids = src.pinned(name)
        if ids is None:
            raise TargetNotFound(f"no pin {name!r} in {src.url}")
        pinned[name] = ids
    return lc, pinned


def copy_commit(
    src: Store,
    dst: Store,
    target: str,
    *,
    slot: int | None = None,
    ref: str | None = None,
    pins: Sequence[str] = (),
    threads: int = DEFAULT_THREADS,
    progress: Callable[[int], None] | None = None,
    with_deps: bool = False,
) -> CopyResult:
    """Copy commit ``target`` (ref, id or id prefix in ``src``) and its closure to ``dst``.

    ``slot``: copy only that slot's data objects (all manifests are still copied).
    ``ref``: afterwards, move that ref in ``dst`` to the commit (compare-and-swap against
    the value read just before). ``pins``: also copy these pins of ``src`` and the objects
    they name (e.g. shardtrain's ``jobs/<job id>``); each is set in ``dst``, last, to the
    union of what it held there and in ``src``. ``progress`` is called with the byte size
    of each object as it is copied or found present. ``with_deps``: also the commits the
    commit's job depends on (SPEC.md §14.1): the pins ``jobs/<job>`` and ``references/<job>``
    of its job, where ``src`` has them, and the whole closure of every other commit the
    references pin names (a run's seed and frozen distillation references), copied first.
    """
    lc, pinned = check_copy(src, target, slot=slot, ref=ref, pins=pins)
    deps: list[str] = []
    if with_deps:  # the job's pins, and the commits its references pin names
        named = [f"{kind}/{lc.commit.job}" for kind in ("jobs", "references")]
        for n in named:
            ids = src.pinned(n) if n not in pinned else None
            if ids is not None:
                pinned[n] = ids
        deps = [c for c in src.pinned(named[1]) or () if c != lc.id]
    closure = commit_closure(lc, slot)
    result = CopyResult(lc.id, slot)
    for dep in deps:  # each lands whole (and durable) before the commit that needs it
        done = copy_commit(src, dst, dep, threads=threads, progress=progress)
        result.objects_copied, result.bytes_copied = (
            result.objects_copied + done.objects_copied,
            result.bytes_copied + done.bytes_copied,
        )
        result.objects_skipped, result.bytes_skipped = (
            result.objects_skipped + done.objects_skipped,
            result.bytes_skipped + done.bytes_skipped,
        )
        result.dependencies.append(dep)

    budget = _ByteBudget(_IN_FLIGHT_BYTES)

    def batch(jobs: list[tuple[str, int | None, str]]) -> None:
        def one(job: tuple[str, int | None, str]) -> tuple[bool, int]:
            done = _copy_object(src, dst, *job, budget=budget)
            if progress is not None:
                progress(done[1])
            return done

        for copied, n in pool_map(one, jobs, threads):
            result._add(copied, n)
        dst.sync()  # everything in this batch is durable before the next batch names it

    extra = sorted({oid for ids in pinned.values() for oid in ids} - set(closure.data))
    batch(
        [(oid, size, closure.labels.get(oid, "data")) for oid, size in sorted(closure.data.items())]
        + [(oid, None, "pinned") for oid in extra]
    )
    batch([(sid, None, "shard manifest") for sid in closure.shards])
    batch([(closure.commit, None, "commit manifest")])
    load_commit(dst, lc.id)  # the destination now holds a structurally valid commit
    if ref is not None:
        _move_ref(dst, ref, lc.id, closure.ids())
        result.ref = ref
    for name, ids in pinned.items():  # the objects are durable at the destination: name them
        dst.add_to_pin(name, ids)  # compare-and-swap: a concurrent writer's objects are kept
        result.pins.append(name)
    return result
