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
bounds its own requests further). Each request to S3 is a round trip, so a copy asks S3 for
the presence of a whole batch in one set of listings (an object it lacks costs its write
alone), writes the manifests it already read and hashed without reading them again, and reads
the commit back together with the ref it then moves; into a local store, a batch's objects are
written without an fsync each and made durable together at the batch's barrier. From S3 into a
local store, each object goes into its temporary file piece by piece as the response streams
in, hashed on the way (``Store.receive``), rather than joined into one buffer first: a piece is
hashed and written while it is still in the core's cache, and the object is linked under its
id at the barrier only if it hashed to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from ..errors import CorruptObject, InvalidName, RefConflict, StateMismatch, TargetNotFound, TensorMismatch
from ..format.closure import Closure, commit_closure
from ..format.manifest import encode
from ..format.names import check_ref_name
from ..format.tensors import hash_bytes
from ..store import Store, object_key
from ..store.tensors import WriteBatch
from ..verification.commits import LoadedCommit, load_commit, pinned_commits, read_commit

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


#: Files a copy's batch fsyncs at once at its durability barrier.
_FSYNC_THREADS = 8

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
    src: Store,
    dst: Store,
    oid: str,
    size: int | None,
    what: str,
    budget: _ByteBudget | None = None,
    absent: bool = False,
    batch: WriteBatch | None = None,
    known: bytes | None = None,
    listed: int | None = None,
) -> tuple[bool, int]:
    """Copy one object unless ``dst`` has it whole; verify the bytes received before writing them.

    An object already at ``dst`` is refreshed (``Store.ensure``: gc then treats it as just
    written) and its size checked against its entry (or, where the format fixes none, against
    the source's): a torn or truncated object there is replaced by the verified source bytes
    instead of being trusted (SPEC.md §19.1). ``absent``: a listing of ``dst`` just found no
    such object, so it is written without looking first (a create-only write: one that
    appeared meanwhile is found by the write itself, and refreshed there). ``batch``: written
    into it (``Store.put_with_id``), durable and visible when the caller finishes it. ``known``:
    the object's bytes, already read from ``src`` and hashed to ``oid`` (a manifest the check
    before the copy decoded), written as they are instead of being read again. ``listed``: the
    size a listing of ``dst`` just found it with (refreshed without asking again)."""
    have = None if absent else dst.ensure(oid, listed=listed)
    if have is not None:
        want = size if size is not None else src.object_size(oid)
        if want is None or have == want:
            return False, have
    need = size or 0  # objects whose size the format fixes; the others are manifest-sized or pinned files
    if budget is not None:
        budget.acquire(need)
    try:
        return _fetch_and_put(src, dst, oid, size, what, have, batch, known)
    finally:
        if budget is not None:
            budget.release(need)


def _fetch_and_put(
    src: Store,
    dst: Store,
    oid: str,
    size: int | None,
    what: str,
    have: int | None,
    batch: WriteBatch | None = None,
    known: bytes | None = None,
) -> tuple[bool, int]:
    if known is None and have is None and batch is not None:
        piped = dst.receive(src, oid, batch=batch, size=size)  # None: no piped path here, or present now
        if piped is not None:
            got, n = piped
            if got != oid:
                raise CorruptObject(
                    f"{what} object {oid} read from {src.url} is corrupt: its {n} bytes hash to {got}; "
                    f"nothing was written to {dst.url} (SPEC.md §Objects)"
                )
            if size is not None and n != size:
                raise TensorMismatch(f"{what} object {oid} in {src.url} holds {n} bytes, its entry needs {size}")
            return True, n
    data, got = (known, oid) if known is not None else src.read_hashed(oid)  # hashed as it arrives when streamed
    if got != oid:
        raise CorruptObject(
            f"{what} object {oid} read from {src.url} is corrupt: its {len(data)} bytes hash to {got}; "
            f"nothing was written to {dst.url} (SPEC.md §Objects)"
        )
    if size is not None and len(data) != size:
        raise TensorMismatch(f"{what} object {oid} in {src.url} holds {len(data)} bytes, its entry needs {size}")
    if have is not None:  # present with the wrong size: it cannot hash to its id; replace it
        dst.storage.delete(object_key(oid))
    wrote = dst.put_with_id(oid, data, batch=batch)
    if not wrote and dst.object_size(oid) != len(data):
        raise CorruptObject(
            f"{what} object {oid} in {dst.url} has the wrong size and could not be replaced (SPEC.md §19.1)"
        )
    return wrote, len(data)  # not written: the create-only write found it there whole (counted as skipped)


def _manifest_bytes(lc: LoadedCommit) -> dict[str, bytes]:
    """The commit's manifests as the check before the copy read them, by id: their canonical
    encoding, kept only where it hashes to the id (the very bytes that were read and hashed;
    a manifest whose encoding this version would write differently is read again instead)."""
    out: dict[str, bytes] = {}
    for oid, manifest in [(lc.id, lc.commit), *((lc.shard_ids[s], lc.shards[s]) for s in lc.shards)]:
        raw = encode(manifest)
        if hash_bytes(raw) == oid:
            out[oid] = raw
    return out


def _move_ref(dst: Store, ref: str, cid: str, needs: set[str], current: str | None, attempts: int = 40) -> None:
    """Move ``ref`` to ``cid`` by compare-and-swap against ``current``, its value read just before.

    Losing to an identical copy (the ref now holds ``cid``) is success; losing to another
    writer's lock while the value is unchanged is retried; a ref moved elsewhere meanwhile
    is a RefConflict, as for any compare-and-swap."""
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


def _pin_name(name: str) -> bool:
    """Whether ``name`` is a valid pin name: a job id may hold ``:`` and 128 characters, a
    pin's segment neither (SPEC.md §6), so such a job has no ``jobs/<job>`` pin."""
    try:
        check_ref_name(name)
    except InvalidName:
        return False
    return True


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
    if slot is not None and pinned:
        _check_slot_pins(src, lc, slot, pinned_commits(src, pinned))
    return lc, pinned


def _check_slot_pins(src: Store, lc: LoadedCommit, slot: int, held: dict[str, list[str]]) -> None:
    """A pin naming the commit keeps its whole closure (SPEC.md §14.1), which a copy of one slot
    does not bring: the pin's presence check at the destination would refuse after the copy.
    StateMismatch before anything is written."""
    if lc.id in held:
        raise StateMismatch(
            f"pin(s) {', '.join(map(repr, held[lc.id]))} in {src.url} name commit {lc.id}, and a pinned commit "
            f"keeps its whole closure (SPEC.md §14.1), which a copy of slot {slot} does not bring: copy the "
            "whole commit, or leave those pins out; nothing was written"
        )


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
    union of what it held there and in ``src``; a commit a pin names is copied whole first, as
    with ``with_deps`` (a pin keeps a commit's closure, SPEC.md §14.1). ``progress`` is called with the byte size
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
            ids = src.pinned(n) if n not in pinned and _pin_name(n) else None  # a job id no pin can name has none
            if ids is not None:
                pinned[n] = ids
        deps = [c for c in pinned.get(named[1], ()) if c != lc.id]
    # A pinned commit keeps its whole closure (SPEC.md §14.1), and the pin's presence check at
    # the destination asks for it: each one a copied pin names lands whole first, as a dependency.
    held = pinned_commits(src, pinned)
    if slot is not None:
        _check_slot_pins(src, lc, slot, held)  # again: with_deps may have added pins
    deps += [c for c in held if c != lc.id and c not in deps]
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
    decoded = _manifest_bytes(lc)
    lists = dst.lists_sizes()

    def batch(jobs: list[tuple[str, int | None, str]], *, manifests: bool = False) -> None:
        # Where the destination answers for many objects at once (S3: listings), ask once for the
        # whole batch, so that an object it lacks costs its write alone, not a HEAD first; a lone
        # manifest (new in nearly every copy, a few KiB) is written without looking at all.
        present = dst.object_sizes(oid for oid, _, _ in jobs) if lists and len(jobs) > 1 else None
        blind = lists and manifests and len(jobs) == 1

        # Locally the objects are written without waiting for the disk each, then made durable together.
        wb = dst.write_batch()

        def one(job: tuple[str, int | None, str]) -> tuple[bool, int]:
            absent = blind or (present is not None and job[0] not in present)
            listed = None if present is None else present.get(job[0])
            done = _copy_object(
                src, dst, *job, budget=budget, absent=absent, batch=wb, known=decoded.get(job[0]), listed=listed
            )
            if progress is not None:
                progress(done[1])
            return done

        try:
            done = pool_map(one, jobs, threads)
            wb.finish(dst.storage, threads=min(threads, _FSYNC_THREADS))
        except BaseException:
            wb.abandon(dst.storage)
            raise
        for copied, n in done:
            result._add(copied, n)
        dst.sync()  # everything in this batch is durable before the next batch names it

    extra = sorted({oid for ids in pinned.values() for oid in ids} - set(closure.data))
    batch(
        [(oid, size, closure.labels.get(oid, "data")) for oid, size in sorted(closure.data.items())]
        + [(oid, None, "pinned") for oid in extra]
    )
    batch([(sid, None, "shard manifest") for sid in closure.shards], manifests=True)
    batch([(closure.commit, None, "commit manifest")], manifests=True)
    # The destination now holds a structurally valid commit: read back by id (no ref look-up), its
    # manifests together, and the ref's value for the compare-and-swap with them (one round trip on S3).
    with ThreadPoolExecutor(max_workers=2) as pool:
        current = pool.submit(dst.ref, ref) if ref is not None else None
        read_commit(dst, lc.id, None, prefetch=closure.shards)
        was = current.result() if current is not None else None
    if ref is not None:
        _move_ref(dst, ref, lc.id, closure.ids(), was)
        result.ref = ref
    for name, ids in pinned.items():  # the objects are durable at the destination: name them
        dst.add_to_pin(name, ids)  # compare-and-swap: a concurrent writer's objects are kept
        result.pins.append(name)
    return result
