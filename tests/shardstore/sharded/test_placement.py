"""Which global elements a DTensor's local tensor holds (SPEC.md §Slices on the grid).

Pure tests, no processes: ``placement.dim_indices`` and ``parts_of`` over meshes of 1 to 3
dims with Shard, _StridedShard and Replicate placements, checked against

- the local tensor DTensor itself would give each mesh coordinate (each placement's
  ``_split_tensor`` applied in turn to the data, as ``distribute_tensor`` does);
- torch's ``_compute_local_shape_and_global_offset`` (shape and first offset);
- the right-to-left meaning of FSDP2 on tensor parallelism: ``(_StridedShard(0, sf=tp),
  Shard(0))`` is tensor parallelism's chunk, then FSDP2's chunk of that;
- tiling: over all coordinates, the parts cover every element, replicas hold equal parts.

The multi-process checks against real FSDP2 x TP models are in ``test_dtensor_mesh.py``.
"""

from __future__ import annotations

import itertools
import math
import uuid

import pytest
import torch
from faults import CountingStore
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import shardstore as ss
from shardstore.format.grid import box_slices, grid, intersect, make_payload, read_parts
from shardstore.sharded.dtensor import plan_blocks, slice_regions
from shardstore.sharded.placement import MAX_PARTS, dim_indices, index_runs, parts_of


def _local_by_torch(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """The local tensor of ``coord``: each placement's own split, left to right (distribute_tensor's way)."""
    t = full
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        pieces, _ = p._split_tensor(t, mesh_shape[mesh_dim], with_padding=False, contiguous=True)
        t = pieces[coord[mesh_dim]]
    return t


def _from_parts(full: torch.Tensor, parts, local_shape) -> torch.Tensor:
    """The local tensor rebuilt from the global tensor by the parts' boxes."""
    out = torch.full(local_shape, -1, dtype=full.dtype)
    for box, lo in parts:
        out[tuple(slice(a, a + n) for a, n in zip(lo, box[1]))] = full[box_slices(box, (0,) * full.dim())]
    return out


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    placements = []
    for _ in mesh:
        kind = draw(st.sampled_from(["shard", "strided", "replicate"]))
        d = draw(st.integers(0, ndim - 1))
        if kind == "shard":
            placements.append(Shard(d))
        elif kind == "strided":
            placements.append(_StridedShard(d, split_factor=draw(st.integers(1, 3))))
        else:
            placements.append(Replicate())
    return shape, mesh, tuple(placements)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_parts_are_what_dtensor_holds_and_tile_the_tensor(layout):
    shape, mesh, placements = layout
    full = torch.arange(math.prod(shape)).reshape(shape)
    count = torch.zeros(shape, dtype=torch.int64)
    holders: dict = {}
    for coord in itertools.product(*(range(n) for n in mesh)):
        indices = dim_indices(shape, mesh, coord, placements)
        local_shape = tuple(len(ix) for ix in indices)
        want = _local_by_torch(full, mesh, coord, placements)
        assert local_shape == tuple(want.shape)
        t_shape, t_offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
        assert local_shape == tuple(t_shape)
        parts = parts_of(indices)
        if math.prod(local_shape):
            assert tuple(int(ix[0]) for ix in indices) == tuple(t_offset)
        assert torch.equal(_from_parts(full, parts, local_shape), want)
        key = tuple(sorted(parts))
        for box, _ in parts:
            holders.setdefault(box, set()).add(key)
        # a coordinate's parts are disjoint boxes: each element counted once per replica group below
        for box, _ in parts:
            count[box_slices(box, (0,) * len(shape))] += 1
    replicas = math.prod(n for n, p in zip(mesh, placements) if isinstance(p, Replicate))
    # every element is held by exactly the replicas of one layout (Replicate mesh dims copy it)
    assert bool((count == replicas).all())


@pytest.mark.parametrize("tp, dp, rows", [(2, 2, 8), (2, 2, 10), (2, 3, 10), (3, 2, 7), (4, 2, 9)])
def test_fsdp2_on_tensor_parallel_is_tp_chunk_then_fsdp_chunk(tp, dp, rows):
    """(_StridedShard(0, sf=tp), Shard(0)) on a (dp, tp) mesh: rank (i, t) holds FSDP2's
    chunk i of tensor parallelism's chunk t (right to left), one box."""
    placements = (_StridedShard(0, split_factor=tp), Shard(0))
    for i, t in itertools.product(range(dp), range(tp)):
        ix = dim_indices((rows, 3), (dp, tp), (i, t), placements)[0]
        tp_chunk = torch.arange(rows).chunk(tp)[t] if t < len(torch.arange(rows).chunk(tp)) else torch.arange(0)
        chunks = tp_chunk.chunk(dp)
        want = chunks[i] if i < len(chunks) else torch.arange(0)
        assert ix.tolist() == want.tolist()
        assert len(index_runs(ix)) <= 1


def test_a_strided_shard_alone_is_several_boxes():
    # 10 rows, _StridedShard(0, sf=2) over 2: pieces 0-4 and 5-9, each cut 3 + 2
    idx = dim_indices((10, 4), (2,), (0,), (_StridedShard(0, split_factor=2),))
    assert idx[0].tolist() == [0, 1, 2, 5, 6, 7] and idx[1] == range(4)
    assert parts_of(idx) == [(((0, 0), (3, 4)), (0, 0)), (((5, 0), (3, 4)), (3, 0))]
    cols = dim_indices((2, 8), (2, 2), (1, 0), (_StridedShard(1, split_factor=2), Replicate()))
    assert parts_of(cols) == [(((0, 2), (2, 2)), (0, 0)), (((0, 6), (2, 2)), (0, 2))]


def test_unsupported_placements_are_refused_naming_the_tensor():
    with pytest.raises(ss.TensorMismatch, match="'w'.*Partial.*not saved state"):
        dim_indices((4, 4), (2,), (0,), (Partial(),), "tensor 'w'")
    with pytest.raises(ss.TensorMismatch, match="2 placements for a 1-d mesh"):
        dim_indices((4, 4), (2,), (0,), (Shard(0), Shard(1)))
    many = [torch.arange(0, 2 * MAX_PARTS + 2, 2), range(3)]  # every other row: one box per row, one too many
    with pytest.raises(ss.TensorMismatch, match="separate boxes"):
        parts_of(many, "tensor 'w'")


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from([8, 24, 64, 1000]), st.data())
def test_blocks_from_strided_layouts_and_restores_into_them(layout, bound, data):
    """The block plan over ranks holding several boxes each assembles every block exactly
    (pieces from a rank's other boxes copied by the owner itself), and a restore into one
    rank's parts reads each block they overlap once, and only those."""
    shape, mesh, placements = layout
    whole = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)  # distinct values: distinct block ids
    coords = list(itertools.product(*(range(n) for n in mesh)))
    parts = {r: parts_of(dim_indices(shape, mesh, c, placements)) for r, c in enumerate(coords)}
    held: dict = {}
    for r, ps in parts.items():
        for box, _ in ps:
            held.setdefault(box, []).append(r)
    regions = slice_regions("t", "int64", shape, held)
    boxes = grid("int64", shape, block_bytes=bound)
    plan = plan_blocks("t\0param", "int64", shape, regions, block_bytes=bound)
    for box, owner, sends in plan:
        buf = torch.full(box[1], -1, dtype=torch.int64)
        filled = torch.zeros(box[1], dtype=torch.int32)
        mine = [c for b, _ in parts[owner] if (c := intersect(box, b)) is not None]
        others = [(src, piece) for src, piece in sends if src != owner]
        for src, piece in sends:  # every piece comes from a rank that holds it
            assert any(intersect(piece, b) == piece for b, _ in parts[src])
        for piece in mine + [p for _, p in others]:
            buf[box_slices(piece, box[0])] = whole[box_slices(piece, (0,) * len(shape))]
            filled[box_slices(piece, box[0])] += 1
        assert bool((filled == 1).all()), "each element of a block arrives exactly once"
        assert torch.equal(buf, whole[box_slices(box, (0,) * len(shape))])
    # restore into one rank's parts
    store = ss.open_store(f"memory://placement-{uuid.uuid4().hex}")
    ids = [store.put_tensor(whole[box_slices(b, (0,) * len(shape))].contiguous()) for b in boxes]
    payload = make_payload("int64", shape, ids, block_bytes=bound)
    r = data.draw(st.sampled_from(sorted(parts)))
    local_shape = tuple(len(ix) for ix in dim_indices(shape, mesh, coords[r], placements))
    local = torch.full(local_shape, -1, dtype=torch.int64)
    views = [(local[tuple(slice(a, a + n) for a, n in zip(lo, box[1]))], box[0]) for box, lo in parts[r]]
    counting = CountingStore(store)
    nread = sum(job() for job in read_parts(counting, payload, "int64", shape, views, "t"))
    want = sorted({i for i, b in enumerate(boxes) for box, _ in parts[r] if intersect(b, box) is not None})
    got = [ids.index(oid) for oid in counting.read]
    assert sorted(got) == want and len(got) == len(set(got))  # each overlapping block once, no other
    assert nread == sum(math.prod(boxes[i][1]) for i in want) * 8
    assert torch.equal(local, _local_by_torch(whole, mesh, coords[r], placements))


def test_strided_and_chunked_ranges_are_what_dtensor_splits():
    """A strided split of a range is worked out piece by piece (``torch.chunk``'s arithmetic at
    both cuts); the answer is DTensor's own ``_split_tensor``'s, for every size, split factor,
    mesh size and coordinate, uneven and empty chunks included; ``Shard`` likewise."""
    for n, sf, m in itertools.product(range(0, 23), range(1, 5), range(1, 6)):
        full = torch.arange(n).reshape(n, 1)
        for c in range(m):
            for p in (_StridedShard(0, split_factor=sf), Shard(0)):
                got = dim_indices((n, 1), (m,), (c,), (p,))[0]
                want = _local_by_torch(full, (m,), (c,), (p,)).reshape(-1).tolist()
                assert list(got) == want, (n, sf, m, c, p)


def test_a_strided_split_costs_its_split_factor_not_the_mesh(monkeypatch):
    """Regression: a rank's indices on a strided dim came from ``_split_tensor`` of the whole
    dim into every rank's chunk (Llama-3 405B's 128,256-row embedding under FSDP2 x TP on
    2,048 x 8 ranks: 16,384 pieces and 2,048 concatenations, on every rank, for every strided
    tensor). Now no split of the whole dim is made, and the answer is the one it gave."""
    rows, mesh = 128256, (2048, 8)
    placements = (_StridedShard(0, split_factor=8), Shard(0))
    coords = [(0, 0), (1543, 1), (2047, 7)]
    full = torch.arange(rows).reshape(rows, 1)
    want = [_local_by_torch(full, mesh, c, placements).reshape(-1).tolist() for c in coords]

    def refuse(*args, **kwargs):
        raise AssertionError("the whole dim was split for every rank of the mesh")

    monkeypatch.setattr(_StridedShard, "_split_tensor", refuse)
    assert [len(w) for w in want] == [8, 8, 0]  # the last rank's chunk of the last TP chunk is empty
    for c, w in zip(coords, want):
        assert list(dim_indices((rows, 1), mesh, c, placements)[0]) == w


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_mesh_parts_without_torchs_check_are_the_checked_parts(layout):
    """``mesh_parts(check=False)`` (a planner working out other ranks' parts, without torch's
    O(mesh) offset arithmetic) gives every coordinate the parts the checked path gives: empty
    local tensors included, whose one part sits at torch's offset (the dim's size where the
    rank holds no index)."""
    from shardstore.sharded.placement import mesh_parts

    shape, mesh, placements = layout
    for shape_ in (shape, (0,) + shape[1:]):
        for coord in itertools.product(*(range(n) for n in mesh)):
            checked = mesh_parts(shape_, mesh, coord, placements)
            assert mesh_parts(shape_, mesh, coord, placements, check=False) == checked, (shape_, mesh, coord)
