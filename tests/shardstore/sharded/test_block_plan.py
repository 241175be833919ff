"""The block plan of a tensor split over a mesh (``sharded.dtensor.plan_blocks``, ``slice_regions``;
SPEC.md §Block exchange). Pure tests, no processes: a Hypothesis property that blocks assembled
from any split equal the blocks of the whole tensor, the plan against the pairwise oracle, and a
16,384-rank split planned without comparing every pair. (The grid itself, and a restore into any
split reading exactly the blocks it overlaps: tests/shardstore/format/test_grid.py.)"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from split_cases import mesh_regions, split_cases

import shardstore as ss
from shardstore.format.grid import box_slices, grid, intersect
from shardstore.sharded.dtensor import plan_blocks, slice_regions


@settings(max_examples=150, deadline=None)
@given(split_cases())
def test_blocks_from_any_split_equal_blocks_written_whole(case):
    dtype, shape, bound, splits, replicas = case
    tdtype = ss.format.tensors.torch_dtype(dtype)
    whole = (torch.arange(math.prod(shape)) % 251).to(tdtype).reshape(shape)
    regions = slice_regions("t", dtype, shape, mesh_regions(shape, splits, replicas))
    holder = {r: box for box, ranks in regions for r in ranks}
    local = {r: whole[box_slices(box, (0,) * len(shape))] for r, box in holder.items()}
    plan = plan_blocks("t\0param", dtype, shape, regions, block_bytes=bound)
    assert [box for box, _, _ in plan] == grid(dtype, shape, block_bytes=bound)
    for box, owner, sends in plan:
        buf = torch.full(box[1], 7, dtype=tdtype)
        filled = torch.zeros(box[1], dtype=torch.int32)
        mine = intersect(box, holder[owner])
        parts = ([(owner, mine)] if mine else []) + sends
        for src, piece in parts:  # every piece comes from a rank that holds it
            assert intersect(piece, holder[src]) == piece
            buf[box_slices(piece, box[0])] = local[src][box_slices(piece, holder[src][0])]
            filled[box_slices(piece, box[0])] += 1
        assert bool((filled == 1).all()), "each element of a block arrives exactly once"
        assert torch.equal(buf, whole[box_slices(box, (0,) * len(shape))])
    # replicas of a slice take turns: one that gives two or more blocks or pieces uses two replicas
    turns: dict = {}
    for _, owner, sends in plan:
        for r in [owner] + [src for src, _ in sends]:
            turns.setdefault(holder[r], []).append(r)
    for ranks in turns.values():
        assert len(set(ranks)) == min(len(ranks), replicas)


def _plan_pairwise(key, dtype, shape, regions, block_bytes):
    """The block plan as it was computed before slices were looked up: every block against
    every slice (the oracle: the owners and senders must not change)."""
    turn = zlib.crc32(key.encode())
    used = [0] * len(regions)

    def pick(ri):
        used[ri] += 1
        return regions[ri][1][(turn + used[ri] - 1) % len(regions[ri][1])]

    out = []
    for bi, box in enumerate(grid(dtype, shape, block_bytes=block_bytes)):
        pieces = [(ri, c) for ri, (reg, _) in enumerate(regions) if (c := intersect(box, reg)) is not None]
        if not pieces:
            out.append((box, pick(0), []))
            continue
        most = max(math.prod(c[1]) for _, c in pieces)
        tied = [ri for ri, c in pieces if math.prod(c[1]) == most]
        best = tied[(turn + bi) % len(tied)]
        owner = pick(best)
        out.append(
            (box, owner, [(owner if owner in regions[ri][1] else pick(ri), c) for ri, c in pieces if ri != best])
        )
    return out


@settings(max_examples=200, deadline=None)
@given(split_cases(), st.integers(1, 4))
def test_the_plan_is_the_pairwise_plan(case, fold):
    """Looking slices up by their starts gives exactly the plan of comparing every block with
    every slice: the same owners, senders and pieces, in the same order, with ranks that hold
    several slices (``fold``: a strided layout) and empty slices among them."""
    dtype, shape, bound, splits, replicas = case
    held = {box: [r // fold for r in ranks] for box, ranks in mesh_regions(shape, splits, replicas).items()}
    held[((0,) * len(shape), (0,) * len(shape))] = [99]  # an empty slice, held by a rank with nothing
    regions = slice_regions("t", dtype, shape, held)
    want = _plan_pairwise("t\0param", dtype, shape, regions, bound)
    assert plan_blocks("t\0param", dtype, shape, regions, block_bytes=bound) == want


def _counted(monkeypatch, modules, limit):
    """Count calls of ``intersect`` in ``modules``; fail once there are more than ``limit``."""
    calls = [0]

    def counting(a, b):
        calls[0] += 1
        assert calls[0] <= limit, f"more than {limit} box intersections"
        return intersect(a, b)

    for m in modules:
        monkeypatch.setattr(m, "intersect", counting)
    return calls


def test_sixteen_thousand_slices_are_planned_without_comparing_every_pair(monkeypatch):
    """Regression: ``slice_regions`` compared every pair of slices and ``plan_blocks`` every
    block with every slice: per tensor, on every rank, 134 million and (a 1 GiB tensor's 256
    blocks) 4 million intersections at 16,384 ranks. A 16,384-rank row split of a 1 GiB
    float32 tensor is now checked with none (a sweep of its cells) and planned with about
    one per piece (each of its 256 blocks gathers the 256 slices of its rows)."""
    import shardstore.format.slices
    import shardstore.sharded.dtensor

    shape, ranks = (65536, 4096), 16384
    held = {((4 * r, 0), (4, 4096)): [r] for r in range(ranks)}
    calls = _counted(monkeypatch, [shardstore.sharded.dtensor, shardstore.format.slices], 200_000)
    regions = slice_regions("w", "float32", shape, held)
    assert calls[0] == 0 and len(regions) == ranks
    plan = plan_blocks("w\0param", "float32", shape, regions)
    assert len(plan) == 256 and all(len(sends) == 255 for _, _, sends in plan)
    assert calls[0] <= 2 * 256 * 256  # pairwise: 256 x 16,384 = 4,194,304
    overlapping = dict(held)
    overlapping[((5, 0), (4, 4096))] = [0]  # rows 5-8: over two other slices
    with pytest.raises(ss.TensorMismatch, match="overlap but are not replicas"):
        slice_regions("w", "float32", shape, overlapping)
