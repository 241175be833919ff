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

from ..backends.base import BatchedWrites, Storage, StreamedReads
from ..errors import CorruptObject
from ..format.lazy import torch
from ..format.tensors import check_storable, dtype_name, hash_bytes, new_hasher, tensor_bytes
from .keys import object_key

__all__ = ["WRITE_THREADS", "WriteBatch", "put_tensors", "read_into"]

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
        self.pending: list[tuple[str, str]] = []  # (key, tmp path) awaiting end_writes

    def finish(self, storage: Storage, *, threads: int = WRITE_THREADS) -> None:
        """fsync every pending tmp file and link it into place (the backend's ``end_writes``)."""
        if self.pending:  # only a batched backend (begin_write / end_writes) leaves writes pending
            assert isinstance(storage, BatchedWrites)
            storage.end_writes(self.pending, threads=max(1, threads))
        self.pending = []  # on failure they stay, for abandon

    def abandon(self) -> None:
        """Remove every pending tmp file (a failed save: nothing of it becomes visible)."""
        pending, self.pending = self.pending, []
        for _key, tmp in pending:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _gathered(t: torch.Tensor, stage: dict[int, torch.Tensor]) -> torch.Tensor:
    """``t`` itself, or, for a non-contiguous CPU tensor (a tile of a bigger tensor), its
    elements in C order in this thread's staging buffer of ``stage``, reused for the next such
    tensor once this one is hashed and written. Gathering each tile into memory of its own cost
    a page fault per 4 KiB and, with 8 threads' malloc arenas holding freed tiles, 21-48% of the
    state in added peak memory; ``stage`` holds at most one buffer per thread, the size of the
    largest tensor that thread gathered, until the ``put_tensors`` call returns."""
    check_storable(t)
    if t.device.type != "cpu" or t.is_contiguous() or t.numel() == 0:
        return t  # tensor_bytes: no copy, or a device-to-host copy of its own
    n = t.numel() * t.element_size()
    me = threading.get_ident()
    buf = stage.get(me)
    if buf is None or buf.numel() < n:
        stage.pop(me, None)  # the smaller one goes first
        buf = stage[me] = torch.empty(n, dtype=torch.uint8)
    out = buf[:n].view(t.dtype).view(t.shape)
    with torch.no_grad():
        out.copy_(t)
    return out


def put_tensors(
    storage: Storage, tensors: Sequence[torch.Tensor], *, threads: int = WRITE_THREADS, batch: WriteBatch | None = None
) -> list[str]:
    """Store each tensor's bytes as an object; return the ids in order.

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
    big = min(share, _cores())
    batched = isinstance(storage, BatchedWrites)  # once: a runtime Protocol check is not free
    stage: dict[int, torch.Tensor] = {}  # worker thread -> its buffer for gathering tiles

    def one(t: torch.Tensor) -> str:
        view = tensor_bytes(_gathered(t, stage))  # no copy for a contiguous CPU tensor
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
        if share > 1 and len(tensors) > 1:
            with ThreadPoolExecutor(max_workers=share) as pool:
                ids = list(pool.map(one, tensors))
        else:
            ids = [one(t) for t in tensors]
    except BaseException:
        wb.abandon()
        raise
    if own:
        wb.finish(storage, threads=share)
    return ids


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
    if not isinstance(storage, StreamedReads) or not direct:
        with torch.no_grad():
            dest.copy_(whole())
        return
    flat = dest.detach().reshape(-1).view(torch.uint8)
    out = memoryview(flat.numpy())
    h = new_hasher()
    n = storage.read_into(object_key(oid), out, h.update)
    if n != len(out):
        # wrong size: corrupt or a mismatched entry; let the hashing path name which
        with torch.no_grad():
            dest.copy_(whole())
        return
    got = h.hexdigest()
    if got != oid:
        raise CorruptObject(f"{what}: object {oid} is corrupt: its {n} bytes hash to {got} (SPEC.md §Objects)")
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(dest)  # an in-place write like copy_: version-counter users see it
