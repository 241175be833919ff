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

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping

from .grid import Box, intersect, payload_blocks
from .manifest import Payload, ShardManifest, Slice, TensorEntry, state_payloads, tensor_payloads

__all__ = [
    "make_slices",
    "overlapping_pair",
    "shard_slice_problems",
    "commit_slice_problems",
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
        pair = overlapping_pair([b for b, _ in regions], len(entries[name].shape))
        if pair is not None:
            a, b = regions[pair[0]][0], regions[pair[1]][0]
            yield (f"slices at {list(a[0])} (slots {boxes[a]}) and {list(b[0])} (slots {boxes[b]}) overlap but are not the same box "
                   "(SPEC.md §Slices held)"), name, boxes[b][0]  # fmt: skip
            continue
        covered = sum(math.prod(b[1]) for b, _ in regions)
        if covered != math.prod(entries[name].shape):
            yield (
                f"the slots' slices cover {covered} of its {math.prod(entries[name].shape)} elements (SPEC.md §Slices held)",
                name,
                regions[0][1][0],
            )


#: Most (box, grid cell) marks ``overlapping_pair`` makes per box before it sweeps instead.
_MARKS_PER_BOX = 4


def overlapping_pair(boxes: list[Box], ndim: int) -> tuple[int, int] | None:
    """Indices ``i < j`` of two distinct boxes (of ``ndim`` dims, inside the tensor) that share
    an element, or None if they are pairwise disjoint; empty boxes share none.

    Not pairwise (a 64 MiB manifest holds ~800,000 slices): the starts and ends of the boxes
    on each dim cut the tensor into a grid of cells, each box is a block of whole cells, and
    two boxes overlap exactly when they share a cell. The slices of a DTensor on any mesh are
    one cell each, so marking cells costs O(n log n). Boxes that span many cells (not a mesh's
    split) are checked by a sweep along the dim with the most cuts instead."""
    live = [i for i, b in enumerate(boxes) if all(n > 0 for n in b[1])]
    if len(live) < 2:
        return None
    cuts = [sorted({x for i in live for x in (boxes[i][0][k], boxes[i][0][k] + boxes[i][1][k])}) for k in range(ndim)]
    where = [{x: p for p, x in enumerate(c)} for c in cuts]
    spans = [
        [range(where[k][boxes[i][0][k]], where[k][boxes[i][0][k] + boxes[i][1][k]]) for k in range(ndim)] for i in live
    ]
    if sum(math.prod(len(r) for r in sp) for sp in spans) <= _MARKS_PER_BOX * len(live):
        owner: dict[tuple[int, ...], int] = {}
        for i, sp in zip(live, spans):
            for cell in itertools.product(*sp):
                j = owner.setdefault(cell, i)
                if j != i:
                    return min(i, j), max(i, j)
        return None
    k = max(range(ndim), key=lambda d: len(cuts[d]))
    active: list[tuple[int, int]] = []  # (end on dim k, box index): boxes the sweep is inside
    for i in sorted(live, key=lambda i: boxes[i][0][k]):
        start = boxes[i][0][k]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, j in active:
            if intersect(boxes[i], boxes[j]) is not None:
                return min(i, j), max(i, j)
        heapq.heappush(active, (start + boxes[i][1][k], i))
    return None


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
