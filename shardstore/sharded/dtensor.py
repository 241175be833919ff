"""DTensor capture and restore: sharded tensors written as canonical blocks, never gathered
(SPEC.md §Chunked payloads, §Block exchange, §Slices on the grid).

FSDP2 (``fully_shard``) keeps a dim-0 slice of every parameter and Adam moment on each
rank; tensor parallelism splits on dim 0 or dim 1; FSDP2 on top of tensor parallelism
(a 2-D mesh) gives strided shards; a ``Replicate`` placement holds the whole tensor on
several ranks. The canonical grid (``grid.py``) does not care: a block is a block
whoever holds its bytes. Saving is a collective over the save's process group:

1. every rank describes the DTensors it holds (name, role, dtype, global shape, the boxes
   of the global tensor its local tensor holds: one for Shard/Replicate layouts, maybe
   several for strided ones, ``placement.py``). The ranks first all-gather a 32-byte digest
   of their **layout** (each DTensor's name, role, dtype, global shape, mesh and
   placements; each plain tensor's name, dtype and shape: ``describe_layout``); when every
   digest is the same, each rank works out every rank's boxes from its own DTensors'
   meshes and placements (``derive_union``), so no description crosses the network (O(N)
   bytes a rank, not O(N x tensors)). Otherwise the ranks all-gather the full descriptions
   (msgspec JSON in uint8 tensors; nothing is pickled), and the errors naming ranks come
   from them;
2. from the union, every rank computes the same plan: the distinct slices must tile each
   tensor exactly; each block is owned by one rank of the slice holding most of it
   (replicas of a slice take turns, so a replicated tensor is written once, split among
   its replicas); every other slice the block overlaps sends its piece to the owner,
   point to point, from one of its replicas, so each byte crosses the network once. Each
   rank works out only its part of that plan (``plan_local``: the blocks it owns, the
   pieces it sends), from the blocks its own slices overlap; ``plan_union`` is the whole
   plan, the reference it is tested against;
3. ``exchange.py`` carries the plan out in batches of at most ``BATCH_BYTES``: the owner
   hashes and writes each block (a block inside its own slice is a view of it, no copy),
   staging the rest in one reused arena;
4. the block ids are all-reduced, and each tensor's entry (its whole payload) goes into
   the shard manifest of one rank holding part of it, chosen by a hash of the name.

Restore needs no collective: a rank reads the blocks its local tensor's parts overlap
(``grid.read_parts``), each verified whole and read once.
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from ..backends.base import CachesWrites
from ..errors import TensorMismatch
from ..format.grid import BLOCK_BYTES, Box, StoredPayload, block_views, box_slices, grid, intersect, make_payload
from ..format.slices import Gap, Overlap, make_slices, tiling_defect
from ..format.tensors import dtype_name, hash_bytes, is_dtensor, new_hasher, same_split, tensor_bytes, torch_dtype
from ..state.slot import SlotState
from ..store import Store
from ..store.tensors import WRITE_THREADS
from .agreement import check_agreement, coverage_problem
from .exchange import BATCH_BYTES, NOT_MINE, ExchangeStats, Local, PlannedBlock, last_exchange, run_plan
from .placement import local_parts, mesh_parts, placement_key

__all__ = [
    "BATCH_BYTES",
    "ExchangeStats",
    "last_exchange",
    "is_dtensor",
    "local_region",
    "slice_regions",
    "plan_blocks",
    "Described",
    "describe",
    "encode_description",
    "decode_description",
    "Layout",
    "describe_layout",
    "make_layout",
    "layouts_agree",
    "derive_union",
    "PlannedBlock",
    "ExchangePlan",
    "SliceUnion",
    "gather_union",
    "plan_union",
    "plan_local",
    "plan_exchange",
    "write_dtensors",
    "entry_slot",
    "same_split",
    "slices_near",
    "all_gather_bytes",
]


def local_region(t: torch.Tensor, what: str = "tensor") -> tuple[torch.Tensor, list[tuple[Box, tuple[int, ...]]]]:
    """(local tensor, its parts as (global box, virtual origin)): ``local[box_slices(piece, origin)]``
    selects any piece of a part's box from the local tensor (``placement.local_parts``)."""
    local, parts = local_parts(t, what)
    return local, [(box, tuple(s - lo for s, lo in zip(box[0], lo_start))) for box, lo_start in parts]


def entry_slot(name: str, holders: list[int]) -> int:
    """The slot whose shard manifest records a sharded tensor's entry: one of the ranks
    holding part of it (sorted), picked by a hash of its name."""
    return holders[zlib.crc32(name.encode()) % len(holders)]


class Described(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One DTensor as one rank holds it (the description exchanged in step 1); role ``plain``
    for a plain tensor (no boxes)."""

    name: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (start, extent) of each part of its local tensor


_DESCRIBED = msgspec.json.Decoder(list[Described])
_COPIES = msgspec.json.Decoder(tuple[dict[str, str], dict[str, str]])


def slice_regions(
    name: str, dtype: str, shape: tuple[int, ...], held: dict[Box, list[int]]
) -> list[tuple[Box, list[int]]]:
    """The distinct slices of one tensor (sorted) and the ranks holding each; TensorMismatch unless they tile it."""
    regions = sorted(held.items())
    for box, _ in regions:
        if len(box[0]) != len(shape) or any(s < 0 or s + n > d for s, n, d in zip(box[0], box[1], shape)):
            raise TensorMismatch(
                f"tensor {name!r}: a slice at {list(box[0])} of extent {list(box[1])} lies outside {list(shape)}"
            )
    defect = tiling_defect([b for b, _ in regions], shape)
    if isinstance(defect, Overlap):
        a, b = regions[defect.first][0], regions[defect.second][0]
        raise TensorMismatch(f"tensor {name!r}: slices at {list(a[0])} and {list(b[0])} overlap but are not replicas")
    if isinstance(defect, Gap):
        covered = sum(math.prod(b[1]) for b, _ in regions)
        raise TensorMismatch(
            f"tensor {name!r}: its slices cover {covered} of {math.prod(shape)} elements; "
            f"none covers the element at {list(defect.element)}"
        )
    return regions


def plan_blocks(
    key: str,
    dtype: str,
    shape: tuple[int, ...],
    regions: list[tuple[Box, list[int]]],
    *,
    block_bytes: int = BLOCK_BYTES,
) -> list[tuple[Box, int, list[tuple[int, Box]]]]:
    """For each canonical block: (box, owner rank, [(source rank, piece box)] of its other pieces).

    The owner is a rank of the slice holding most of the block (ties: the tied slices take
    turns by block index, starting at a hash of the key);
    each slice's replicas take turns by block index, so replicated bytes are split among them.
    A piece whose source is the owner (it holds that slice too) is copied, not sent.
    """
    turn = zlib.crc32(key.encode())
    used = [0] * len(regions)  # how many blocks or pieces each slice has given so far

    def pick(ri: int) -> int:
        ranks = regions[ri][1]
        used[ri] += 1
        return ranks[(turn + used[ri] - 1) % len(ranks)]

    near = slices_near(regions, len(shape))
    out = []
    for bi, box in enumerate(grid(dtype, shape, block_bytes=block_bytes)):
        pieces = [(ri, c) for ri in near(box) if (c := intersect(box, regions[ri][0])) is not None]
        if not pieces:  # an empty tensor: one empty block, written by a holder of the first slice
            out.append((box, pick(0), []))
            continue
        most = max(math.prod(c[1]) for _, c in pieces)
        tied = [ri for ri, c in pieces if math.prod(c[1]) == most]
        # Ties (a small tensor split evenly; every block of a column split) rotate over the
        # tied slices block by block, so a column split's blocks are owned by all its ranks.
        best = tied[(turn + bi) % len(tied)]
        owner = pick(best)
        # A piece of another slice the owner holds too (a strided layout: a rank's local
        # tensor is several slices) is copied by the owner itself; the rest are sent.
        out.append(
            (box, owner, [(owner if owner in regions[ri][1] else pick(ri), c) for ri, c in pieces if ri != best])
        )
    return out


def slices_near(regions: list[tuple[Box, list[int]]], ndim: int) -> Callable[[Box], list[int]]:
    """A lookup of the slices that may share an element with a box, in increasing index: those
    whose extent on one dim (the one with the most distinct starts) can reach the box's, found
    by bisection of their sorted starts. So a plan costs about one lookup per block and per
    piece, not blocks x slices (16,384 ranks' slices of a tensor of 256 blocks: 4 million
    intersections before). Empty slices share no element and are never returned."""
    live = [ri for ri, (reg, _) in enumerate(regions) if math.prod(reg[1]) > 0]
    if ndim == 0 or len(live) < 2:
        return lambda box: live
    k = max(range(ndim), key=lambda d: len({regions[ri][0][0][d] for ri in live}))
    order = sorted(live, key=lambda ri: regions[ri][0][0][k])
    starts = [regions[ri][0][0][k] for ri in order]
    reach = max(regions[ri][0][1][k] for ri in live)  # the longest extent on dim k

    def near(box: Box) -> list[int]:
        lo, hi = box[0][k], box[0][k] + box[1][k]
        # a slice starting at s with extent e <= reach overlaps [lo, hi) on dim k only if lo - reach < s < hi
        return sorted(order[bisect.bisect_right(starts, lo - reach) : bisect.bisect_left(starts, hi)])

    return near


def all_gather_bytes(raw: bytes, group: Any) -> list[bytes]:
    """Every rank's ``raw`` (any lengths), in group rank order: the sizes all-gathered, then the
    bytes padded to the longest (uint8 tensors; nothing pickled)."""
    world = dist.get_world_size(group)
    n = torch.tensor([len(raw)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    top = max(int(s.item()) for s in sizes)
    mine = torch.zeros(max(top, 1), dtype=torch.uint8)
    if raw:
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [bytes(t[: int(s.item())].numpy().tobytes()) for t, s in zip(out, sizes)]


def _items_of(state: SlotState) -> list[tuple[str, str, torch.Tensor]]:
    items = [(n, "param", t) for n, t in state.tensors.items() if is_dtensor(t)]
    for n, po in state.optim.params.items():
        for role in ("exp_avg", "exp_avg_sq"):
            m = getattr(po, role)
            if m is not None and is_dtensor(m):
                items.append((n, role, m))
        ts = getattr(po, "torch_state", None)  # any torch optimizer's state tensors (SPEC.md §9.1), by key
        for k, m in sorted(ts.tensors.items()) if ts is not None else ():
            if is_dtensor(m):
                items.append((n, f"state:{k}", m))
    return sorted(items, key=lambda x: (x[0], x[1]))


def describe(state: SlotState) -> tuple[dict[tuple[str, str], Local], list[Described]]:
    """Step 1 on one rank: its DTensors' local tensors and parts by (name, role), and the
    descriptions it sends: every DTensor's boxes, and every plain tensor (a replicated one,
    FSDP2's buffers, is written once). TensorMismatch for a placement that is not supported."""
    locals_: dict[tuple[str, str], Local] = {}
    desc = []
    for n, role, t in _items_of(state):
        local, parts = local_region(t, f"{role} of tensor {n!r}")
        locals_[(n, role)] = (local, parts)
        desc.append(Described(n, role, dtype_name(t.dtype, n), tuple(t.shape), tuple(box for box, _ in parts)))
    for n, t in sorted(state.tensors.items()):
        if not is_dtensor(t):
            desc.append(Described(n, "plain", dtype_name(t.dtype, n), tuple(t.shape), ()))
    return locals_, desc


def encode_description(desc: Sequence[Described]) -> bytes:
    """What a rank all-gathers in step 1: a status byte 0 and its descriptions as JSON (never pickled)."""
    return b"\x00" + msgspec.json.encode(list(desc))


def decode_description(raw: bytes) -> list[Described]:
    """A peer's descriptions from what it sent (``encode_description``; strict: unknown fields refused)."""
    return _DESCRIBED.decode(raw[1:])


#: (name, role) -> (dtype, global shape, {box: the ranks holding it}): every rank's slices of each DTensor.
SliceUnion = dict[tuple[str, str], tuple[str, tuple[int, ...], dict[Box, list[int]]]]


@dataclass(frozen=True)
class Layout:
    """What a rank's tensors are, without its boxes (step 1's digest; SPEC.md §Block exchange):
    enough for any rank to work out every rank's boxes when all ranks' layouts are the same."""

    digest: bytes
    """BLAKE3 of the JSON ``[meshes, tensors, plain]`` below (placements as ``placement_key``)."""
    meshes: list[tuple[tuple[int, ...], tuple[int, ...]]]
    """Each distinct mesh: (its shape, its global ranks in C order)."""
    tensors: list[tuple[str, str, str, tuple[int, ...], int, tuple[Any, ...]]]
    """(name, role, dtype, global shape, mesh index, placements) of each DTensor, in description order."""
    plain: list[tuple[str, str, tuple[int, ...]]]
    """(name, dtype, shape) of each plain tensor."""


def describe_layout(state: SlotState) -> Layout:
    """This rank's layout: every DTensor's name, role, dtype, global shape, mesh and placements,
    and every plain tensor's name, dtype and shape, in ``describe``'s order, and its digest."""
    meshes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    index: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    tensors = []
    for n, role, t in _items_of(state):
        mesh = t.device_mesh  # type: ignore[attr-defined]
        m = (tuple(int(d) for d in mesh.shape), tuple(int(r) for r in mesh.mesh.reshape(-1).tolist()))
        if m not in index:
            index[m] = len(meshes)
            meshes.append(m)
        shape = tuple(int(d) for d in t.shape)
        tensors.append((n, role, dtype_name(t.dtype, n), shape, index[m], tuple(t.placements)))  # type: ignore[attr-defined]
    plain = [
        (n, dtype_name(t.dtype, n), tuple(int(d) for d in t.shape))
        for n, t in sorted(state.tensors.items())
        if not is_dtensor(t)
    ]
    return make_layout(meshes, tensors, plain)


def make_layout(
    meshes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    tensors: list[tuple[str, str, str, tuple[int, ...], int, tuple[Any, ...]]],
    plain: list[tuple[str, str, tuple[int, ...]]],
) -> Layout:
    """A ``Layout`` of these meshes, DTensors and plain tensors (``Layout``'s fields), with its digest."""
    doc = [
        [[list(sh), list(rs)] for sh, rs in meshes],
        [[n, role, dt, list(sh), mi, [list(placement_key(p)) for p in pl]] for n, role, dt, sh, mi, pl in tensors],
        [[n, dt, list(sh)] for n, dt, sh in plain],
    ]
    h = new_hasher()
    h.update(msgspec.json.encode(doc))
    return Layout(h.digest(), meshes, tensors, plain)


def layouts_agree(gathered: Sequence[bytes]) -> bool:
    """Whether every rank sent the same layout digest (status byte 0, then 32 bytes)."""
    return all(len(raw) == 33 and raw == gathered[0] for raw in gathered)


def derive_union(layout: Layout, world: int, g: Callable[[int], int]) -> tuple[SliceUnion, dict[str, list[int]]]:
    """``gather_union``'s union and plain holders, worked out from this rank's ``layout`` when
    every rank of the group (``world`` ranks; ``g``: group rank -> global rank) has the same
    one: rank r's boxes of each DTensor are ``mesh_parts`` at r's coordinate in its mesh, boxes
    listed in the same order and ranks in the same order as from the descriptions. The boxes
    of one (shape, mesh, placements) are worked out once and shared by its tensors."""
    coords: list[list[tuple[int, ...] | None]] = []
    for shape, ranks in layout.meshes:
        at = {r: k for k, r in enumerate(ranks)}
        of_rank: list[tuple[int, ...] | None] = []
        for r in range(world):
            k = at.get(g(r))
            if k is None:  # a rank not in the mesh holds none of its tensors
                of_rank.append(None)
                continue
            c = []
            for d in reversed(shape):
                c.append(k % d)
                k //= d
            of_rank.append(tuple(reversed(c)))
        coords.append(of_rank)
    union: SliceUnion = {}
    classes: dict[tuple, dict[Box, list[int]]] = {}
    for n, role, dtype, shape, mi, placements in layout.tensors:
        cls = (shape, mi, tuple(placement_key(p) for p in placements))
        held = classes.get(cls)
        if held is None:
            held = classes[cls] = {}
            mesh_shape = layout.meshes[mi][0]
            for r, c in enumerate(coords[mi]):
                if c is None:
                    continue
                _, parts = mesh_parts(shape, mesh_shape, c, placements, f"{role} of tensor {n!r}", check=False)
                for box, _ in parts:
                    held.setdefault(box, []).append(r)
        union.setdefault((n, role), (dtype, shape, held))
    plain = {n: list(range(world)) for n, _dt, _sh in layout.plain}
    return union, plain


@dataclass(frozen=True)
class ExchangePlan:
    """What every rank computes from all ranks' descriptions or the layout (SPEC.md §Block exchange, step 2)."""

    union: SliceUnion
    """(name, role) -> (dtype, global shape, {box: the ranks holding it})."""
    plain: dict[str, list[int]]
    """A plain tensor's name -> the ranks holding it whole."""
    blocks: list[PlannedBlock]
    """Every canonical block of every DTensor, in (name, role) then block order: all planned
    (``plan_union``, the same on every rank), or one rank's (``plan_local``: the blocks it has no
    part in with owner ``NOT_MINE``)."""

    def recorders(self) -> dict[str, int]:
        """The slot whose shard manifest records each sharded parameter's entry (step 4)."""
        return {
            n: entry_slot(n, sorted({r for rs in held.values() for r in rs}))
            for (n, role), (_, _, held) in self.union.items()
            if role == "param"
        }


def gather_union(peers: Sequence[Sequence[Described]]) -> tuple[SliceUnion, dict[str, list[int]]]:
    """Step 2, first half: check that ranks agree on each tensor (StateMismatch or
    TensorMismatch naming the tensor, role and ranks otherwise) and collect every rank's slices
    of each DTensor, and the ranks holding each plain tensor. ``peers[r]``: rank r's descriptions."""
    check_agreement(peers)  # dtypes, shapes, plain against DTensor, naming ranks
    union: SliceUnion = {}
    plain: dict[str, list[int]] = {}
    for r, items in enumerate(peers):
        for it in items:
            if it.role == "plain":
                plain.setdefault(it.name, []).append(r)
                continue
            _dtype, _shape, held = union.setdefault((it.name, it.role), (it.dtype, it.shape, {}))
            for box in it.boxes:
                held.setdefault(box, []).append(r)
    return union, plain


def plan_union(union: SliceUnion, world: int) -> list[PlannedBlock]:
    """Step 2, second half: each tensor's slices must tile it (TensorMismatch naming the ranks of
    the ``world`` that hold which slices, and those holding none); every canonical block's owner
    and pieces, tensor by tensor in (name, role) order. Tensors are planned independently."""
    blocks: list[PlannedBlock] = []
    for (n, role), (dtype, shape, held) in sorted(union.items()):
        try:
            regions = slice_regions(n, dtype, shape, held)
        except TensorMismatch as e:
            raise TensorMismatch(coverage_problem(n, role, dtype, shape, held, world, str(e))) from None
        for bi, (box, owner, sends) in enumerate(plan_blocks(f"{n}\0{role}", dtype, shape, regions)):
            blocks.append(PlannedBlock((n, role), bi, box, owner, sends, dtype))
    return blocks


@dataclass
class _Skeleton:
    """What the plans of the tensors of one class (the same slices, dtype and shape: every layer's
    q_proj, each role) share, worked out once: each block's pieces (the slices it overlaps) and
    tied slices, and for each slice the blocks it is a piece of, numbered. Only the rotation
    (a hash of name and role) differs between their plans."""

    regions: list[tuple[Box, list[int]]]
    boxes: list[Box]
    pieces: list[list[tuple[int, Box]]]  # per block: (slice index, common box), as plan_blocks lists them
    tied: list[list[int]]  # per block: the slices holding most of it
    turn_of: list[dict[int, int]]  # per slice: block index -> how many earlier blocks it is a piece of
    simple: bool  # no rank holds two slices of it that hold elements, and every block has a piece (or is the only one)
    of_rank: dict[int, list[int]]  # rank -> the slices it holds that hold elements
    shape: tuple[int, ...]

    @staticmethod
    def of(regions: list[tuple[Box, list[int]]], dtype: str, shape: tuple[int, ...]) -> _Skeleton:
        boxes = grid(dtype, shape)
        near = slices_near(regions, len(shape))
        pieces, tied = [], []
        turn_of: list[dict[int, int]] = [{} for _ in regions]
        for bi, box in enumerate(boxes):
            ps = [(ri, c) for ri in near(box) if (c := intersect(box, regions[ri][0])) is not None]
            pieces.append(ps)
            most = max((math.prod(c[1]) for _, c in ps), default=0)
            tied.append([ri for ri, c in ps if math.prod(c[1]) == most])
            for ri, _ in ps:
                turn_of[ri][bi] = len(turn_of[ri])
        of_rank: dict[int, list[int]] = {}
        for ri, (box, ranks) in enumerate(regions):
            if math.prod(box[1]):
                for r in ranks:
                    of_rank.setdefault(r, []).append(ri)
        simple = all(len(v) == 1 for v in of_rank.values()) and (len(boxes) == 1 or all(pieces))
        return _Skeleton(regions, boxes, pieces, tied, turn_of, simple, of_rank, tuple(shape))

    def planned(self, key: tuple[str, str], dtype: str, rank: int) -> list[PlannedBlock]:
        """``plan_blocks``' plan of tensor ``key`` as ``rank`` needs it: every block; those it
        owns with their pieces, those it sends a piece of with their owner and its own pieces,
        the others with neither."""
        n, role = key
        if not self.simple:  # a rank holding several slices of it: the whole plan, filtered
            full = plan_blocks(f"{n}\0{role}", dtype, self.shape, self.regions)
            return [
                _as_seen_by(rank, PlannedBlock(key, bi, box, o, sends, dtype))
                for bi, (box, o, sends) in enumerate(full)
            ]
        turn = zlib.crc32(f"{n}\0{role}".encode())
        regions, turn_of = self.regions, self.turn_of
        held = self.of_rank.get(rank, [])
        mine = {bi for ri in held for bi in turn_of[ri]}
        out = []
        for bi, box in enumerate(self.boxes):
            ps = self.pieces[bi]
            if not ps:  # an empty tensor's one block, written by a holder of the first slice
                owner = regions[0][1][turn % len(regions[0][1])]
                out.append(PlannedBlock(key, bi, box, owner if owner == rank else NOT_MINE, [], dtype))
                continue
            if bi not in mine:  # none of its pieces is this rank's: neither owner nor source
                out.append(PlannedBlock(key, bi, box, NOT_MINE, [], dtype))
                continue
            # plan_blocks' rule: each slice takes its turn once for every block it is a piece of
            # (as owner or as source: a rank holding one slice is never both), so a slice's
            # replica for block bi is the one at its count of earlier blocks, from the rotation
            tied = self.tied[bi]
            best = tied[(turn + bi) % len(tied)]
            holders = regions[best][1]
            owner = holders[(turn + turn_of[best][bi]) % len(holders)]
            if owner == rank:  # every piece, from the replica whose turn it is
                sends = [
                    (regions[ri][1][(turn + turn_of[ri][bi]) % len(regions[ri][1])], c) for ri, c in ps if ri != best
                ]
                out.append(PlannedBlock(key, bi, box, owner, sends, dtype))
                continue
            own = [
                (rank, c)
                for ri in held
                if ri != best
                and bi in turn_of[ri]
                and regions[ri][1][(turn + turn_of[ri][bi]) % len(regions[ri][1])] == rank
                and (c := intersect(box, regions[ri][0])) is not None
            ]
            out.append(PlannedBlock(key, bi, box, owner if own else NOT_MINE, own, dtype))
        return out


def _as_seen_by(rank: int, b: PlannedBlock) -> PlannedBlock:
    """A block of the whole plan as ``rank``'s plan lists it: whole if it owns it; with its
    own pieces if it sends some; else with owner ``NOT_MINE`` and no pieces."""
    if b.owner == rank:
        return b
    own = [(src, c) for src, c in b.sends if src == rank]
    return replace(b, sends=own) if own else replace(b, owner=NOT_MINE, sends=[])


def plan_local(union: SliceUnion, world: int, rank: int) -> list[PlannedBlock]:
    """Step 2, second half, as one rank needs it: ``plan_union``'s blocks, in its order and with
    its errors, each as ``_as_seen_by(rank, ...)`` lists it: the blocks ``rank`` owns with all
    their pieces, those it sends a piece of with their owner and its own pieces, the others
    with owner ``NOT_MINE`` and no pieces (their sizes still batch the exchange alike on every
    rank, and their ids come back in the all-reduce). The slices of tensors
    that share one slice table (``derive_union`` shares it over a class) are checked and
    intersected with the grid once, and each such tensor's plan costs about its blocks plus
    the pieces of this rank's blocks, not every piece of every block."""
    blocks: list[PlannedBlock] = []
    regions_of: dict[tuple[int, tuple[int, ...]], list[tuple[Box, list[int]]]] = {}
    skeletons: dict[tuple[int, tuple[int, ...], str], _Skeleton] = {}
    for (n, role), (dtype, shape, held) in sorted(union.items()):
        regions = regions_of.get((id(held), shape))
        if regions is None:
            try:
                regions = regions_of[(id(held), shape)] = slice_regions(n, dtype, shape, held)
            except TensorMismatch as e:
                raise TensorMismatch(coverage_problem(n, role, dtype, shape, held, world, str(e))) from None
        sk = skeletons.get((id(held), shape, dtype))
        if sk is None:
            sk = skeletons[(id(held), shape, dtype)] = _Skeleton.of(regions, dtype, shape)
        blocks += sk.planned((n, role), dtype, rank)
    return blocks


def plan_exchange(peers: Sequence[Sequence[Described]]) -> ExchangePlan:
    """Step 2: the plan from every rank's descriptions (``gather_union``, then ``plan_union``).
    The same on every rank, and so are its errors."""
    union, plain = gather_union(peers)
    return ExchangePlan(union, plain, plan_union(union, len(peers)))


def write_dtensors(
    store: Store,
    state: SlotState | None,
    *,
    group: Any = None,
    threads: int = WRITE_THREADS,
    failure: BaseException | None = None,
) -> SlotState:
    """Write every DTensor of ``state`` (a SlotState) as canonical blocks, collectively over ``group``.

    Returns the SlotState this rank's shard manifest records: plain tensors as they were,
    DTensors whose entry this slot holds replaced by their ``StoredPayload``, the rest
    dropped (another slot records them). Every rank of the group must call this; one that
    could not capture its state passes ``failure`` (and ``state=None``): it still takes
    part in the description exchange and raises it; the others then skip the exchange (the
    commit protocol fails naming that rank), so none waits.
    """
    rank = dist.get_rank(group)
    locals_: dict[tuple[str, str], Local] = {}
    try:
        if failure is not None:
            raise failure
        locals_, desc = describe(state)
        layout = describe_layout(state)
        raw = b"\x00" + layout.digest
    except Exception as e:  # noqa: BLE001 - still take part in the exchange, so every rank raises, none waits
        failure, raw = e, b"\x01" + f"{type(e).__name__}: {e}".encode()
    gathered = all_gather_bytes(raw, group)
    failed = [(r, g[1:].decode(errors="replace")) for r, g in enumerate(gathered) if g[:1] != b"\x00"]
    if failure is not None:
        raise failure
    if failed:  # a peer's failure fails the commit (the protocol phase names that rank); no exchange
        return _restate(state, {}, set())
    g = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    if layouts_agree(gathered):  # one layout everywhere: every rank's boxes worked out here
        union, plain = derive_union(layout, len(gathered), g)
    else:  # the full descriptions, whose union names the ranks on each side of a disagreement
        peers = [decode_description(d) for d in all_gather_bytes(encode_description(desc), group)]
        union, plain = gather_union(peers)
    plan = ExchangePlan(union, plain, plan_local(union, len(gathered), rank))  # this rank's blocks planned
    replicated = {n: rs for n, rs in plan.plain.items() if len(rs) > 1}
    drop = _copies_agree(locals_, union, state, replicated, rank, group)
    _keep_dropped_plain(store, state, drop)
    # what this slot held of tensors another slot may record (SPEC.md §Slices held): the boxes of
    # its DTensor parameters' local parts, and the whole box of each plain tensor several ranks hold
    boxes = [(n, box) for (n, role), (_lt, parts) in locals_.items() if role == "param" for box, _ in parts]
    boxes += [
        (n, ((0,) * state.tensors[n].dim(), tuple(state.tensors[n].shape)))
        for n, rs in replicated.items()
        if rank in rs
    ]
    slices = make_slices(boxes)
    if not plan.blocks:  # no rank holds a DTensor (the same answer on every rank): nothing to exchange
        return replace(_restate(state, {}, set(), drop), slices=slices) if drop else replace(state, slices=slices)
    ids = run_plan(store, plan.blocks, locals_, rank, g, group, threads)
    if ids is None:  # another rank failed staging or writing its blocks: the commit protocol names it
        return _restate(state, {}, set())
    _keep_held_blocks(store, plan.blocks, ids, locals_, rank)
    blocks: dict[tuple[str, str], list[str]] = {}
    for b, oid in zip(plan.blocks, ids):
        blocks.setdefault(b.key, []).append(oid)
    payload = {
        key: StoredPayload(make_payload(d, s, blocks[key]), torch_dtype(d), s) for key, (d, s, _) in union.items()
    }
    mine = {n for n, slot in plan.recorders().items() if slot == rank}
    return replace(_restate(state, payload, mine, drop), slices=slices)


def _keep_held_blocks(
    store: Store, blocks: list[PlannedBlock], ids: list[str], locals_: dict[tuple[str, str], Local], rank: int
) -> None:
    """A block another rank wrote that lies wholly inside one of this rank's parts (a replica's
    turn, SPEC.md §15.2) is kept by a write-through memory tier from this rank's own bytes, as if
    written here (``Store.name_written``, no store request; SPEC.md §19.3). The replicas' bytes
    were compared by hash before the exchange, so they are the block's."""
    if not isinstance(store.storage, CachesWrites):
        return
    for b, oid in zip(blocks, ids):
        if b.owner == rank or b.key not in locals_:
            continue
        lt, parts = locals_[b.key]
        origin = next((o for box, o in parts if intersect(b.box, box) == b.box), None)
        if origin is not None:
            store.name_written(oid, tensor_bytes(lt[box_slices(b.box, origin)]))


def _keep_dropped_plain(store: Store, state: SlotState, drop: set[str]) -> None:
    """A plain tensor several ranks hold whole that another slot records (SPEC.md §15.2 step 4)
    is in this slot's closure too (§15.5): this rank hashes the canonical blocks of its own copy
    (the tensor, its moments, its torch-form state: what the recording slot writes for its entry)
    and a write-through memory tier keeps them under those ids, as if written here
    (``Store.name_written``, no store request; SPEC.md §19.3). The holders' copies were compared by
    hash first (``_copies_agree``), so these are the recorder's bytes and ids; a tier that does
    not get them here still gets them at the commit's completion (``checkpoint.replicas.complete``)."""
    if not drop or not isinstance(store.storage, CachesWrites):
        return
    for n in sorted(drop & state.tensors.keys()):  # ``drop`` names too what other ranks hold and this one does not
        po = state.optim.params.get(n)
        tensors = [state.tensors[n]]
        if po is not None and po.exp_avg is not None and po.exp_avg_sq is not None:
            tensors += [po.exp_avg, po.exp_avg_sq]
        if po is not None and po.torch_state is not None:
            tensors += [t for _, t in sorted(po.torch_state.tensors.items())]
        for t in tensors:
            for view in block_views(t):
                data = tensor_bytes(view)
                store.name_written(hash_bytes(data), data)


def _fingerprint(state: SlotState, name: str) -> bytes:
    """BLAKE3 over a plain tensor's bytes, dtype and shape and its optimizer state (group, age, state tensors)."""
    h = new_hasher()
    parts = [state.tensors[name]]
    po = state.optim.params.get(name)
    if po is not None:
        h.update(f"{po.group}:{po.age}".encode())
        parts += [m for m in (po.exp_avg, po.exp_avg_sq) if m is not None]
        if getattr(po, "torch_state", None) is not None:
            parts += [t for _, t in sorted(po.torch_state.tensors.items())]
    for t in parts:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(tensor_bytes(t))
    return h.digest()


#: The prime the replicas' check sums over (2^31 - 1): eight words of a slice's hash, each a
#: residue, so a sum over every rank's slices fits an int64 without wrapping.
_CHECK_PRIME = (1 << 31) - 1
_CHECK_WORDS = 8


def _check_words(label: str, digest: bytes) -> list[int]:
    """Eight residues modulo ``_CHECK_PRIME`` of BLAKE3(label, the slice's BLAKE3 digest)."""
    h = new_hasher()
    h.update(label.encode())
    h.update(digest)
    raw = h.digest()
    return [int.from_bytes(raw[4 * i : 4 * i + 4], "little") % _CHECK_PRIME for i in range(_CHECK_WORDS)]


def _shared_label(key: tuple[str, str], box: Box) -> str:
    return f"{key[0]}\0{key[1]}\0{box}"


def _plain_label(name: str) -> str:
    return f"{name}\0plain"


def _add_check(total: list[int], label: str, digest: bytes, holders: list[int], rank: int) -> list[int]:
    """``total`` plus this holder's term of one shared copy: ``(len(holders) - 1) * H`` for the
    first holder, ``-H`` (``(p - 1) * H``) for every other, modulo ``_CHECK_PRIME``."""
    weight = len(holders) - 1 if rank == holders[0] else _CHECK_PRIME - 1
    return [(t + weight * w) % _CHECK_PRIME for t, w in zip(total, _check_words(label, digest))]


def _copies_agree(
    locals_: dict[tuple[str, str], tuple[torch.Tensor, list[tuple[Box, tuple[int, ...]]]]],
    union: dict[tuple[str, str], tuple[str, tuple[int, ...], dict[Box, list[int]]]],
    state: SlotState,
    replicated: dict[str, list[int]],
    rank: int,
    group: Any,
) -> set[str]:
    """Every copy several ranks hold must be equal, else the commit would hold a tensor no rank
    held (SPEC.md §Block exchange, step 2 and step 4). Returns the plain tensors this rank drops
    (another holder records them). Two kinds of copies are compared, in one collective:

    - A box of a DTensor that several ranks hold (a ``Replicate`` placement, or one name on
      several meshes) is written once, split among its holders. Each holder hashes its copy.
      Boxes held by one rank (FSDP2, tensor parallelism) cost nothing here, and so do empty
      boxes (thousands of ranks may hold the same empty slice: nothing to disagree on).
    - A plain tensor several ranks hold whole (``replicated``: name -> its holders; FSDP2 leaves
      buffers such as BatchNorm's statistics whole on every rank) is recorded by one of them
      (``entry_slot``). Each holder hashes its bytes, dtype, shape and optimizer state
      (``_fingerprint``).

    The holders agree when one sum is zero: for each shared copy with holders ``rs``, the first
    holder adds ``(len(rs) - 1) * H`` and every other holder ``-H`` of the words ``H`` of its
    copy's hash, modulo ``_CHECK_PRIME`` (eight words; one int64 all-reduce of 64 bytes, whatever
    the number of ranks, slices and plain tensors). Equal copies cancel exactly; a copy that
    differs leaves a non-zero sum except with probability about 2^-248. Only then are the
    holders' hashes all-gathered, to name the copy and its ranks: every rank raises
    TensorMismatch for the first DTensor slice, in sorted order, whose holders differ, else for
    the first such plain tensor by name."""
    shared = {
        (key, box): rs
        for key, (_d, _s, held) in union.items()
        for box, rs in held.items()
        if len(rs) > 1 and math.prod(box[1]) > 0
    }
    if not shared and not replicated:  # the same answer on every rank: the union and the plain holders are
        return set()
    slices: dict[str, str] = {}
    plain: dict[str, str] = {}
    total = [0] * _CHECK_WORDS
    for (key, box), rs in shared.items():
        if rank in rs:
            local, parts = locals_[key]
            origin = next(o for b, o in parts if b == box)
            h = new_hasher()
            h.update(tensor_bytes(local[box_slices(box, origin)].contiguous()))
            digest = h.digest()
            label = _shared_label(key, box)
            slices[label] = digest.hex()
            total = _add_check(total, label, digest, rs, rank)
    for n, rs in sorted(replicated.items()):
        if rank in rs:
            digest = _fingerprint(state, n)
            plain[n] = digest.hex()
            total = _add_check(total, _plain_label(n), digest, rs, rank)
    sums = torch.tensor(total, dtype=torch.int64)
    dist.all_reduce(sums, group=group)
    if any(int(v) % _CHECK_PRIME != 0 for v in sums.tolist()):  # the same answer on every rank: the sum is
        got = [_COPIES.decode(raw) for raw in all_gather_bytes(msgspec.json.encode((slices, plain)), group)]
        for ((n, role), box), rs in sorted(shared.items()):
            label = _shared_label((n, role), box)
            if len({got[r][0].get(label) for r in rs}) != 1:
                raise TensorMismatch(
                    f"{role} of tensor {n!r}: ranks {rs} hold its slice at {list(box[0])} of extent {list(box[1])} "
                    "with different values; replicas of a slice (a Replicate placement, or one name on several "
                    "meshes) must be equal, since the slice is written once (SPEC.md §Block exchange)"
                )
        for n, rs in sorted(replicated.items()):
            if len({got[r][1].get(n) for r in rs}) != 1:
                raise TensorMismatch(
                    f"tensor {n!r}: ranks {rs} hold it as a plain (not DTensor) tensor with different values or "
                    "optimizer state; a tensor several ranks hold whole must be equal on all of them (SPEC.md §Block "
                    "exchange)"
                )
    return {n for n, rs in replicated.items() if entry_slot(n, rs) != rank}


def _restate(
    state: SlotState,
    payload: dict[tuple[str, str], StoredPayload],
    mine: set[str],
    drop: frozenset[str] | set[str] = frozenset(),
) -> SlotState:
    """The SlotState this slot records: the DTensor entries it records (``mine``) replaced by
    their payloads; plain tensors as they are, but for replicated ones another rank records (``drop``)."""
    tensors = {}
    for n, t in state.tensors.items():
        if not is_dtensor(t):
            if n not in drop:
                tensors[n] = t
        elif n in mine:
            tensors[n] = payload[(n, "param")]
    params = {}
    for n, po in state.optim.params.items():
        if n not in tensors:
            continue
        m1 = (
            payload.get((n, "exp_avg"), po.exp_avg) if po.exp_avg is not None and is_dtensor(po.exp_avg) else po.exp_avg
        )
        m2 = (
            payload.get((n, "exp_avg_sq"), po.exp_avg_sq)
            if po.exp_avg_sq is not None and is_dtensor(po.exp_avg_sq)
            else po.exp_avg_sq
        )
        ts = po.torch_state
        if ts is not None and any(is_dtensor(m) for m in ts.tensors.values()):
            ts = replace(
                ts,
                tensors={k: payload.get((n, f"state:{k}"), m) if is_dtensor(m) else m for k, m in ts.tensors.items()},
            )
        params[n] = replace(po, exp_avg=m1, exp_avg_sq=m2, torch_state=ts)
    used = {p.group for p in params.values()}
    optim = replace(
        state.optim,
        groups={k: h for k, h in state.optim.groups.items() if k in used},
        torch_groups={k: h for k, h in state.optim.torch_groups.items() if k in used},
        params=params,
    )
    births = None if state.births is None else {n: b for n, b in state.births.items() if n in tensors}
    return replace(state, tensors=tensors, optim=optim, births=births)
