"""The block exchange's staging arithmetic (SPEC.md §Block exchange), without processes.

What a batch stages is counted before anything is allocated, from box geometry alone, so
the count must agree with torch's own ``is_contiguous`` of the views the batch then
takes; the arena hands out aligned, disjoint views. The exchange itself runs over real
Gloo groups in ``test_dtensor.py`` and ``test_dtensor_mesh.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardstore.format.grid import box_slices
from shardstore.sharded.exchange import _Arena, _contiguous_in


@st.composite
def sub_boxes(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    start = tuple(draw(st.integers(0, d - 1)) for d in shape)
    extent = tuple(draw(st.integers(1, d - s)) for s, d in zip(start, shape))
    return shape, (start, extent)


@settings(max_examples=300, deadline=None)
@given(sub_boxes())
def test_contiguity_from_geometry_is_torchs(case):
    shape, box = case
    view = torch.empty(shape)[box_slices(box, (0,) * len(shape))]
    assert _contiguous_in(shape, box) == view.is_contiguous()


def test_arena_views_are_aligned_disjoint_and_reused():
    arena = _Arena()
    arena.reset(64 + 128)
    a = arena.take((3,), torch.float64)  # 24 bytes, rounded up to 64
    b = arena.take((2, 4), torch.float32)  # 32 bytes
    assert a.data_ptr() % 64 == 0 and b.data_ptr() - a.data_ptr() == 64
    base = arena.buf.data_ptr()
    arena.reset(64)  # a smaller batch: the same buffer
    assert arena.buf.data_ptr() == base and arena.take((1,), torch.int8).data_ptr() == base
    with pytest.raises(AssertionError, match="under-counted"):
        arena.take((math.prod((2, 64)),), torch.float32)
