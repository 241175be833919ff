"""Which part of each sharded tensor each slot held when it saved, and what slot K needs
(SPEC.md §Slices held).

A tensor that several ranks hold in parts (a DTensor: FSDP2, tensor parallelism) or whole
(a plain tensor every rank holds, such as FSDP2's buffers) is recorded once, by one slot,
with its whole payload (§Block exchange). Alone, that says nothing about the other ranks:
"slot K" of the commit would be the entries hashed to K with all their blocks, and a
replacement for rank K could not be sent just what it restores. So each shard manifest
lists in ``slices`` the box of every such tensor its rank held: a DTensor parameter's local
slice (its global offset and local shape), or the whole box of a replicated plain tensor.
Slices are layout, not learned state: they enter the full root, never the learned-state
root, and a commit restores into any split whatever they say.

The **slot-K selection** (``slot_needs``): every entry of slot K's shard manifest that no
slot's slices name, with all its objects (as in format 1 and 2), and every tensor slot K
has slices of, with the blocks of each payload of the entry's shape (parameter, moments,
torch-form state of that shape) that overlap them; a state tensor of another shape
(Adafactor's ``row_var``) whole. ``copy --shard K`` copies exactly that and
``verify --shard K`` checks exactly that; a restore into slot K's own split reads a subset
of it (it reads the blocks its slices overlap).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from .grid import Box, intersect, payload_blocks
from .manifest import Payload, ShardManifest, Slice, TensorEntry, state_payloads, tensor_payloads

__all__ = [
    "make_slices",
    "shard_slice_problems",
    "commit_slice_problems",
    "Overlap",
    "Gap",
    "tiling_defect",
    "slot_needs",
    "entry_objects",
]


def make_slices(boxes: Iterable[tuple[str, Box]]) -> tuple[Slice, ...]:
    """The ``slices`` field of a shard manifest: one record per (tensor, box), sorted, empty boxes left out."""
    out = {(n, tuple(b[0]), tuple(b[1])) for n, b in boxes if math.prod(b[1]) > 0}
    return tuple(Slice(name=n, start=s, shape=e) for n, s, e in sorted(out))


def _key(x: Slice) -> tuple:
    return (x.name, tuple(x.start), tuple(x.shape))


def shard_slice_problems(shard: ShardManifest) -> Iterator[str]:
    """Rules of one shard manifest's slices on their own."""
    keys = [_key(x) for x in shard.slices]
    if any(a >= b for a, b in zip(keys, keys[1:])):
        yield "slices are not sorted by (name, start, shape) and unique (SPEC.md §Slices held)"
    for x in shard.slices:
        if len(x.start) != len(x.shape) or 0 in x.shape:
            yield f"slice of tensor {x.name!r} at {list(x.start)} of extent {list(x.shape)} is not a non-empty box"


def commit_slice_problems(
    shards: Mapping[int, ShardManifest], entries: Mapping[str, TensorEntry]
) -> Iterator[tuple[str, str, int]]:
    """Rules binding the slots' slices to the commit's entries: (message, tensor, slot).

    Every name is a tensor of the commit; every box lies inside its shape; distinct boxes of
    one tensor are disjoint (identical ones are replicas) and together cover it exactly."""
    held: dict[str, dict[Box, list[int]]] = {}
    for slot, shard in sorted(shards.items()):
        for x in shard.slices:
            e = entries.get(x.name)
            if e is None:
                yield (
                    f"slot {slot} has a slice of tensor {x.name!r}, which the commit does not hold (SPEC.md §Slices held)",
                    x.name,
                    slot,
                )
                continue
            box = (tuple(x.start), tuple(x.shape))
            if (
                len(box[0]) != len(e.shape)
                or len(box[1]) != len(e.shape)
                or any(s + n > d for s, n, d in zip(box[0], box[1], e.shape))
            ):
                yield (
                    f"slot {slot}'s slice at {list(box[0])} of extent {list(box[1])} lies outside shape {list(e.shape)}",
                    x.name,
                    slot,
                )
                continue
            held.setdefault(x.name, {}).setdefault(box, []).append(slot)
    for name, boxes in sorted(held.items()):
        regions = sorted(boxes.items())
        defect = tiling_defect([b for b, _ in regions], entries[name].shape)
        if isinstance(defect, Overlap):
            a, b = regions[defect.first][0], regions[defect.second][0]
            yield (f"slices at {list(a[0])} (slots {boxes[a]}) and {list(b[0])} (slots {boxes[b]}) overlap but are not the same box "
                   "(SPEC.md §Slices held)"), name, boxes[b][0]  # fmt: skip
        elif isinstance(defect, Gap):
            covered = sum(math.prod(b[1]) for b, _ in regions)
            yield (
                f"the slots' slices cover {covered} of its {math.prod(entries[name].shape)} elements; "
                f"none covers the element at {list(defect.element)} (SPEC.md §Slices held)",
                name,
                regions[0][1][0],
            )


@dataclass(frozen=True)
class Overlap:
    """Two distinct boxes that share an element: their indices, ``first < second``."""

    first: int
    second: int


@dataclass(frozen=True)
class Gap:
    """An element of the tensor (its index) that no box covers."""

    element: tuple[int, ...]


#: The field of the tiling fingerprint: the Mersenne prime 2^127 - 1.
_P = (1 << 127) - 1


def tiling_defect(boxes: Sequence[Box], shape: Sequence[int]) -> Overlap | Gap | None:
    """None if the distinct ``boxes`` (each inside ``shape``) are pairwise disjoint and cover
    every element of the tensor; else a witness: two boxes that overlap, or an element none
    covers. Empty boxes cover nothing and overlap nothing.

    Not pairwise (a 64 MiB manifest holds ~800,000 slices), and not by a sweep along one dim
    (quadratic when many boxes span that dim: full-width rows above half-height columns).
    Time O(n·d) for n boxes of d dims when they tile, by a fingerprint. Write ``H_c(x) = [x >= c]``;
    the indicator of a box ``[a, b)`` on each dim ``k`` is ``prod_k (H_a(x_k) - H_b(x_k))``,
    and functions ``prod_k H_{c_k}(x_k)`` of distinct corners are linearly independent. So the
    boxes tile the tensor exactly when the sum of their indicators equals the tensor's,
    exactly when the multilinear polynomial ``sum_i prod_k (y[k, a_ik] - y[k, b_ik]) -
    prod_k (y[k, 0] - y[k, d_k])``, one variable per dim and coordinate, is zero. Evaluated
    at a point drawn from the operating system's randomness (a manifest's author cannot know
    it), a nonzero polynomial of degree d (at most 16) vanishes with probability at most
    d / (2^127 - 1) (Schwartz–Zippel): below 2^-122, and a true tiling always evaluates to 0.

    A nonzero value is proof of a defect and leads to its witness deterministically: clipped
    to two halves of a region, the polynomial is the sum of its halves' (on the cut dim,
    ``y[a] - y[b] = (y[a] - y[c]) + (y[c] - y[b])``), so one half evaluates nonzero too. The
    search halves the region at a median face of the boxes in it until no face cuts it; there
    every box in it covers it whole and the value is (boxes - 1) times a product, so it holds
    none (a gap) or two or more (an overlap). Each step costs the boxes meeting the region."""
    if math.prod(shape) == 0:
        return None  # every box inside is empty
    spans = [(tuple(start), tuple(s + n for s, n in zip(start, extent))) for start, extent in boxes]
    whole = (tuple(0 for _ in shape), tuple(shape))
    y = _values([{0, d, *(lo[k] for lo, _ in spans), *(hi[k] for _, hi in spans)} for k, d in enumerate(shape)])
    excess = (sum(_term(lo, hi, y) for lo, hi in spans) - _term(*whole, y)) % _P
    if excess == 0:
        return None
    live = [i for i, (lo, hi) in enumerate(spans) if all(a < b for a, b in zip(lo, hi))]
    return _locate(spans, live, whole, y)


def _values(coords: list[set[int]]) -> list[dict[int, int]]:
    """A value in [0, _P) drawn at random for every coordinate of every dim."""
    raw = os.urandom(16 * sum(len(c) for c in coords))
    it = (int.from_bytes(raw[i : i + 16], "little") % _P for i in range(0, len(raw), 16))
    return [{c: next(it) for c in sorted(cs)} for cs in coords]


def _term(lo: Sequence[int], hi: Sequence[int], y: list[dict[int, int]]) -> int:
    """``prod_k (y[k, lo_k] - y[k, hi_k])`` mod _P: a box's term in the fingerprint."""
    out = 1
    for k, (a, b) in enumerate(zip(lo, hi)):
        out = out * (y[k][a] - y[k][b]) % _P
    return out


def _locate(
    spans: list[tuple[tuple[int, ...], tuple[int, ...]]],
    live: list[int],
    region: tuple[tuple[int, ...], tuple[int, ...]],
    y: list[dict[int, int]],
) -> Overlap | Gap:
    """The witness in ``region``, whose fingerprint is nonzero (see tiling_defect)."""
    while True:
        lo, hi = region
        live = [i for i in live if all(a < r and b > q for a, b, q, r in zip(*spans[i], lo, hi))]
        faces = [sorted({c for i in live for c in (spans[i][0][k], spans[i][1][k]) if q < c < r})
                 for k, (q, r) in enumerate(zip(lo, hi))]  # fmt: skip
        k = max(range(len(faces)), key=lambda k: len(faces[k]), default=None)
        if k is None or not faces[k]:  # one cell: each box in it covers it, and there are not exactly 1
            return Gap(lo) if not live else Overlap(live[0], live[1])
        cut = faces[k][len(faces[k]) // 2]
        lower = (lo, hi[:k] + (cut,) + hi[k + 1 :])
        # the upper half's fingerprint is the region's minus the lower half's: nonzero if this one is 0
        region = lower if _clipped_excess(spans, live, lower, y) else (lo[:k] + (cut,) + lo[k + 1 :], hi)


def _clipped_excess(
    spans: list[tuple[tuple[int, ...], tuple[int, ...]]],
    live: list[int],
    region: tuple[tuple[int, ...], tuple[int, ...]],
    y: list[dict[int, int]],
) -> int:
    """The fingerprint of ``region``: the boxes of ``live`` that meet it, clipped to it."""
    lo, hi = region
    total = -_term(lo, hi, y)
    for i in live:
        a, b = spans[i]
        if all(p < r and q > s for p, q, s, r in zip(a, b, lo, hi)):
            total += _term(tuple(map(max, a, lo)), tuple(map(min, b, hi)), y)
    return total % _P


def slot_needs(shards: Mapping[int, ShardManifest], slot: int) -> dict[str, list[Box] | None]:
    """Tensor name → the boxes slot K needs of it (None: all of it), for the slot-K selection."""
    named: set[str] = set()
    mine: dict[str, list[Box]] = {}
    for s, shard in shards.items():
        for x in shard.slices:
            named.add(x.name)
            if s == slot:
                mine.setdefault(x.name, []).append((tuple(x.start), tuple(x.shape)))
    own = shards[slot].entries if slot in shards else ()  # an unreadable shard manifest is reported by the caller
    out: dict[str, list[Box] | None] = {e.name: None for e in own if e.name not in named}
    out.update(mine)
    return out


def _blocks(
    payload: Payload, dtype: str, shape: tuple[int, ...], boxes: list[Box] | None, label: str
) -> Iterator[tuple[str, int, str]]:
    blocks = payload_blocks(payload, dtype, shape)
    for i, (oid, box, n) in enumerate(blocks):
        if boxes is None or any(intersect(box, b) is not None for b in boxes):
            yield oid, n, label if len(blocks) == 1 else f"{label} block {i}"


def entry_objects(e: TensorEntry, boxes: list[Box] | None = None) -> Iterator[tuple[str, int, str]]:
    """(object id, byte size, what) of every object of an entry (``boxes`` None), or of the
    blocks that overlap ``boxes``: parameter, moments, and torch-form state of the entry's shape
    (state of another shape whole). ``what`` is verify's label ("exp_avg block 1")."""
    shape = tuple(e.shape)
    for role, payload, dtype in tensor_payloads(e):
        yield from _blocks(payload, dtype, shape, boxes, "parameter" if role == "param" else role)
    for key, payload, dtype, sshape in state_payloads(e):
        yield from _blocks(payload, dtype, sshape, boxes if sshape == shape else None, f"optimizer state {key!r}")
