"""Restore by exchange: each block read once per process group (SPEC.md §16.2).

A restore on its own (``checkpoint.restore.read_plan``, ``grid.read_parts``) has every rank
read every block its local slices overlap, whole, since a block is verified whole: a rank
holding 2 rows of a 16,384-row tensor reads its whole 1,024-row tile band. When the ranks of a
process group restore together, this module reads each needed block once in the group and
sends its pieces to the ranks that need them, the mirror of the save's block exchange
(``exchange.py``, SPEC.md §15.2):

1. **describe**: each rank lists, per payload it reads (keyed by a BLAKE3 digest of its dtype,
   shape and blocks, so every rank holding it computes the same key), the grid kind, dtype,
   global shape and the distinct boxes of the global tensor its destinations hold; all ranks
   all-gather the descriptions (msgspec JSON in uint8 tensors, a status byte first: a rank that
   failed to plan still takes part and says so; nothing is pickled);
2. **assign**: from the union every rank computes the same plan: the blocks of every payload
   (key order, then grid order), each read by the rank, of those whose boxes overlap it, with
   the fewest bytes assigned so far (ties: the lowest rank), so each needed block is read by
   exactly one rank that needs it and the reads are balanced by bytes; every other overlap is
   a **piece** the reader sends (a rank keeps only the pieces it sends or receives: its plan
   costs a step per block plus those, not the group's every piece);
3. **check**: each rank checks the size of every block it reads (one query each; a ``HEAD`` on
   S3); a failure flag is all-reduced, so a missing or wrong-sized object is refused on every
   rank before any byte lands on any rank;
4. **read and send**, in batches of at most ``BATCH_BYTES`` of blocks: each rank reads its
   blocks, every one verified whole (a block only it needs goes straight into its destination
   where it lies contiguously in one, ``grid.BlockRead``), copies its own overlaps, makes the
   copies and buffers of the pieces it sends and receives, and the failure flag is all-reduced
   again; then the pieces go point to point (contiguous pieces as
   views, others copied out), received straight into a contiguous destination or into a buffer
   copied into place, every send and receive waited on whatever failed, and the failure flag is
   all-reduced once more (a failed wait or copy fails every rank there). Memory beyond the
   destinations: the batch's blocks read for others, the copies of non-contiguous pieces sent
   and the buffers of pieces received, each at most a batch.

A failure on any rank (a missing or corrupt object, a wrong size, a storage error, a plan that
did not fit) is raised on every rank with its type and message (another rank's error naming
that rank), never a wait for the group's timeout. As for a restore on its own (SPEC.md §16): a
corrupt object is found while reading, so destinations may then hold restored or unverified
bytes; a failed restore must be repeated, never trained from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from ..errors import GridError, failure_report, raise_peer
from ..format.grid import BlockRead, Box, box_slices, check_reads, grid, intersect, payload_blocks, staging
from ..format.manifest import MAX_DIM, MAX_NDIM, Payload, is_chunked
from ..format.tensors import ITEMSIZES, expected_nbytes, new_hasher, torch_dtype
from ..store import Store
from .dtensor import all_gather_bytes, slices_near
from .exchange import BATCH_BYTES

__all__ = [
    "Needed",
    "GroupReadStats",
    "PlannedRead",
    "decode_descriptions",
    "grouped",
    "last_group_read",
    "payload_key",
    "plan_group_read",
    "read_group",
]

#: The grid a payload's blocks lie on, as a description names it: every rank holding the payload
#: lists the same boxes from (kind, dtype, shape) alone (SPEC.md §5.1).
ONE, TILES, BANDS = 0, 1, 2


#: A shape, start or extent as a description gives it: bounded as a manifest's are (decoded strictly).
_Index = Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)], ...], msgspec.Meta(max_length=MAX_NDIM)]


class Needed(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One payload as one rank reads it (step 1): its key, grid kind, dtype, global shape and the
    distinct boxes of the global tensor this rank's destinations hold (sorted)."""

    key: str
    kind: int
    dtype: str
    shape: _Index
    boxes: tuple[tuple[_Index, _Index], ...]


_NEEDED = msgspec.json.Decoder(list[Needed])


@dataclass
class GroupReadStats:
    """What this process did in its latest restore by exchange (a diagnostic, for tests and benchmarks)."""

    blocks_read: int = 0  # blocks this rank read (and verified) from the store
    bytes_read: int = 0
    bytes_sent: int = 0  # pieces of its blocks sent to other ranks
    bytes_received: int = 0  # pieces of other ranks' blocks received
    bytes_copied_out: int = 0  # pieces not contiguous in their block, copied out to be sent (once each)
    pieces_sent: int = 0
    pieces_received: int = 0
    batches: int = 0
    plan_s: float = 0.0  # describing, the all-gather and the assignment
    read_s: float = 0.0  # size checks and reads (hashing included), and the pieces' copies and buffers
    transfer_s: float = 0.0  # the pieces sent and received, and copied into place
    agree_s: float = 0.0  # the failure-flag all-reduces (includes waiting for slower ranks)


_LAST = GroupReadStats()


def last_group_read() -> GroupReadStats:
    """Counts of this process's most recent restore by exchange."""
    return _LAST


def grouped(group: Any) -> bool:
    """Whether a read runs by exchange: a process group of more than one process (None, or a
    group of one, reads on its own, unchanged)."""
    return group is not None and dist.get_world_size(group) > 1


def payload_key(payload: Payload, dtype: str, shape: Sequence[int]) -> str:
    """A payload's key in the descriptions: BLAKE3 over its dtype, shape and block ids, the same
    on every rank holding it (a payload names its blocks' boxes by the grid of its dtype and shape)."""
    h = new_hasher()
    h.update(f"{dtype}{list(shape)}".encode())
    for oid, _box, _n in payload_blocks(payload, dtype, shape):
        h.update(bytes.fromhex(oid))
    return h.hexdigest()


def _kind(payload: Payload, dtype: str, shape: tuple[int, ...], what: str) -> int:
    """The grid the payload's blocks lie on; GridError if neither (load_commit has checked it)."""
    if not is_chunked(payload):
        return ONE
    boxes = [box for _, box, _ in payload_blocks(payload, dtype, shape)]
    if len(boxes) == 1:  # a version 1 object, or one block on either grid: the whole tensor
        return ONE
    for kind, bands in ((TILES, False), (BANDS, True)):
        if boxes == grid(dtype, shape, bands=bands):
            return kind
    raise GridError(f"{what}: its blocks lie on no canonical grid (SPEC.md §5.1)")


def _boxes(kind: int, dtype: str, shape: tuple[int, ...]) -> list[Box]:
    if kind == ONE:
        return [((0,) * len(shape), shape)]
    if kind not in (TILES, BANDS):
        raise GridError(f"a description names grid kind {kind}, not one of {ONE}, {TILES}, {BANDS}")
    return grid(dtype, shape, bands=kind == BANDS)


@dataclass
class _Local:
    """A payload this rank reads: its blocks, a label, and where each of its boxes lands."""

    payload: Payload
    dtype: str
    shape: tuple[int, ...]
    what: str
    kind: int
    oids: list[str]  # each block's object, in grid order
    dests: dict[Box, list[tuple[torch.Tensor, tuple[int, ...]]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlannedRead:
    """One block of the group's plan, the same on every rank: who reads it and who gets which piece."""

    key: str
    index: int  # on its payload's grid
    box: Box
    n: int  # bytes
    dtype: str
    reader: int
    pieces: tuple[tuple[int, Box, Box], ...]  # (rank, that rank's box, common box), the reader's own included


def decode_descriptions(gathered: Sequence[bytes]) -> list[list[Needed]]:
    """Step 1's descriptions as all-gathered (``gathered[r]``: rank r's, its status byte taken
    off), decoded strictly; GridError naming a rank whose bytes are not a list of ``Needed``."""
    out = []
    for r, raw in enumerate(gathered):
        try:
            out.append(_NEEDED.decode(raw))
        except msgspec.MsgspecError as e:
            raise GridError(f"rank {r}'s description of the restore does not decode: {e} (SPEC.md §16.2)") from None
    return out


def _check_described(it: Needed, r: int) -> None:
    """GridError naming rank ``r`` if it describes a payload no tensor can have (a grid kind,
    dtype or shape out of range); its boxes are checked against the shape in ``plan_group_read``."""
    if it.kind not in (ONE, TILES, BANDS):
        problem = f"grid kind {it.kind}, not one of {ONE}, {TILES}, {BANDS}"
    elif it.dtype not in ITEMSIZES:
        problem = f"dtype {it.dtype!r}, not one shardstore stores"
    elif len(it.shape) > MAX_NDIM or not all(0 <= d <= MAX_DIM for d in it.shape):
        problem = f"shape {list(it.shape)}: at most {MAX_NDIM} dims, each of 0 to {MAX_DIM}"
    else:
        return
    raise GridError(f"rank {r} describes payload {it.key} with {problem} (SPEC.md §16.2)")


def plan_group_read(peers: Sequence[Sequence[Needed]], rank: int | None = None) -> list[PlannedRead]:
    """Step 2: every block some rank needs, its reader and its pieces, from every rank's
    descriptions (``peers[r]``: rank r's); the same on every rank. Empty blocks are left out
    (each rank reads those itself: nothing to share).

    ``rank``: the pieces only as that rank uses them — all of a block it reads, its own of a
    block another rank reads, none of the rest — so that a rank's plan costs about one step per
    block plus the pieces it takes part in, not the group's every piece (at thousands of ranks
    a rank's rows meet hundreds of others' in every tile). Readers are the same either way.

    A description is checked before it is used (GridError naming the rank): a grid kind, dtype
    and shape a tensor can have, the same on every rank describing the payload, and boxes of
    that many dims inside the shape."""
    union: dict[str, tuple[int, str, tuple[int, ...], dict[Box, list[int]]]] = {}
    for r, items in enumerate(peers):
        for it in items:
            if it.key not in union:
                _check_described(it, r)
            kind, dtype, shape, held = union.setdefault(it.key, (it.kind, it.dtype, tuple(it.shape), {}))
            if (kind, dtype, shape) != (it.kind, it.dtype, tuple(it.shape)):
                raise GridError(
                    f"ranks describe payload {it.key} as different tensors: {dtype}{list(shape)} and "
                    f"{it.dtype}{list(it.shape)}"
                )
            nd = len(shape)
            for start, extent in it.boxes:
                if len(start) != nd or len(extent) != nd:
                    raise GridError(
                        f"rank {r} describes payload {it.key} ({dtype}{list(shape)}) with the box "
                        f"{list(start)} + {list(extent)} of other dims (SPEC.md §16.2)"
                    )
                held.setdefault((tuple(start), tuple(extent)), []).append(r)
    loads = np.zeros(len(peers), dtype=np.int64)
    out: list[PlannedRead] = []
    for key in sorted(union):
        kind, dtype, shape, held = union[key]
        regions = sorted(held.items())
        near = slices_near(regions, len(shape))
        lo = np.array([reg[0] for reg, _ in regions], dtype=np.int64).reshape(len(regions), len(shape))
        ext = np.array([reg[1] for reg, _ in regions], dtype=np.int64).reshape(len(regions), len(shape))
        hi = lo + ext
        outside = np.any((lo < 0) | (ext < 0) | (hi > np.array(shape, dtype=np.int64)), axis=1)
        if outside.any():  # (decoded descriptions bound each value by MAX_DIM: no int64 overflows)
            (start, extent), rs = regions[int(np.argmax(outside))]
            raise GridError(
                f"rank {rs[0]} describes payload {key} ({dtype}{list(shape)}) with the box {list(start)} + "
                f"{list(extent)}, not inside it (SPEC.md §16.2)"
            )
        single = (
            np.array([rs[0] for _, rs in regions], dtype=np.int64) if all(len(rs) == 1 for _, rs in regions) else None
        )
        mine = (
            None if rank is None else np.array([ri for ri, (_, rs) in enumerate(regions) if rank in rs], dtype=np.int64)
        )
        for bi, box in enumerate(_boxes(kind, dtype, shape)):
            if not math.prod(box[1]):
                continue
            cand = np.array(near(box), dtype=np.int64)
            if not cand.size:
                continue
            b_lo = np.array(box[0], dtype=np.int64)
            b_hi = b_lo + np.array(box[1], dtype=np.int64)
            hit = cand[np.all((lo[cand] < b_hi) & (hi[cand] > b_lo), axis=1)]  # the regions sharing an element
            if not hit.size:
                continue
            if single is not None:
                needers = np.unique(single[hit])
            else:  # replicas: a region held by several ranks
                needers = np.array(sorted({r for i in hit.tolist() for r in regions[i][1]}), dtype=np.int64)
            reader = int(needers[int(np.argmin(loads[needers]))])  # the fewest bytes so far; ties: the lowest rank
            n = expected_nbytes(dtype, box[1])
            loads[reader] += n
            if rank is None or rank == reader:
                use = sorted(hit.tolist())
            else:  # this rank's own regions among them (sorted), if any
                use = np.intersect1d(hit, mine).tolist() if mine is not None and mine.size else []
            pieces = []
            for ri in use:
                region, rs = regions[ri]
                common = intersect(box, region)
                assert common is not None  # hit: it shares an element with the block
                pieces += [(r, region, common) for r in rs if rank is None or rank == reader or r == rank]
            out.append(PlannedRead(key, bi, box, n, dtype, reader, tuple(pieces)))
    return out


def _raise_peer(reports: Sequence[bytes | None]) -> None:
    """Raise the first failed rank's error on this rank (``collective.raise_peer``)."""
    raise_peer(reports, "restoring by exchange, where no rank reads further", "§16.2")


def _agree(error: BaseException | None, group: Any, stats: GroupReadStats) -> None:
    """All-reduce a failure flag; if any rank failed, every rank raises (its own error, or the
    first failed rank's, type and message, ``_raise_peer``)."""
    flag = torch.tensor([int(error is not None)], dtype=torch.int32)
    t0 = time.perf_counter()
    dist.all_reduce(flag, group=group)
    stats.agree_s += time.perf_counter() - t0
    if not int(flag.item()):
        return
    got = all_gather_bytes(b"" if error is None else failure_report(error), group)
    if error is not None:
        raise error
    _raise_peer([g or None for g in got])


def read_group(
    store: Store,
    items: Sequence[tuple[Payload, str, tuple[int, ...], list[tuple[torch.Tensor, tuple[int, ...]]], str]],
    threads: int,
    group: Any,
    *,
    failure: BaseException | None = None,
) -> int:
    """Fill each item's destinations from its payload, every block read once in ``group``
    (collective: every rank of the group calls it with its own items); return the bytes this
    rank read from the store. ``items``: (payload, dtype, global shape, [(view, global origin)
    of each part], label). ``failure``: this rank could not plan its restore; it still takes
    part in the description exchange and raises it, and every other rank raises it too.
    ``group``'s backend must carry CPU tensors (Gloo), as the save's block exchange's does; a
    destination on another device (CUDA) receives its pieces through a CPU buffer."""
    global _LAST
    stats = _LAST = GroupReadStats()
    t0 = time.perf_counter()
    rank = dist.get_rank(group)
    locals_: dict[str, _Local] = {}
    empty: list[BlockRead] = []  # blocks of no elements: each rank reads its own (nothing to send)
    raw = b""
    try:
        if failure is not None:
            raise failure
        for payload, dtype, shape, parts, what in items:
            key = payload_key(payload, dtype, shape)
            loc = locals_.get(key)
            if loc is None:
                blocks = payload_blocks(payload, dtype, shape)
                kind = _kind(payload, dtype, tuple(shape), what)
                loc = locals_[key] = _Local(payload, dtype, tuple(shape), what, kind, [b[0] for b in blocks])
            for view, origin in parts:
                loc.dests.setdefault((tuple(origin), tuple(view.shape)), []).append((view, tuple(origin)))
            for i, (oid, box, n) in enumerate(payload_blocks(payload, dtype, shape)):
                if not math.prod(box[1]):
                    hits = tuple((v, tuple(o), box) for v, o in parts if (tuple(o), tuple(v.shape)) == box)
                    if hits:
                        label = what if not is_chunked(payload) else f"{what}, block {i}"
                        empty.append(BlockRead(store, oid, box, hits, n, dtype, label))
        desc = [
            Needed(k, loc.kind, loc.dtype, loc.shape, tuple(sorted(b for b in loc.dests if math.prod(b[1]))))
            for k, loc in sorted(locals_.items())
        ]
        raw = b"\x00" + msgspec.json.encode(desc)
    except Exception as e:  # noqa: BLE001 - still take part in the exchange, so every rank raises, none waits
        failure, raw = e, b"\x01" + failure_report(e)
    gathered = all_gather_bytes(raw, group)
    if failure is not None:
        raise failure
    if any(g[:1] != b"\x00" for g in gathered):
        _raise_peer([g[1:] if g[:1] != b"\x00" else None for g in gathered])
    error: BaseException | None = None
    plan: list[PlannedRead] = []
    try:  # the same on every rank, and so are its errors
        plan = plan_group_read(decode_descriptions([g[1:] for g in gathered]), rank)
    except Exception as e:  # noqa: BLE001
        error = e
    stats.plan_s = time.perf_counter() - t0
    _agree(error, group, stats)
    run = _GroupRead(store, rank, group, threads, stats, locals_)
    # 3. the sizes of every block this rank reads, before any byte lands on any rank; then the
    # empty blocks (no byte lands), inside the same agreement: a read that fails on one rank
    # fails every rank here, never leaves the others waiting in the first batch's all-reduce
    t1 = time.perf_counter()
    nread = 0
    try:
        check_reads(store, [run.job(p) for p in plan if p.reader == rank] + empty, threads=max(threads, 16))
        nread = sum(job() for job in empty)
    except Exception as e:  # noqa: BLE001 - every rank learns of it before a byte lands
        error = e
    stats.read_s += time.perf_counter() - t1
    _agree(error, group, stats)
    i = 0
    while i < len(plan):  # 4. batches of at most BATCH_BYTES of blocks, the same on every rank
        j, size = i, 0
        while j < len(plan) and (j == i or size + plan[j].n <= BATCH_BYTES):
            size += plan[j].n
            j += 1
        nread += run.batch(plan[i:j])
        i = j
    stats.bytes_read = nread
    return nread


@dataclass
class _Moves:
    """A batch's point-to-point transfers on one rank, made ready before its first agreement."""

    sends: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (piece, group rank, tag)
    recvs: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (destination or buffer, reader, tag)
    strips: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (destination view, buffer)
    direct: list[torch.Tensor] = field(default_factory=list)  # destinations received in place


@dataclass
class _GroupRead:
    """One rank's run of the plan."""

    store: Store
    rank: int
    group: Any
    threads: int
    stats: GroupReadStats
    locals_: dict[str, _Local]

    def hits(self, p: PlannedRead) -> list[tuple[torch.Tensor, tuple[int, ...], Box]]:
        """This rank's destinations of block ``p``: (view, origin, common box) each."""
        loc = self.locals_[p.key]
        return [(v, o, c) for r, region, c in p.pieces if r == self.rank for v, o in loc.dests[region]]

    def job(self, p: PlannedRead, into: torch.Tensor | None = None) -> BlockRead:
        """The read of block ``p`` (this rank reads it): into ``into`` (the whole block) when other
        ranks need pieces of it, else straight into this rank's destinations."""
        loc = self.locals_[p.key]
        oid = loc.oids[p.index]
        label = loc.what if not is_chunked(loc.payload) else f"{loc.what}, block {p.index}"
        hits = ((into, p.box[0], p.box),) if into is not None else tuple(self.hits(p))
        return BlockRead(self.store, oid, p.box, hits, p.n, p.dtype, label)

    def batch(self, batch: list[PlannedRead]) -> int:
        """Read this rank's blocks of the batch and make ready every piece it sends or receives,
        agree, then send and receive the pieces, and agree again."""
        stats = self.stats
        stats.batches += 1
        error: BaseException | None = None
        moves = _Moves()
        t0 = time.perf_counter()
        nread = 0
        try:
            bufs: dict[int, torch.Tensor] = {}  # index in the batch -> the whole block, read for others
            jobs = []
            for k, p in enumerate(batch):
                if p.reader != self.rank:
                    continue
                if all(r == self.rank for r, _, _ in p.pieces):
                    jobs.append((None, self.job(p)))
                else:
                    bufs[k] = buf = torch.empty(p.box[1], dtype=torch_dtype(p.dtype))
                    jobs.append((k, self.job(p, buf)))
            nread = self._run(jobs)
            stats.blocks_read += len(jobs)
            with torch.no_grad():
                for k, buf in bufs.items():  # verified: this rank's own overlaps copied out
                    for v, o, c in self.hits(batch[k]):
                        v[box_slices(c, o)].copy_(buf[box_slices(c, batch[k].box[0])])
            # the pieces' copies and buffers too, so that a failure to make one (memory) fails every
            # rank here, never leaves a peer waiting on a send or receive for the group's timeout
            self._prepare(batch, bufs, moves)
        except Exception as e:  # noqa: BLE001 - every rank learns of it before a piece is sent
            error = e
        stats.read_s += time.perf_counter() - t0
        _agree(error, self.group, stats)
        t1 = time.perf_counter()
        error = self._transfer(moves)
        stats.transfer_s += time.perf_counter() - t1
        # the transfer's own agreement: a rank that failed there (a wait, a copy into place, memory)
        # must not raise alone while the others go on to the next batch's all-reduce and wait for
        # the group's timeout (SPEC.md §16.2, "Failures"); one more all-reduce per batch
        _agree(error, self.group, stats)
        return nread

    def _transfer(self, moves: _Moves) -> BaseException | None:
        """Send and receive the batch's pieces and copy those received through buffers into place;
        return the first error instead of raising it (the caller agrees on it).

        Every send and receive is posted and every one posted is waited on, whatever failed: a
        peer's send or receive need not complete until this rank posts and serves its match, so a
        rank that stopped at its first failure could leave them pending for the group's timeout, and
        a send left pending (not waited, nor abortable on the peer's side) could later match a
        receive of the same peer and tag (tags restart with each batch) and land stale bytes.
        Every peer posts its matching operations unconditionally after the batch's agreement, so
        these waits complete; only a send or receive whose posting itself failed (the transport
        failing) leaves its peer waiting, for the group's timeout, as any collective would."""
        stats = self.stats
        error: BaseException | None = None
        g = (lambda r: dist.get_global_rank(self.group, r)) if self.group is not None else (lambda r: r)
        works = []
        for post, peer, todo in ((dist.isend, "dst", moves.sends), (dist.irecv, "src", moves.recvs)):
            for t, r, tag in todo:
                try:
                    works.append(post(t, **{peer: g(r)}, group=self.group, tag=tag))
                except Exception as e:  # noqa: BLE001 - post the others still: their peers wait on them
                    error = error or e
        for t, _, _ in moves.sends:
            stats.bytes_sent += t.numel() * t.element_size()
        for t, _, _ in moves.recvs:
            stats.bytes_received += t.numel() * t.element_size()
        stats.pieces_sent += len(moves.sends)
        stats.pieces_received += len(moves.recvs)
        for w in works:
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001 - wait on the others still, as above
                error = error or e
        try:
            bump = getattr(torch.autograd.graph, "increment_version", None)
            for d in moves.direct if bump is not None else ():
                bump(d)  # written in place, as a read or copy_ is: autograd refuses a graph that saved the old values
            if error is None:  # after a failed wait a buffer may hold no piece: nothing copied from any
                with torch.no_grad():
                    for d, tmp in moves.strips:
                        d.copy_(tmp)
        except Exception as e:  # noqa: BLE001 - the caller's agreement fails every rank with it
            error = error or e
        return error

    def _prepare(self, batch: list[PlannedRead], bufs: dict[int, torch.Tensor], moves: _Moves) -> None:
        """Every piece of the batch this rank sends (a view of its verified block, or a copy of a
        piece not contiguous there) or receives (straight into a contiguous CPU destination, or into
        a buffer copied into place afterwards), with its peer and tag."""
        rank = self.rank
        # pieces copied out (not contiguous in their block), alive until sent: one copy per box, however
        # many ranks hold it (replicas), so they stay within the batch's blocks
        copies: dict[tuple[int, Box], torch.Tensor] = {}
        # tags: a count per pair of ranks, in plan order (block, then region): the reader numbers the
        # pieces it sends to each rank, the receiver those it takes from each reader, alike
        sent: dict[int, int] = {}
        taken: dict[int, int] = {}
        for k, p in enumerate(batch):
            for r, region, c in p.pieces:
                if r == p.reader:
                    continue
                if rank == p.reader:
                    tag = sent[r] = sent.get(r, 0) + 1
                    out = bufs[k][box_slices(c, p.box[0])]
                    if not out.is_contiguous():
                        copy = copies.get((k, c))
                        if copy is None:
                            copy = copies[(k, c)] = out.contiguous()
                            self.stats.bytes_copied_out += copy.numel() * copy.element_size()
                        out = copy
                    moves.sends.append((out, r, tag))
                    continue
                if r != rank:  # (a plan made for this rank holds no other rank's pieces of another's block)
                    continue
                tag = taken[p.reader] = taken.get(p.reader, 0) + 1
                dests = [v[box_slices(c, o)] for v, o in self.locals_[p.key].dests[region]]
                # Gloo receives into a tensor's raw pointer whatever its device: only CPU memory in place
                if len(dests) == 1 and dests[0].is_contiguous() and dests[0].device.type == "cpu":
                    moves.recvs.append((dests[0], p.reader, tag))
                    moves.direct.append(dests[0])
                else:
                    tmp = torch.empty(c[1], dtype=torch_dtype(p.dtype))
                    moves.recvs.append((tmp, p.reader, tag))
                    moves.strips += [(d, tmp) for d in dests]

    def _run(self, jobs: list[tuple[int | None, BlockRead]]) -> int:
        """The batch's reads, ``threads`` at a time, each thread staging through one reused buffer."""
        stage = staging()
        if self.threads <= 1 or len(jobs) <= 1:
            return sum(job(stage) for _, job in jobs)
        with ThreadPoolExecutor(max_workers=min(self.threads, len(jobs))) as pool:
            return sum(pool.map(lambda kj: kj[1](stage), jobs))
