"""Tensor objects over a backend (SPEC.md §Tensor objects, §Read ordering): many tensors'
bytes written as objects in one batch, each hashed once from memory, and an object read
straight into a tensor, hashed chunk by chunk as it lands. ``Store.put_tensors`` and
``Store.read_into`` are these, on the store's backend.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..backends.base import BatchedWrites, Buffer, HashedReadsInto, ListedSizes, ReadsAhead, Storage, StreamedReads
from ..errors import CorruptObject, StorageError
from ..format.grid import staging
from ..format.lazy import torch
from ..format.tensors import Staging, check_storable, dtype_name, hash_bytes, new_hasher, tensor_bytes
from .keys import object_key

__all__ = ["WRITE_THREADS", "WriteBatch", "put_tensors", "read_ahead", "read_into"]

#: Objects a save hashes and writes at once (the default ``threads`` of every write path), as
#: restore reads 8 at once. More than the cores on purpose: a small object's time is mostly
#: the kernel's (creating its file, copying into the page cache, waiting on its fsync), and a
#: save of many small objects on a CPU that training keeps busy finished sooner the more of
#: them were in flight: 2 -> 4 -> 8 threads took 4.3, 3.0, 2.2 s for 288 tensors of 1.8 MiB
#: with two spinning processes on the two cores (benchmarks/RESULTS.md, "busy CPU").
WRITE_THREADS = 8
#: Tensors at least this large are hashed with BLAKE3's own threads as well (few big tensors
#: would otherwise leave cores idle at the end of a batch).
_BIG_TENSOR_BYTES = 64 << 20


def _cores() -> int:
    """The CPUs this process may run on: BLAKE3's own threads for one big tensor, never more."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class WriteBatch:
    """Objects written by several ``put_tensors`` calls and made durable and visible together
    by ``finish`` (one fsync barrier for all of them), or removed unseen by ``abandon``.

    A sharded save writes its blocks batch by batch from a reused staging arena: each batch's
    bytes are in the page cache (writeback started) when ``put_tensors`` returns, so the arena
    can be reused at once, and the device writes one batch while the next is hashed, instead
    of every batch waiting for its own fsync. Until ``finish`` links them, the objects are
    tmp files no reader sees, exactly as inside one ``put_tensors`` call.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.claimed: set[str] = set()  # ids written (or being written) in this batch: one write each
        self.pending: list[tuple[str, str]] = []  # (key, tmp path or token) awaiting end_writes
        self.failed = False  # a finish failed: its writes were discarded, a later finish must not report success

    def finish(self, storage: Storage, *, threads: int = WRITE_THREADS) -> None:
        """fsync every pending tmp file, link it into place and fsync the directories the links
        went into (the backend's ``end_writes``, ``threads`` at a time). On failure every tmp file
        still pending is discarded before the error propagates (``abandon``): a caller that
        abandons the batch after a failed ``finish`` finds nothing left, and one that does not
        (``put_tensors`` with its own batch) leaves no unnamed file's descriptor open. A batch whose
        ``finish`` failed cannot be finished again (StorageError): its objects were discarded, and a
        retry that returned would report them durable and visible."""
        if self.failed:
            raise StorageError(
                "this write batch's barrier failed earlier and its writes were discarded: nothing of it is "
                "durable or visible; write its objects again in a new batch"
            )
        if self.pending:  # only a batched backend (begin_write / end_writes) leaves writes pending
            assert isinstance(storage, BatchedWrites)
            try:
                storage.end_writes(self.pending, threads=max(1, threads))
            except BaseException:
                self.failed = True
                self.abandon(storage)  # a backend's end_writes drops them itself; a wrapper's may not
                raise
        self.pending = []

    def abandon(self, storage: Storage) -> None:
        """Remove every pending tmp file (a failed save: nothing of it becomes visible) through
        ``storage``'s ``discard_writes``, which closes an unnamed one's descriptor."""
        pending, self.pending = self.pending, []
        if pending:  # only a batched backend leaves writes pending
            assert isinstance(storage, BatchedWrites)
            storage.discard_writes(pending)


def put_tensors(
    storage: Storage,
    tensors: Sequence[torch.Tensor | Buffer],
    *,
    threads: int = WRITE_THREADS,
    batch: WriteBatch | None = None,
) -> list[str]:
    """Store each tensor's bytes (or each buffer's, as they are) as an object; return the ids in order.

    Each tensor's bytes are hashed once, from memory; objects already present are not
    written (unchanged tensors cost no bytes); new ones are written once and never read
    back. Tensors are processed ``threads`` at a time (each hashed by one BLAKE3 thread; one of
    64 MiB or more by as many as there are cores). A backend with ``begin_write`` /
    ``end_writes`` (local) gets one batch: all files written with writeback started,
    then fsynced together and linked into place, the crash ordering of ``put``. With
    ``batch``, the files join it instead and become durable and visible at its ``finish``.
    """
    own = batch is None
    wb = WriteBatch() if batch is None else batch
    share = max(1, threads)
    big = min(share, _cores())  # BLAKE3's own threads for one big tensor
    if isinstance(storage, ListedSizes) and not isinstance(storage, BatchedWrites) and len(tensors) > 1:
        return _put_listed(storage, tensors, share, big)
    stage = staging()
    batched = isinstance(storage, BatchedWrites)  # once: a runtime Protocol check is slow

    def one(t: torch.Tensor | Buffer) -> str:
        # no copy for a contiguous CPU tensor or a buffer
        view = _gathered(t, stage) if isinstance(t, torch.Tensor) else memoryview(t).cast("B")
        oid = hash_bytes(view, threads=big if len(view) >= _BIG_TENSOR_BYTES else 1)
        key = object_key(oid)
        if not batched:
            storage.write_once(key, view)
            return oid
        with wb.lock:
            if oid in wb.claimed:  # equal tensors in one batch: one write
                return oid
            wb.claimed.add(oid)
        tmp = storage.begin_write(key, view)
        if tmp is not None:
            with wb.lock:
                wb.pending.append((key, tmp))
        return oid

    try:
        ids = _map(one, tensors, share)
    except BaseException:
        wb.abandon(storage)
        raise
    if own:
        wb.finish(storage, threads=share)
    return ids


def _map(fn: Callable[[Any], Any], items: Sequence[Any], threads: int) -> list[Any]:
    """``fn`` of each item in order, ``threads`` at a time (on the calling thread for one)."""
    if threads > 1 and len(items) > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(fn, items))
    return [fn(x) for x in items]


def _gathered(t: torch.Tensor, stage: Staging) -> memoryview:
    """The bytes of ``t``: a view of them for a contiguous CPU tensor (``tensor_bytes``); a
    strided one (a tile of the grid that is not one byte range of its tensor) gathered into
    this thread's staging buffer, reused tile after tile, rather than into a new tensor each
    time. The view is valid until this thread's next call: the object is hashed and written
    (``begin_write`` and ``write_once`` copy it out) before that."""
    if t.device.type == "cpu" and not t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        buf = stage.take(check_storable(t), tuple(t.shape))
        if buf is not None:
            buf.copy_(t.detach())
            return memoryview(buf.reshape(-1).view(torch.uint8).numpy())
    return tensor_bytes(t)


def _put_listed(storage: ListedSizes, tensors: Sequence[torch.Tensor | Buffer], threads: int, big: int) -> list[str]:
    """``put_tensors`` on a backend that lists (S3): every tensor hashed first, then one
    presence check for all of them (``ListedSizes.sizes``: listing pages, not a request per
    object), then the absent ones written (create-only: one that appeared meanwhile is found by
    the write) and the present ones refreshed (gc's grace period, SPEC.md §19.2) without
    sending their bytes again; one listed with the wrong size (a torn object) is replaced. A
    save whose tensors did not change sends no tensor bytes."""
    assert isinstance(storage, Storage)

    def view_of(t: torch.Tensor | Buffer) -> memoryview:
        # no copy for a contiguous CPU tensor or a buffer; any other tensor is copied again to write it
        return tensor_bytes(t) if isinstance(t, torch.Tensor) else memoryview(t).cast("B")

    def hashed(t: torch.Tensor | Buffer) -> str:
        view = view_of(t)
        return hash_bytes(view, threads=big if len(view) >= _BIG_TENSOR_BYTES else 1)

    ids = _map(hashed, tensors, threads)
    first = {oid: t for oid, t in reversed(list(zip(ids, tensors)))}  # equal tensors: one write
    listed = storage.sizes([object_key(oid) for oid in first])

    def put(item: tuple[str, torch.Tensor | Buffer]) -> None:
        oid, t = item
        key = object_key(oid)
        want = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else memoryview(t).nbytes
        size = listed.get(key)
        if size == want and storage.refresh(key, size):
            return  # present (an object's name is its bytes' hash), and young again
        if size is not None and size != want:  # torn: it cannot hash to its id; replaced, as copy does (SPEC.md §19.1)
            storage.delete(key)
        storage.write_once(key, view_of(t))

    _map(put, sorted(first.items()), threads)
    return ids


def read_ahead(storage: Storage, oid: str) -> None:
    """Have the backend start fetching object ``oid`` for a ``read_into`` soon after (``ReadsAhead``:
    local files; nothing on a backend without it). Advisory: what the read returns, and its
    verification, are unchanged."""
    if isinstance(storage, ReadsAhead):
        storage.read_ahead(object_key(oid))


def read_into(storage: Storage, oid: str, dest: torch.Tensor, *, what: str, whole: Callable[[], torch.Tensor]) -> None:
    """Fill ``dest`` in place with object ``oid``'s bytes, verifying size and hash.

    On a backend with ``read_into`` the bytes go straight from the file into ``dest``
    and are hashed chunk by chunk while in cache: one copy, no page faults on a mapping.
    If this raises (CorruptObject, or a StorageError part way through), ``dest`` may hold
    unverified bytes.
    """
    dtype_name(dest.dtype, what)  # a dtype outside the allow-list is refused before any byte lands
    direct = (
        dest.device.type == "cpu"
        and dest.is_contiguous()
        and dest.numel() > 0
        and not (dest.is_conj() or dest.is_neg())
    )
    hashed = isinstance(storage, HashedReadsInto)
    if not (hashed or isinstance(storage, StreamedReads)) or not direct:
        with torch.no_grad():
            dest.copy_(whole())
        return
    flat = dest.detach().reshape(-1).view(torch.uint8)
    out = memoryview(flat.numpy())
    if hashed:  # the backend hashed what it put in ``out`` (a tier verifies its copies): once, not twice
        n, got = storage.read_into_hashed(object_key(oid), out)
    else:
        h = new_hasher()
        n = storage.read_into(object_key(oid), out, h.update)
        got = h.hexdigest()
    if n != len(out):
        # wrong size: corrupt or a mismatched entry; let the hashing path name which
        with torch.no_grad():
            dest.copy_(whole())
        return
    if got != oid:
        raise CorruptObject(f"{what}: object {oid} is corrupt: its {n} bytes hash to {got} (SPEC.md §Objects)")
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(dest)  # an in-place write like copy_: version-counter users see it
