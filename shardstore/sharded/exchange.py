"""The block exchange: running a save's block plan, batch by batch (SPEC.md §Block exchange).

``dtensor.write_dtensors`` computes a plan: for each canonical block its owner and the
pieces other ranks send it, each rank only its own part (the blocks it owns, the pieces it
sends, every block's size). This module carries the plan out. Blocks
are taken in batches of at most ``BATCH_BYTES``; in each batch every rank

1. works out what it must stage: a block it owns that is not one contiguous box of its
   own local tensor (assembled from its parts and the pieces others send), a piece that
   arrives as a column strip (received whole, then copied into place), a piece it sends
   that is not contiguous in its local tensor (copied out);
2. carves those buffers from one **staging arena**, allocated once per exchange (grown
   only if a later batch needs more) and reused batch after batch, so a rank's memory
   beyond its own slices is the arena: at most the largest batch's staging, never the
   allocator's churn of freeing and reallocating blocks;
3. posts the point-to-point sends and receives, waits, and hashes and writes the blocks it
   owns (a block inside one part of its local tensor and contiguous there is a view of it)
   into the page cache, with writeback started.

The written blocks become durable and visible together after the last batch (one fsync
barrier, ``store.tensors.WriteBatch``), so the device writes one batch while the next is
exchanged and hashed.

A rank's staging in one batch is at most twice the batch: the blocks it owns (each at most
once), plus the strips received for them, plus the pieces it sends of other blocks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..format.grid import BLOCK_BYTES, Box, box_slices, intersect
from ..format.tensors import expected_nbytes, torch_dtype
from ..store import Store
from ..store.tensors import WriteBatch

__all__ = ["BATCH_BYTES", "NOT_MINE", "ExchangeStats", "Local", "PlannedBlock", "last_exchange", "run_plan"]

#: Most bytes of blocks one batch of the exchange assembles (a rank stages at most twice
#: this beyond its own slices while saving).
BATCH_BYTES = 16 * BLOCK_BYTES

_ALIGN = 64  # each staged buffer starts on a 64-byte boundary of the arena (any dtype's view)

#: A rank's local tensor and its parts: (global box, virtual origin) each; ``local[box_slices(piece, origin)]``.
Local = tuple[torch.Tensor, list[tuple[Box, tuple[int, ...]]]]


#: The owner of a block in a rank's plan that the rank neither owns nor sends a piece of
#: (``dtensor.plan_local``: its owner and pieces are not worked out there).
NOT_MINE = -1


@dataclass(frozen=True, slots=True)
class PlannedBlock:
    """One canonical block of the plan (``dtensor.plan_union``; ``dtensor.plan_local``: as one
    rank needs it, the blocks it has no part in with owner ``NOT_MINE`` and no pieces)."""

    key: tuple[str, str]  # (tensor name, role)
    index: int  # the block's index on its tensor's grid
    box: Box  # the block's (start, shape) in the global tensor
    owner: int  # the rank that assembles, hashes and writes it
    sends: list[tuple[int, Box]]  # its other pieces: (source rank, piece box); source == owner: copied, not sent
    dtype: str


@dataclass(slots=True)
class _Owned:
    """A block this rank owns in the batch: where it is assembled and what arrives for it."""

    at: int  # its index in the whole plan
    box: Box
    dtype: torch.dtype
    local: Local
    view: torch.Tensor | None  # the block as a view of the local tensor, when it is one contiguous box of it
    arriving: list[tuple[int, int, Box]]  # (tag, source rank, piece box)


@dataclass(slots=True)
class _Send:
    """A piece this rank sends to a block's owner."""

    tag: int
    to: int  # the owner's rank in the group
    view: torch.Tensor  # the piece, a view of the local tensor


@dataclass
class ExchangeStats:
    """What this process did in its latest block exchange (a diagnostic; SPEC.md §Block exchange)."""

    blocks_written: int = 0  # blocks this rank owned: hashed and written
    bytes_hashed: int = 0
    bytes_sent: int = 0  # pieces sent to other ranks' blocks
    bytes_received: int = 0
    peak_staged: int = 0  # most bytes of staging buffers one batch used (beyond this rank's own slices)
    arena_bytes: int = 0  # the staging arena's size: the most this exchange held at once
    # where this rank's time went (seconds, summed over batches; a profile, not in any manifest)
    stage_s: float = 0.0  # working out and copying what it stages (its parts into blocks, pieces it sends)
    transfer_s: float = 0.0  # waiting for pieces sent and received, and copying strips into place
    write_s: float = 0.0  # hashing and writing its blocks (into the page cache, writeback started)
    durable_s: float = 0.0  # the one fsync barrier that makes them durable and visible
    agree_s: float = 0.0  # the failure-flag all-reduces (includes waiting for slower ranks)


_LAST = ExchangeStats()


def last_exchange() -> ExchangeStats:
    """Counts of this process's most recent exchange (for tests and benchmarks)."""
    return _LAST


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Arena:
    """One uint8 buffer the staging tensors of a batch are carved from, reset between batches."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.off = 0

    def reset(self, nbytes: int) -> None:
        if nbytes and (self.buf is None or self.buf.numel() < nbytes):
            self.buf = None  # the old one goes before the new one is allocated
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.off = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        assert self.buf is not None and self.off + n <= self.buf.numel(), "staging was under-counted"
        t = self.buf[self.off : self.off + n].view(dtype).view(shape)
        self.off += _round(n)
        return t

    @property
    def size(self) -> int:
        return 0 if self.buf is None else int(self.buf.numel())


def _contiguous_in(shape: tuple[int, ...], box: Box) -> bool:
    """Whether a box of a C-contiguous tensor of ``shape`` is one contiguous range (torch's
    ``is_contiguous`` of that view): extent 1 on the dims before some dim, whole after it."""
    extent = box[1]
    if math.prod(extent) <= 1:
        return True
    k = next((d for d, n in enumerate(extent) if n != 1), len(extent))
    return all(extent[d] == shape[d] for d in range(k + 1, len(shape)))


def _own_pieces(box: Box, parts: list[tuple[Box, tuple[int, ...]]]) -> list[tuple[Box, tuple[int, ...]]]:
    """(common box, virtual origin) of each of this rank's parts that overlaps ``box``."""
    if not math.prod(box[1]):
        return []
    return [(c, vo) for part, vo in parts if (c := intersect(box, part)) is not None]


def _origin_of(parts: list[tuple[Box, tuple[int, ...]]], piece: Box) -> tuple[int, ...]:
    """The virtual origin of the part holding ``piece`` (the plan only asks a rank for what it holds)."""
    for part, vo in parts:
        if intersect(piece, part) == piece:
            return vo
    raise AssertionError(f"piece {piece} is in none of this rank's parts")


def _any_failed(error: BaseException | None, group: Any) -> bool:
    """Whether any rank of ``group`` failed (one int all-reduced); this rank's ``error`` is raised."""
    flag = torch.tensor([int(error is not None)], dtype=torch.int32)
    t0 = time.perf_counter()
    dist.all_reduce(flag, group=group)
    _LAST.agree_s += time.perf_counter() - t0
    if error is not None:
        raise error
    return bool(flag.item())


def run_plan(
    store: Store, plans: list[PlannedBlock], locals_: dict[Any, Local], rank: int, g: Any, group: Any, threads: int
) -> list[str] | None:
    """Carry out ``plans`` (in the same order on every rank); return every block's id (all
    ranks get all ids).

    A rank whose staging or writing fails (a full disk, a storage error) still tells the
    others, after the batch, and raises; they return None (the commit protocol then fails
    on every rank naming it) instead of waiting for its pieces until the group times out."""
    global _LAST
    stats = _LAST = ExchangeStats()
    run = _Exchange(store, rank, g, group, threads, stats, _Arena(), store.write_batch(), locals_)
    ids: list[bytes | None] = [None] * len(plans)
    try:
        i = 0
        while i < len(plans):
            j, size = i, 0
            while j < len(plans) and (j == i or size + expected_nbytes(plans[j].dtype, plans[j].box[1]) <= BATCH_BYTES):
                size += expected_nbytes(plans[j].dtype, plans[j].box[1])
                j += 1
            written = run.batch(plans[i:j], i)
            if written is None:
                return None
            for k, oid in written:
                ids[k] = bytes.fromhex(oid)
            i = j
        stats.arena_bytes = run.arena.size
        run.arena = _Arena()  # the staging is free before the barrier
        error: BaseException | None = None
        t0 = time.perf_counter()
        try:
            run.writes.finish(store.storage, threads=threads)  # one fsync barrier for the whole exchange
        except Exception as e:  # noqa: BLE001 - a full disk at fsync: every rank learns of it
            error = e
        stats.durable_s += time.perf_counter() - t0
        if _any_failed(error, group):
            return None
    finally:
        run.writes.abandon(store.storage)  # a failed exchange leaves no tmp file behind (nothing once finished)
    table = torch.zeros((len(plans), 32), dtype=torch.uint8)
    for k, raw in enumerate(ids):
        if raw is not None:
            table[k] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)  # one owner per row, zeros elsewhere
    return [bytes(row.numpy().tobytes()).hex() for row in table]


@dataclass
class _Exchange:
    """One rank's run of a plan: where blocks go, the group, and what the batches share (the
    staging arena, the write batch made durable at the end, the statistics)."""

    store: Store
    rank: int
    g: Any  # group rank -> global rank
    group: Any
    threads: int
    stats: ExchangeStats
    arena: _Arena
    writes: WriteBatch
    locals_: dict[Any, Local]

    def batch(self, batch: list[PlannedBlock], first: int) -> list[tuple[int, str]] | None:
        """One batch: what to stage worked out, the arena sized, pieces sent and received, this
        rank's blocks hashed and written; returns (plan index, id) of the blocks it owns, or
        None if another rank failed (staging, before any piece is posted, or writing its blocks)."""
        error: BaseException | None = None
        t0 = time.perf_counter()
        try:
            owned, sending, need = self.stage(batch, first)
        except Exception as e:  # noqa: BLE001 - every rank learns of it before a piece is posted
            error = e
        self.stats.stage_s += time.perf_counter() - t0
        if _any_failed(error, self.group):
            return None
        try:
            written = self.exchange(owned, sending, need)
        except Exception as e:  # noqa: BLE001 - a full disk, a storage error: every rank learns of it
            error = e
        return None if _any_failed(error, self.group) else written

    def stage(self, batch: list[PlannedBlock], first: int) -> tuple[list[_Owned], list[_Send], int]:
        """1. This rank's part of the batch and the bytes it stages; the arena sized (no piece posted)."""
        owned: list[_Owned] = []
        sending: list[_Send] = []
        need = 0
        # tags: a count per pair of ranks, in plan order (block, then piece): the source numbers the
        # pieces it sends to each owner, the owner those it takes from each source, alike; so a rank
        # needs no other rank's pieces (a plan_local plan lists only its own blocks' pieces)
        sent: dict[int, int] = {}
        taken: dict[int, int] = {}
        rank = self.rank
        for k, b in enumerate(batch, start=first):
            dtype = torch_dtype(b.dtype)
            item = torch.empty((), dtype=dtype).element_size()
            if b.owner == rank:
                local = self.locals_[b.key]
                own = _own_pieces(b.box, local[1])
                view = None
                if len(own) == 1 and own[0][0] == b.box:
                    v = local[0][box_slices(b.box, own[0][1])]
                    view = v if v.is_contiguous() else None
                if view is None:
                    need += _round(math.prod(b.box[1]) * item)
                arriving = []
                for src, piece in b.sends:
                    if src == rank:  # a slice the owner holds too: copied from its own parts
                        continue
                    taken[src] = taken.get(src, 0) + 1
                    arriving.append((taken[src], src, piece))
                    if not _contiguous_in(b.box[1], piece):
                        need += _round(math.prod(piece[1]) * item)
                covered = sum(math.prod(c[1]) for c, _ in own) + sum(math.prod(p[1]) for _, _, p in arriving)
                assert covered == math.prod(b.box[1]), f"block {b.box} of {b.key} is not covered exactly"
                owned.append(_Owned(k, b.box, dtype, local, view, arriving))
            else:
                for src, piece in b.sends:
                    if src != rank:
                        continue
                    sent[b.owner] = sent.get(b.owner, 0) + 1
                    lt, parts = self.locals_[b.key]
                    view = lt[box_slices(piece, _origin_of(parts, piece))]
                    if not view.is_contiguous():
                        need += _round(view.numel() * item)
                    sending.append(_Send(sent[b.owner], b.owner, view))
        self.arena.reset(need)
        return owned, sending, need

    def exchange(self, owned: list[_Owned], sending: list[_Send], need: int) -> list[tuple[int, str]]:
        """2. Buffers carved from the arena, sends and receives posted; 3. the blocks hashed and
        written (into the page cache, joining ``writes``: the arena is free again on return)."""
        stats, arena, g, group = self.stats, self.arena, self.g, self.group
        works, blocks, strips = [], [], []
        t0 = time.perf_counter()
        for o in owned:
            lt, parts = o.local
            buf = o.view
            if buf is None:
                buf = arena.take(o.box[1], o.dtype)
                for common, vo in _own_pieces(o.box, parts):
                    buf[box_slices(common, o.box[0])] = lt[box_slices(common, vo)]
            for t, src, piece in o.arriving:
                dest = buf[box_slices(piece, o.box[0])]
                if dest.is_contiguous():  # whole along the block's later dims (rows of it): straight into the block
                    works.append(dist.irecv(dest, src=g(src), group=group, tag=t))
                else:  # a column strip: into a buffer, then copied into place
                    tmp = arena.take(piece[1], o.dtype)
                    works.append(dist.irecv(tmp, src=g(src), group=group, tag=t))
                    strips.append((dest, tmp))
                stats.bytes_received += dest.numel() * dest.element_size()
            blocks.append((o.at, buf))
        for s in sending:
            out = s.view
            if not out.is_contiguous():
                out = arena.take(tuple(s.view.shape), s.view.dtype)
                out.copy_(s.view)
            stats.bytes_sent += out.numel() * out.element_size()
            works.append(dist.isend(out, dst=g(s.to), group=group, tag=s.tag))
        assert arena.off <= need, "staging was under-counted"
        t1 = time.perf_counter()
        stats.stage_s += t1 - t0
        # 3. Everything arrived: the blocks are whole; hash and write them.
        for w in works:
            w.wait()
        for dest, tmp in strips:
            dest.copy_(tmp)
        t2 = time.perf_counter()
        stats.transfer_s += t2 - t1
        written = (
            self.store.put_tensors([b.detach().reshape(-1) for _, b in blocks], threads=self.threads, batch=self.writes)
            if blocks
            else []
        )
        stats.write_s += time.perf_counter() - t2
        stats.blocks_written += len(blocks)
        stats.bytes_hashed += sum(b.numel() * b.element_size() for _, b in blocks)
        stats.peak_staged = max(stats.peak_staged, need)
        return [(k, oid) for (k, _), oid in zip(blocks, written)]
