"""The canonical block grid of a tensor, and chunked payloads (SPEC.md §Chunked payloads).

A tensor larger than ``BLOCK_BYTES`` is stored as several objects, the blocks of a grid
that is a function of its dtype and shape only. Never of how it was split when it was
saved, so a tensor written whole, by pipeline slots, by FSDP2 on any number of ranks or
by tensor parallelism has the same objects, and the same learned-state root.

**The tile grid** (format version 4, what every writer produces): start from the whole
shape and, while a tile holds more than ``BLOCK_BYTES``, halve (rounding up) its largest
extent (the first such dim on a tie). So the extent on dim ``k`` is ``ceil(d_k / 2^m_k)``:
every dim is cut into a power-of-two number of equal pieces, the tiles are as square as the
bound allows, and a slice along any dim (FSDP2's and ``Shard(0)``'s rows, ``Shard(1)``'s
columns, both on a 2-D mesh) overlaps only the tiles it needs plus those its edges cut.
A tile is a box, not one byte range of the tensor: writers gather it (``t[box]``, torch's
strided copy) and readers scatter it (a buffer copied into the destination's view).

**The row-band grid** (versions 2 and 3, still read and checked, never written; ``bands=True``):
let ``inner(k)`` be the bytes of one step along dim ``k`` (itemsize times the dims after
``k``) and ``k`` the first dim with ``inner(k) <= BLOCK_BYTES``. Every block has extent 1
on the dims before ``k``, ``r = BLOCK_BYTES // inner(k)`` indices of dim ``k`` (fewer in the
last block of a run) and the whole of every later dim: bands of whole rows, each one
contiguous byte range (which is why a column split read every block).

A tensor of at most ``BLOCK_BYTES`` is one block on both grids, whose payload is a single
object id, exactly as in format version 1. This module knows nothing of DTensor or processes.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..errors import CorruptObject, GridError, ObjectNotFound, TensorMismatch
from .lazy import torch
from .manifest import MAX_BLOCKS, Block, Payload, TensorEntry, is_chunked, state_payloads, tensor_payloads
from .tensors import ITEMSIZES, Staging, dtype_name, expected_nbytes, is_dtensor, torch_dtype

__all__ = [
    "BlockStore",
    "BLOCK_BYTES",
    "Box",
    "StoredPayload",
    "grid",
    "block_views",
    "tile_shape",
    "block_count",
    "intersect",
    "box_slices",
    "payload_blocks",
    "overlapping",
    "grid_problems",
    "on_bands",
    "check_payload",
    "check_stored",
    "check_stored_all",
    "check_reads",
    "BlockRead",
    "READ_AHEAD_BYTES",
    "READ_AHEAD_THREADS",
    "ReadAheadStore",
    "make_payload",
    "put_payloads",
    "read_jobs",
    "read_parts",
    "read_whole",
    "run_reads",
    "staging",
]


class BlockStore(Protocol):
    """What the grid's reads and writes need of a store (``shardstore.Store`` is one): sized
    lookups, verified reads into a tensor or as a new one, and a batch of tensor writes."""

    def object_size(self, oid: str) -> int | None: ...

    def read_into(self, oid: str, out: torch.Tensor, *, what: str) -> object: ...

    def get_tensor(self, oid: str, dtype: str, shape: tuple[int, ...], *, what: str) -> torch.Tensor: ...

    def put_tensors(self, tensors: Sequence[torch.Tensor], *, threads: int = ..., batch: Any = ...) -> list[str]: ...


#: The block bound of format versions 2-4: 4 MiB. Part of the format: changing it changes ids.
BLOCK_BYTES = 1 << 22

#: The most a thread's staging buffer holds (``staging``): any block of the grid (at most
#: ``BLOCK_BYTES``) with room to spare; larger objects (format version 1) are read into memory of their own.
STAGING_BYTES = 2 * BLOCK_BYTES

#: A box of a tensor: (start index on each dim, extent on each dim).
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class StoredPayload:
    """A tensor whose blocks another step already wrote (DTensor capture); ``write_shard``
    records its payload as it is. ``dtype`` and ``shape`` are the whole tensor's."""

    payload: Payload
    dtype: torch.dtype
    shape: tuple[int, ...]


def tile_shape(dtype: str, shape: Sequence[int], *, block_bytes: int = BLOCK_BYTES) -> tuple[int, ...]:
    """The extent of the tile grid's first tile (SPEC.md §5.1, version 4): the shape, its
    largest extent halved (rounded up; the first such dim on a tie) while it exceeds the bound."""
    item = ITEMSIZES[dtype]
    t = [int(d) for d in shape]
    while item * math.prod(t) > block_bytes:  # ends: a tile of extent 1 everywhere is item <= 8 bytes
        k = max(range(len(t)), key=lambda d: (t[d], -d))
        t[k] = -(-t[k] // 2)
    return tuple(t)


def _tile_count(shape: tuple[int, ...], tile: tuple[int, ...]) -> int:
    return math.prod(-(-d // n) for d, n in zip(shape, tile)) if math.prod(shape) else 1


def _split(dtype: str, shape: tuple[int, ...], block_bytes: int) -> tuple[int, int, int]:
    """(k, r, number of blocks) of the row-band grid (versions 2-3), computed without listing the blocks."""
    item = ITEMSIZES[dtype]
    if math.prod(shape) * item <= block_bytes:
        return -1, 0, 1
    k = next(k for k in range(len(shape)) if item * math.prod(shape[k + 1 :]) <= block_bytes)
    r = min(shape[k], block_bytes // (item * math.prod(shape[k + 1 :])))
    return k, r, math.prod(shape[:k]) * -(-shape[k] // r)


def block_count(dtype: str, shape: Sequence[int], *, block_bytes: int = BLOCK_BYTES, bands: bool = False) -> int:
    """How many blocks the canonical grid has (cheap for any shape, even a forged one);
    ``bands``: the row-band grid of versions 2 and 3."""
    shape = tuple(int(d) for d in shape)
    if bands:
        return _split(dtype, shape, block_bytes)[2]
    return _tile_count(shape, tile_shape(dtype, shape, block_bytes=block_bytes))


def grid(dtype: str, shape: Sequence[int], *, block_bytes: int = BLOCK_BYTES, bands: bool = False) -> list[Box]:
    """The canonical blocks of a ``dtype`` tensor of ``shape``, in C order of their starts:
    the tile grid, or with ``bands`` the row-band grid of versions 2 and 3 (SPEC.md §5.1).

    GridError if there would be more than ``MAX_BLOCKS`` (checked before listing any)."""
    shape = tuple(int(d) for d in shape)
    if not bands:
        tile = tile_shape(dtype, shape, block_bytes=block_bytes)
        count = _tile_count(shape, tile)
        if count > MAX_BLOCKS:
            raise GridError(
                f"a {dtype}{list(shape)} tensor would have {count} blocks, more than the limit of {MAX_BLOCKS} (SPEC.md §Limits)"
            )
        if count == 1:
            return [((0,) * len(shape), shape)]
        runs = [[(j, min(n, d - j)) for j in range(0, d, n)] for d, n in zip(shape, tile)]
        return [(tuple(r[0] for r in combo), tuple(r[1] for r in combo)) for combo in itertools.product(*runs)]
    k, r, count = _split(dtype, shape, block_bytes)
    if count > MAX_BLOCKS:
        raise GridError(
            f"a {dtype}{list(shape)} tensor would have {count} blocks, more than the limit of {MAX_BLOCKS} (SPEC.md §Limits)"
        )
    if k < 0:
        return [((0,) * len(shape), shape)]
    out: list[Box] = []
    for outer in _indices(shape[:k]):
        for j in range(0, shape[k], r):
            out.append(
                (outer + (j,) + (0,) * (len(shape) - k - 1), (1,) * k + (min(r, shape[k] - j),) + shape[k + 1 :])
            )
    return out


def _indices(dims: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for d in dims:
        out = [o + (i,) for o in out for i in range(d)]
    return out


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None if they share no element. (A plain loop: a
    save's block plan calls this once per piece, millions of times at thousands of ranks.)"""
    start, extent = [], []
    for x, m, y, n in zip(a[0], a[1], b[0], b[1]):
        lo = x if x > y else y
        hi = x + m if x + m < y + n else y + n
        if hi <= lo:
            return None
        start.append(lo)
        extent.append(hi - lo)
    return tuple(start), tuple(extent)


def box_slices(box: Box, origin: Sequence[int]) -> tuple[slice, ...]:
    """Slices selecting ``box`` from a tensor whose element 0 sits at ``origin``."""
    return tuple(slice(s - o, s - o + n) for s, n, o in zip(box[0], box[1], origin))


def _offset(shape: tuple[int, ...], start: tuple[int, ...]) -> int:
    """C-order linear index of ``start``."""
    off = 0
    for d, s in zip(shape, start):
        off = off * d + s
    return off


def payload_blocks(payload: Payload, dtype: str, shape: Sequence[int]) -> list[tuple[str, Box, int]]:
    """(object id, box, byte size) of each block of a payload (one for a single object)."""
    shape = tuple(shape)
    if isinstance(payload, str):  # one object (is_chunked's other case)
        return [(payload, ((0,) * len(shape), shape), expected_nbytes(dtype, shape))]
    return [(b.object, (tuple(b.start), tuple(b.shape)), expected_nbytes(dtype, tuple(b.shape))) for b in payload]


def overlapping(payload: Payload, dtype: str, shape: Sequence[int], region: Box) -> list[int]:
    """Indices of the blocks of ``payload`` that share an element with ``region``."""
    return [
        i for i, (_, box, _) in enumerate(payload_blocks(payload, dtype, shape)) if intersect(box, region) is not None
    ]


def grid_problems(
    payload: Payload, dtype: str, shape: Sequence[int], *, bands: bool = False, whole: bool = False
) -> list[str]:
    """What is wrong with a payload's blocks for a ``dtype`` tensor of ``shape`` (empty: nothing);
    ``bands``: checked against the row-band grid (a manifest of version 2 or 3). ``whole``: one
    object is accepted at any size (a manifest of version 1: format 1 stored every tensor as one
    object, and its stores stay readable, SPEC.md §5.1); the block-count limit holds all the same."""
    shape = tuple(shape)
    nbytes = expected_nbytes(dtype, shape)
    count = block_count(dtype, shape, bands=bands)
    if count > MAX_BLOCKS:  # a forged shape: refused before anything is listed or allocated
        return [f"its {nbytes} bytes would need {count} blocks, more than the limit of {MAX_BLOCKS} (SPEC.md §Limits)"]
    if isinstance(payload, str):  # one object (is_chunked's other case)
        if count > 1 and not whole:
            return [
                f"its {nbytes} bytes exceed the {BLOCK_BYTES}-byte block bound, so its payload must be {count} blocks, not one object"
            ]
        return []
    blocks = list(payload)
    if count == 1:
        return [f"it fits one block ({nbytes} bytes <= {BLOCK_BYTES}) but its payload lists {len(blocks)} blocks"]
    # The grid is listed only when the payload lists as many blocks: a forged shape's count
    # (up to MAX_BLOCKS) must not make a one-line entry cost a million boxes (SPEC.md §Limits).
    canon = grid(dtype, shape, bands=bands) if len(blocks) == count else []
    if canon and all(tuple(b.start) == c[0] and tuple(b.shape) == c[1] for b, c in zip(blocks, canon)):
        return []  # the canonical grid; what follows only says how a payload differs from it
    for i, b in enumerate(blocks):
        if len(b.start) != len(shape) or len(b.shape) != len(shape):
            return [f"block {i} (object {b.object}) has {len(b.start)}/{len(b.shape)} dims for a {len(shape)}-d tensor"]
        if any(n == 0 or s + n > d for s, n, d in zip(b.start, b.shape, shape)):
            return [
                f"block {i} (object {b.object}) at {list(b.start)} of extent {list(b.shape)} is empty or lies outside shape {list(shape)}"
            ]
    order = sorted(range(len(blocks)), key=lambda i: tuple(blocks[i].start))
    pairs = (
        zip(order, order[1:])
        if len(blocks) > 512
        else ((i, j) for i in range(len(blocks)) for j in range(i + 1, len(blocks)))
    )
    for i, j in pairs:
        a, b = blocks[i], blocks[j]
        if intersect((tuple(a.start), tuple(a.shape)), (tuple(b.start), tuple(b.shape))) is not None:
            return [
                f"blocks {min(i, j)} and {max(i, j)} (objects {blocks[min(i, j)].object}, {blocks[max(i, j)].object}) overlap"
            ]
    covered = sum(math.prod(b.shape) for b in blocks)
    if covered != math.prod(shape):
        return [
            f"its {len(blocks)} blocks cover {covered} of {math.prod(shape)} elements: they do not tile shape {list(shape)}"
        ]
    if len(blocks) != count:
        return [f"its payload lists {len(blocks)} blocks; the canonical grid has {count}"]
    for i, (b, (start, extent)) in enumerate(zip(blocks, canon)):
        if tuple(b.start) != start or tuple(b.shape) != extent:
            return [
                f"block {i} (object {b.object}) is at {list(b.start)} of extent {list(b.shape)}; "
                f"the canonical grid's block {i} is at {list(start)} of extent {list(extent)}"
            ]
    return []


def on_bands(entries: Iterable[TensorEntry]) -> bool:
    """Whether the chunked payloads of ``entries`` (taken from a stored commit) are on the
    row-band grid of versions 2 and 3 rather than the tile grid: a manifest naming them
    again (a metadata-only transition) keeps their version's grid (SPEC.md §Versioning)."""
    for e in entries:
        for _, payload, dtype in tensor_payloads(e):
            if is_chunked(payload) and grid_problems(payload, dtype, e.shape):
                return True
        for _, payload, dtype, shape in state_payloads(e):
            if is_chunked(payload) and grid_problems(payload, dtype, shape):
                return True
    return False


def check_payload(
    payload: Payload, dtype: str, shape: Sequence[int], what: str, *, bands: bool = False, whole: bool = False
) -> None:
    """Raise GridError naming ``what`` (tensor and role) if the payload is not the canonical grid
    (``bands``, ``whole``: as for ``grid_problems``)."""
    for msg in grid_problems(payload, dtype, shape, bands=bands, whole=whole):
        raise GridError(f"{what}: {msg} (SPEC.md §Chunked payloads)")


def check_stored(store: BlockStore, payload: Payload, dtype: str, shape: Sequence[int], what: str) -> None:
    """Before a tensor of a manifest's ``dtype`` and ``shape`` is allocated: every object of its
    payload is in the store with the byte size its block implies (elements x itemsize), so no
    allocation is driven by an unchecked shape (SPEC.md §Limits); one size query per object.
    ObjectNotFound or TensorMismatch naming ``what`` (tensor and role) and the block."""
    check_stored_all(store, [(payload, dtype, shape, what)])


def check_stored_all(
    store: BlockStore, tensors: Sequence[tuple[Payload, str, Sequence[int], str]], *, threads: int = 16
) -> None:
    """``check_stored`` for each (payload, dtype, shape, what), the size queries ``threads`` at
    a time (on S3 each is a HEAD request); the first failure in the given order is raised."""
    checks = []
    for payload, dtype, shape, what in tensors:
        blocks = payload_blocks(payload, dtype, shape)
        checks += [
            (oid, box, n, what if len(blocks) == 1 else f"{what}, block {i}", dtype)
            for i, (oid, box, n) in enumerate(blocks)
        ]
    _check_sizes(store, checks, threads, "refused before allocating (SPEC.md §Limits)")


def check_reads(store: BlockStore, reads: Sequence[BlockRead], *, threads: int = 16) -> None:
    """Before the first of ``reads`` runs: every block they read is in the store with the byte
    size its box implies, so that a missing or wrong-sized object is refused before any byte
    lands in a destination (SPEC.md §16), not after the blocks read before it. One size query
    per object, ``threads`` at a time (on S3 listing pages for all of them); ObjectNotFound or
    TensorMismatch naming the tensor, the block and the object."""
    checks = [(r.oid, r.box, r.n, r.what, r.dtype) for r in reads]
    _check_sizes(store, checks, threads, "refused before any byte was written into a destination (SPEC.md §16)")


def _check_sizes(
    store: BlockStore, checks: Sequence[tuple[str, Box, int, str, str]], threads: int, refused: str
) -> None:
    """(object, box, bytes it needs, label, dtype) each: one size query per distinct object, or
    one set of listings for all of them where the store has them (``Store.object_sizes`` on S3)."""
    if not checks:
        return
    oids = list(dict.fromkeys(c[0] for c in checks))
    sizes: dict[str, int | None]
    listed = getattr(store, "lists_sizes", None)  # a store answering for many objects at once (S3)
    if len(oids) > 1 and listed is not None and listed():
        sizes = dict(store.object_sizes(oids))  # type: ignore[attr-defined]
    elif len(oids) == 1 or threads <= 1:
        sizes = {oid: store.object_size(oid) for oid in oids}
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(oids))) as pool:
            sizes = dict(zip(oids, pool.map(store.object_size, oids)))
    for oid, box, n, label, dtype in checks:
        have = sizes.get(oid)
        if have is None:
            raise ObjectNotFound(f"{label}: object {oid} is not in the store; {refused}")
        if have != n:
            raise TensorMismatch(
                f"{label}: object {oid} holds {have} bytes, but {dtype}{list(box[1])} needs {n}; {refused}"
            )


def make_payload(
    dtype: str, shape: Sequence[int], ids: Sequence[str], *, block_bytes: int = BLOCK_BYTES, bands: bool = False
) -> Payload:
    """The payload naming ``ids``, the objects of the canonical blocks in order."""
    canon = grid(dtype, shape, block_bytes=block_bytes, bands=bands)
    if len(ids) != len(canon):
        raise GridError(f"{len(ids)} block ids for a grid of {len(canon)} blocks")
    if len(canon) == 1:
        return ids[0]
    return tuple(Block(start=start, shape=extent, object=oid) for (start, extent), oid in zip(canon, ids))


def _block_views(t: torch.Tensor, dtype: str, bands: bool = False) -> list[torch.Tensor]:
    """Views of a whole tensor's canonical blocks: a tile that is one byte range of a
    contiguous ``t`` is a 1-d view of it, any other a strided view (``put_tensors`` gathers
    its bytes in C order of the tile, one tile at a time)."""
    shape = tuple(t.shape)
    boxes = grid(dtype, shape, bands=bands)
    if len(boxes) == 1:
        return [t]
    t = t.detach()
    flat = t.reshape(-1) if t.is_contiguous() else None
    out = []
    for start, extent in boxes:
        view = t[box_slices((start, extent), (0,) * len(shape))]
        if flat is not None and view.is_contiguous():
            lo = _offset(shape, start)
            view = flat[lo : lo + math.prod(extent)]
        out.append(view)
    return out


def block_views(t: torch.Tensor) -> list[torch.Tensor]:
    """Views of a whole tensor's canonical blocks (the tile grid), in payload order: what
    ``put_payloads`` hashes and writes for it (``put_tensors`` gathers a strided view's bytes in C
    order, as ``tensors.tensor_bytes`` does)."""
    return _block_views(t, dtype_name(t.dtype))


def put_payloads(
    store: BlockStore,
    tensors: Sequence[torch.Tensor | StoredPayload],
    *,
    threads: int | None = None,
    bands: bool = False,
    batch: Any = None,
) -> list[Payload]:
    """Store each whole tensor as its canonical blocks; return one payload per input, in order.
    ``bands``: on the row-band grid, for a tensor joining the entries of a version 2 or 3
    commit in a metadata-only transition (``on_bands``), which keeps that commit's grid.
    ``threads``: blocks hashed and written at once (None: the store's default).

    All blocks go to ``store.put_tensors`` in one batch (hashed once, written once, one
    durability barrier; with ``batch``, a ``Store.write_batch()``, they join it and become
    durable at its ``finish``); ``StoredPayload`` inputs pass through unchanged.
    """

    views: list[torch.Tensor] = []
    spans: list[tuple[int, int] | None] = []
    for t in tensors:
        if isinstance(t, StoredPayload):
            spans.append(None)
            continue
        if is_dtensor(t):
            raise TensorMismatch(
                f"a DTensor of shape {list(t.shape)} holds only this process's slice: save_distributed writes "
                "DTensor parameters and optimizer state over its process group (SPEC.md §Block exchange)"
            )
        blocks = _block_views(t, dtype_name(t.dtype), bands)
        spans.append((len(views), len(blocks)))
        views += blocks
    if not views:
        ids: list[str] = []
    elif threads is None:
        ids = store.put_tensors(views, batch=batch)
    else:
        ids = store.put_tensors(views, threads=threads, batch=batch)
    out: list[Payload] = []
    for t, span in zip(tensors, spans):
        if isinstance(t, StoredPayload):
            out.append(t.payload)
        else:
            assert span is not None  # every tensor that is not a StoredPayload was given a span above
            out.append(make_payload(dtype_name(t.dtype), tuple(t.shape), ids[span[0] : span[0] + span[1]], bands=bands))
    return out


def read_jobs(
    store: BlockStore,
    payload: Payload,
    dtype: str,
    shape: Sequence[int],
    local: torch.Tensor,
    origin: Sequence[int],
    what: str,
) -> list[BlockRead]:
    """Jobs that fill ``local`` (the box of the tensor starting at ``origin``) from the blocks it overlaps."""
    return read_parts(store, payload, dtype, shape, [(local, tuple(origin))], what)


def read_parts(
    store: BlockStore,
    payload: Payload,
    dtype: str,
    shape: Sequence[int],
    parts: Sequence[tuple[torch.Tensor, Sequence[int]]],
    what: str,
) -> list[BlockRead]:
    """Jobs that fill each ``(view, origin)`` of ``parts`` (disjoint boxes of the tensor, each
    starting at ``origin``: a DTensor's local tensor, SPEC.md §Slices on the grid) from the
    blocks they overlap.

    Each job reads one whole block, once however many parts it overlaps, verified against
    its id, and returns the bytes it read. A block that lies wholly inside one part and is
    contiguous there is read straight into it; any other is read into a buffer of its own
    size and each common box copied. A block is never read in part: its id covers all its bytes.
    """
    regions = [(view, (tuple(o), tuple(view.shape))) for view, o in parts]
    jobs: list[BlockRead] = []
    for i, (oid, box, n) in enumerate(payload_blocks(payload, dtype, shape)):
        hits = []
        for view, region in regions:
            common = intersect(box, region) if math.prod(box[1]) > 0 else (box if box == region else None)
            if common is not None:
                hits.append((view, region[0], common))
        if hits:
            label = what if not is_chunked(payload) else f"{what}, block {i}"
            jobs.append(BlockRead(store, oid, box, tuple(hits), n, dtype, label))
    return jobs


@dataclass(frozen=True, eq=False)  # holds destination tensors: compared by identity
class BlockRead:
    """One block a read fills destinations from: its object, its box in the tensor, its byte
    size and where it lands (``hits``: each destination view, its origin and the common box).
    Calling it reads the block whole, verified against its id, and returns the bytes read;
    ``check_reads`` checks a list of them before any runs."""

    store: BlockStore
    oid: str
    box: Box
    hits: tuple[tuple[torch.Tensor, tuple[int, ...], Box], ...]
    n: int
    dtype: str
    what: str

    def __call__(self, stage: Staging | None = None) -> int:
        """Read the block; ``stage`` (``staging()``): the calling thread's buffer for a block that
        cannot land in place, reused from block to block (None: memory of its own each time).
        The object is read once, by ``read_into``, whatever the destination: into it in place
        when it is the whole block in contiguous CPU memory, else into a CPU buffer copied out
        from (a read that went through ``get_tensor`` would leave a peer's copy held by its
        tier, ``backends.tiers.PeerCopies``, where ``read_into`` takes it and lets it go)."""
        if len(self.hits) == 1:
            local, origin, common = self.hits[0]
            dest = local[box_slices(common, origin)]
            if common == self.box and dest.is_contiguous() and dest.device.type == "cpu":
                self.read(dest)
                return self.n
        buf = stage.take(self.dtype, self.box[1]) if stage is not None else None
        if buf is None:
            buf = torch.empty(self.box[1], dtype=torch_dtype(self.dtype))
        self.read(buf)  # verified (or raised) before any byte is copied out
        self.fill(buf)
        return self.n

    def read(self, out: torch.Tensor) -> None:
        """Read the block's object into ``out`` (its size in bytes), verified against its id;
        a missing or corrupt object is named by tensor and block."""
        store, oid, what = self.store, self.oid, self.what
        try:
            store.read_into(oid, out, what=what)
        except ObjectNotFound as e:  # a partial store (copy --shard K) lacks it: say which tensor and block
            raise ObjectNotFound(
                f"{what}: object {oid} is not in the store ({str(e).removeprefix(what + ': ')}) (SPEC.md §Slices held)"
            ) from None
        except CorruptObject as e:  # the backends without a streaming read name only the object
            if what in str(e):
                raise
            raise CorruptObject(f"{what}: {e}") from None

    def fill(self, buf: torch.Tensor) -> None:
        """Copy the block ``buf`` (already verified, in this block's dtype and shape) into every destination."""
        box = self.box
        with torch.no_grad():
            for local, origin, common in self.hits:
                local[box_slices(common, origin)].copy_(buf[box_slices(common, box[0])])


@dataclass(frozen=True, eq=False)  # holds destination tensors: compared by identity
class _OneObject:
    """Blocks that name one object as different dtypes or block shapes (the same bytes read as
    float32 here and int32 there, or as a 2 x 4 block and an 8-element one), read as one job:
    the object is read once into a byte buffer, verified, and each block is filled from a view
    of it in its own dtype and shape (``_once_per_object``). Stands in for a ``BlockRead`` in
    ``run_reads``: ``store``, ``oid`` and ``n`` are the object's."""

    jobs: tuple[BlockRead, ...]

    @property
    def store(self) -> BlockStore:
        return self.jobs[0].store

    @property
    def oid(self) -> str:
        return self.jobs[0].oid

    @property
    def n(self) -> int:
        return self.jobs[0].n

    def __call__(self, stage: Staging | None = None) -> int:
        lead = self.jobs[0]
        # the thread's reused buffer where it fits, as a ``BlockRead`` stages (no fresh pages each block)
        raw = stage.take("uint8", (lead.n,)) if stage is not None else None
        if raw is None:
            raw = torch.empty(lead.n, dtype=torch.uint8)
        # read as the lead's block: an object of another size is refused naming its dtype and
        # shape, as ``BlockRead`` alone names them (not the byte buffer it is read into)
        lead.read(raw.view(torch_dtype(lead.dtype)).view(lead.box[1]))
        # the object has lead.n bytes (verified): a block needing another size is refused as
        # ``check_reads`` refuses it, before any destination is filled (the object is not corrupt)
        for job in self.jobs:
            if job.n != lead.n:
                raise TensorMismatch(
                    f"{job.what}: object {job.oid} holds {lead.n} bytes, but {job.dtype}{list(job.box[1])} "
                    f"needs {job.n} (SPEC.md §Tensor objects)"
                )
        for job in self.jobs:
            job.fill(raw.view(torch_dtype(job.dtype)).view(job.box[1]))
        return lead.n


#: A job ``run_reads`` runs: a block, or one object read once for blocks of several dtypes or shapes.
_Read = BlockRead | _OneObject

#: Bytes of blocks ``run_reads`` asks the store for ahead of the block each job starts on, when
#: it reads on at most ``READ_AHEAD_THREADS`` threads. The device then reads the next blocks
#: while the thread hashes and copies the one that has landed, as a long sequential read of one
#: file keeps it busy: without it each object's read began cold and ramped its own readahead up
#: from a few pages, the disk idle while the thread hashed (benchmarks/RESULTS.md, "read-ahead").
READ_AHEAD_BYTES = 64 << 20
#: The most reading threads ``run_reads`` reads ahead for. More threads keep as many reads in
#: flight themselves, and the kernel fills read-ahead pages in 4 KiB folios (a plain read's
#: later windows use large ones), which cost more CPU to copy out: at 8 threads a restore used
#: about a third more CPU with read-ahead and was no faster (benchmarks/RESULTS.md, "read-ahead").
#: At 2 threads two reads in flight kept the device as busy as the advice did, and the advice's
#: small folios cost CPU the ranks of a load share: ``bench_dcp`` on a quiet machine loaded at
#: 1.03-1.08x FileSystemReader on 2 threads without it against 0.85-0.99x with it (RESULTS.md,
#: "One reading thread reads ahead, two do not"). (Those runs advised with WILLNEED; the local
#: backend now starts the kernel's own windows, large folios, ``backends.posix.read_ahead``: the
#: bound was not measured again.)
READ_AHEAD_THREADS = 1


@runtime_checkable
class ReadAheadStore(Protocol):
    """A store that can start fetching a block before it is read (``Store.read_ahead``: the
    kernel's readahead of a local object); advisory, it changes nothing a read returns."""

    def read_ahead(self, oid: str) -> None: ...


class _ReadAhead:
    """Keeps ``window`` bytes of blocks asked for ahead of the jobs started: when job ``i``
    starts, every job starting less than ``window`` bytes after it has been asked for (jobs
    start in order, whatever the thread count)."""

    def __init__(self, jobs: Sequence[_Read], window: int) -> None:
        self.jobs = jobs
        self.starts = list(itertools.accumulate((job.n for job in jobs), initial=0))
        self.window = window
        self.next = 0  # the first job not yet asked for
        self.lock = threading.Lock()
        stores = {id(job.store): job.store for job in jobs}
        self.able = {k: isinstance(st, ReadAheadStore) for k, st in stores.items()}  # once: a Protocol check is slow

    def __call__(self, i: int) -> None:
        # the calls inside the lock: a thread starting a job another thread has just claimed waits
        # until it has been asked for (outside, that thread read it first; on a busy machine most
        # of a 2-thread read came before its advice). At most a window's worth of calls (open +
        # a few one-page reads + close each) at the first job, about one per job after it.
        with self.lock:
            limit = self.starts[i] + self.window
            while self.next < len(self.jobs) and self.starts[self.next] < limit:
                job = self.jobs[self.next]
                if self.able[id(job.store)]:
                    job.store.read_ahead(job.oid)  # type: ignore[attr-defined]  (ReadAheadStore, checked above)
                self.next += 1


def staging() -> Staging:
    """Staging buffers for ``BlockRead`` jobs (one per thread that runs them, at most ``STAGING_BYTES`` each)."""
    return Staging(STAGING_BYTES)


def run_reads(
    jobs: Sequence[BlockRead], *, threads: int, window: int | None = None, once_per_object: bool = False
) -> int:
    """Run ``jobs`` (already checked: ``check_reads``), ``threads`` at a time, each thread
    staging through one reused buffer, with ``window`` bytes of blocks asked for ahead of them
    (``ReadAheadStore``; None: ``READ_AHEAD_BYTES`` on up to ``READ_AHEAD_THREADS`` threads, else
    none; 0: none); return the bytes read. ``once_per_object``: jobs reading the same object (as
    any dtype and block shape) are merged, so that it is read once (``_once_per_object``). The
    first failure is raised."""
    stage = staging()
    if len(jobs) <= 1:
        return sum(job(stage) for job in jobs)
    order = _in_arrival_order(_once_per_object(jobs) if once_per_object else jobs)
    if window is None:
        window = READ_AHEAD_BYTES if threads <= READ_AHEAD_THREADS else 0
    ahead = _ReadAhead(order, window) if window > 0 else None

    def run(i: int) -> int:
        if ahead is not None:
            ahead(i)
        return order[i](stage)

    if threads <= 1:
        return sum(run(i) for i in range(len(order)))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(run, range(len(order))))


def _once_per_object(jobs: Sequence[BlockRead]) -> Sequence[_Read]:
    """``jobs`` with those that read the same object merged, so that it is read once. Blocks of
    the same dtype and block shape (equal tensors, such as two zero-filled moments or two norm
    weights of ones, or equal tiles of one) become one ``BlockRead`` that fills every
    destination of each; an object also named as another dtype or block shape is read by one
    ``_OneObject`` job. A peer's copy is handed to one read and let go (SPEC.md §19.3: no tier
    keeps it), so a second read of the same object would go to the store; and a store is asked
    once instead of once per tensor."""
    first: dict[tuple[int, str, str, tuple[int, ...]], int] = {}
    leads: list[BlockRead] = []
    # each lead's followers' hits, gathered and joined to it once at the end: a new BlockRead at
    # every merge copied all the hits so far (quadratic in the blocks: thousands of equal tensors)
    more: list[list[tuple[torch.Tensor, tuple[int, ...], Box]]] = []
    for job in jobs:
        key = (id(job.store), job.oid, job.dtype, tuple(job.box[1]))
        i = first.get(key)
        if i is None:
            first[key] = len(leads)
            leads.append(job)
            more.append([])
            continue
        lead = leads[i]
        # the follower's hits in the leader's block coordinates: the same destination slices,
        # the block's bytes taken at the same place within it
        shift = [a - b for a, b in zip(lead.box[0], job.box[0])]
        more[i] += (
            (
                local,
                tuple(o + d for o, d in zip(origin, shift)),
                (tuple(c + d for c, d in zip(common[0], shift)), common[1]),
            )
            for local, origin, common in job.hits
        )
    merged = [
        BlockRead(lead.store, lead.oid, lead.box, lead.hits + tuple(hits), lead.n, lead.dtype, lead.what)
        if hits
        else lead
        for lead, hits in zip(leads, more)
    ]
    # one object under several dtypes or block shapes: one job reads it for all of them
    views: dict[tuple[int, str], list[BlockRead]] = {}
    for job in merged:
        views.setdefault((id(job.store), job.oid), []).append(job)
    if all(len(group) == 1 for group in views.values()):
        return merged if len(merged) < len(jobs) else jobs
    out: list[_Read] = []
    for job in merged:
        group = views.pop((id(job.store), job.oid), None)
        if group is not None:  # at the first job's place
            out.append(group[0] if len(group) == 1 else _OneObject(tuple(group)))
    return out


def _in_arrival_order(jobs: Sequence[_Read]) -> Sequence[_Read]:
    """``jobs`` with those whose block a peer is sending (``Store.arrival``: a restore through peer
    replicas, SPEC.md §19.3) last, in the order the blocks come, the others first as they were: the
    reading threads then wait for each copy as it lands, and it is handed to them from the
    buffer it was verified in. The order changes no byte a read returns, only when it runs."""
    arrivals: dict[int, Callable[[str], int | None] | None] = {}
    places = []
    for job in jobs:
        key = id(job.store)
        if key not in arrivals:
            arrivals[key] = getattr(job.store, "arrival", None)
        arrival = arrivals[key]
        places.append(None if arrival is None else arrival(job.oid))
    if all(p is None for p in places):
        return jobs
    order = sorted(range(len(jobs)), key=lambda i: (-1, i) if places[i] is None else (places[i], i))
    return [jobs[i] for i in order]


def read_whole(store: BlockStore, payload: Payload, dtype: str, shape: Sequence[int], what: str) -> torch.Tensor:
    """The whole tensor of a payload, every block verified (a view of the object if it is one)."""
    shape = tuple(shape)
    if not is_chunked(payload):
        return store.get_tensor(payload, dtype, shape, what=what)
    check_stored(store, payload, dtype, shape, what)  # the blocks' sizes bound the allocation
    out = torch.empty(shape, dtype=torch_dtype(dtype))
    run_reads(read_jobs(store, payload, dtype, shape, out, (0,) * len(shape), what), threads=1)
    return out
