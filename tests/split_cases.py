"""Hypothesis cases of tensors split over a mesh, shared by the grid's and the block plan's properties
(tests/shardstore/format/test_grid.py, tests/shardstore/sharded/test_block_plan.py)."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

DTYPES = ["float32", "bfloat16", "int64", "uint8"]


def chunks(n: int, k: int) -> list[tuple[int, int]]:
    """torch.chunk's split of n indices into k ranks (some may be empty): (start, length)."""
    step = -(-n // k) if n else 0
    return [(min(i * step, n), max(0, min(step, n - i * step))) for i in range(k)]


@st.composite
def split_cases(draw):
    """A shape, a dtype, a small block bound, and a mesh: 1 or 2 split dims (FSDP x TP), with replicas."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    bound = draw(st.sampled_from([8, 16, 24, 64, 1000]))  # small block bounds, so small tensors have many blocks
    dims = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=min(2, ndim), unique=True))
    splits = [(d, draw(st.integers(1, 4))) for d in dims]
    replicas = draw(st.integers(1, 2))
    return dtype, shape, bound, splits, replicas


def mesh_regions(shape, splits, replicas) -> dict:
    """The slices of a mesh splitting ``shape`` on each (dim, ranks) of ``splits`` like torch.chunk."""
    held: dict = {}
    rank = 0
    for parts in itertools.product(*(chunks(shape[d], k) for d, k in splits)):
        if any(length == 0 for _, length in parts):
            continue
        origin, extent = [0] * len(shape), list(shape)
        for (d, _), (start, length) in zip(splits, parts):
            origin[d], extent[d] = start, length
        held[(tuple(origin), tuple(extent))] = list(range(rank, rank + replicas))
        rank += replicas
    return held
