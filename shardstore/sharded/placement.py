"""Which elements of the global tensor a DTensor's local tensor holds, as boxes
(SPEC.md §Slices on the grid).

A DTensor's placements say how each mesh dim splits the tensor: ``Shard(d)`` cuts dim
``d`` into ``torch.chunk`` pieces, ``Replicate`` copies it, and ``_StridedShard(d,
split_factor=f)`` (what FSDP2 puts on top of tensor parallelism when both split dim ``d``:
placements ``(_StridedShard(0, sf=tp), Shard(0))`` for a colwise-parallel weight) cuts each
of ``f`` pieces of dim ``d`` and concatenates the rank's cut of every piece. Applied left to
right over the mesh dims, they give, for every tensor dim, the list of global indices the
local tensor's indices stand for. Those lists are DTensor's own: ``Shard``'s chunk
arithmetic (``Shard.local_shard_size_and_offset``) while a list is still a range, else the
placement's ``_split_tensor`` (the function ``distribute_tensor`` splits tensors with, and
that torch's own offsets for strided shards come from) applied to a tensor of indices. The
result is checked against ``compute_local_shape_and_global_offset`` (what DCP uses) and
the local tensor's shape.

The local tensor's elements are then the product of those lists. Cutting each list into
runs of consecutive indices cuts the local tensor into **parts**, each a box of the global
tensor and a box of the local tensor of the same extent. A ``Shard``/``Replicate`` layout
is one part (its local tensor is one box: the format-2 case); a strided one may be several.
A ``Partial`` placement holds unreduced values (a sum of the ranks' tensors), not state,
and is refused. This module knows nothing of blocks or stores.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import TensorMismatch
from ..format.tensors import is_dtensor

__all__ = ["MAX_PARTS", "Part", "dim_indices", "index_runs", "parts_of", "local_parts", "part_views"]

#: Most parts one rank's local tensor of one tensor may be cut into (a placement that
#: fragments it further is refused rather than planned block by block).
MAX_PARTS = 4096

#: A part of a local tensor: (its box in the global tensor, the local index of its first element).
Part = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, ...]]


def _kind(p: Any) -> str:
    from torch.distributed.tensor import Replicate, Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - a torch without strided shards
        _StridedShard = ()  # type: ignore[assignment,misc]
    if isinstance(p, _StridedShard):  # not a subclass of Shard in torch 2.13, but check it first
        return "strided"
    if type(p) is Shard:
        return "shard"
    if type(p) is Replicate:
        return "replicate"
    return "other"


def dim_indices(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    what: str = "tensor",
) -> list[range | torch.Tensor]:
    """For each dim of a ``shape`` tensor, the global index of each index of the local tensor
    that mesh ``coordinate`` holds under ``placements``: a ``range`` while only ``Shard``
    splits the dim (``Shard.local_shard_size_and_offset``, DTensor's chunk arithmetic), else
    an integer tensor (``_split_tensor`` of the indices: only strided dims cost memory).

    Placements apply left to right, each to the indices the previous ones left (DTensor's
    convention, which ``_StridedShard`` exists to keep). TensorMismatch, naming ``what``,
    for a placement that is not Shard, _StridedShard or Replicate.
    """
    idx: list[range | torch.Tensor] = [range(int(d)) for d in shape]
    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        raise TensorMismatch(
            f"{what}: {len(placements)} placements for a {len(mesh_shape)}-d mesh (SPEC.md §Slices on the grid)"
        )
    for mesh_dim, p in enumerate(placements):
        kind = _kind(p)
        if kind == "replicate":
            continue
        if kind == "other":
            raise TensorMismatch(
                f"{what}: DTensor placement {p} is not supported: Shard, _StridedShard and Replicate are; "
                "a Partial holds unreduced values (a sum over ranks), not saved state: reduce it first "
                "(full_tensor() or redistribute to Replicate) (SPEC.md §Slices on the grid)"
            )
        d = int(p.dim)
        if not 0 <= d < len(shape):
            raise TensorMismatch(f"{what}: placement {p} splits dim {d} of a {len(shape)}-d tensor")
        ix = idx[d]
        c = int(coordinate[mesh_dim])
        chunk = getattr(p, "local_shard_size_and_offset", None) if kind == "shard" else None
        if isinstance(ix, range) and chunk is not None:  # DTensor's own torch.chunk arithmetic: a range stays a range
            size, off = chunk(len(ix), int(mesh_shape[mesh_dim]), c)
            idx[d] = ix[int(off) : int(off) + int(size)]
            continue
        if isinstance(ix, range):
            ix = torch.arange(ix.start, ix.stop, dtype=torch.int32 if ix.stop < 2**31 else torch.int64)
        probe = ix.reshape([1] * d + [-1])  # the indices so far, laid along dim d
        pieces, _ = p._split_tensor(probe, int(mesh_shape[mesh_dim]), with_padding=False, contiguous=False)
        idx[d] = pieces[c].reshape(-1) if c < len(pieces) else ix[:0]
    return idx


def index_runs(ix: range | torch.Tensor) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of each run of consecutive global indices in ``ix``."""
    n = len(ix) if isinstance(ix, range) else int(ix.numel())
    if n == 0:
        return []
    if isinstance(ix, range):
        return [(ix.start, 0, n)]
    breaks = (torch.nonzero(ix[1:] - ix[:-1] != 1).reshape(-1) + 1).tolist()
    starts = [0, *breaks]
    stops = [*breaks, n]
    return [(int(ix[a]), a, b - a) for a, b in zip(starts, stops)]


def parts_of(indices: Sequence[range | torch.Tensor], what: str = "tensor") -> list[Part]:
    """The parts of a local tensor whose dim-``k`` index ``i`` stands for global index ``indices[k][i]``:
    one per combination of runs, in C order of their local starts. An empty local tensor has none."""
    runs = [index_runs(ix) for ix in indices]
    count = math.prod(len(r) for r in runs)
    if count > MAX_PARTS:
        raise TensorMismatch(
            f"{what}: its local tensor is {count} separate boxes of the global tensor, more than {MAX_PARTS} (SPEC.md §Slices on the grid)"
        )
    out: list[Part] = []
    for combo in itertools.product(*runs):
        out.append(((tuple(g for g, _, _ in combo), tuple(n for _, _, n in combo)), tuple(lo for _, lo, _ in combo)))
    return out  # a 0-d tensor: the one empty combination, one part


def local_parts(t: torch.Tensor, what: str = "tensor") -> tuple[torch.Tensor, list[Part]]:
    """(local tensor, its parts): a DTensor's slice cut into boxes of the global tensor, or a
    plain tensor whole (one part). An empty local tensor is one part of extent zero at the
    offset torch gives it (so an empty tensor's one block still has a writer).

    TensorMismatch naming ``what`` for a placement that is not supported, a shard order that
    is not the placements' own, or a local tensor whose shape or offset disagrees with
    ``compute_local_shape_and_global_offset``.
    """
    if not is_dtensor(t):
        return t, [(((0,) * t.dim(), tuple(t.shape)), (0,) * t.dim())]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements, shape = t.device_mesh, tuple(t.placements), tuple(int(d) for d in t.shape)  # type: ignore[attr-defined]
    spec = getattr(t, "_spec", None)
    order = getattr(spec, "shard_order", None)
    if order is not None and not getattr(spec, "use_strided_shard_as_shard_order", False):
        default = (
            type(spec).compute_default_shard_order(placements)
            if hasattr(type(spec), "compute_default_shard_order")
            else order
        )
        if tuple(order) != tuple(default):
            raise TensorMismatch(
                f"{what}: DTensor shards in the order {order}, not its placements' left-to-right order; "
                "redistribute it to the default order first (SPEC.md §Slices on the grid)"
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise TensorMismatch(f"{what}: this rank is not in the DTensor's mesh (SPEC.md §Slices on the grid)")
    # The local tensor itself, not ``to_local()``'s autograd view (which refuses in-place writes).
    local = getattr(t, "_local_tensor", None)
    local = (local if local is not None else t.to_local()).detach()  # type: ignore[attr-defined]
    indices = dim_indices(shape, tuple(mesh.shape), coordinate, placements, what)
    want, origin = compute_local_shape_and_global_offset(shape, mesh, placements)
    got = tuple(len(ix) if isinstance(ix, range) else int(ix.numel()) for ix in indices)
    if tuple(local.shape) != got or tuple(want) != got:
        raise TensorMismatch(
            f"{what}: DTensor's local tensor has shape {list(local.shape)}; its placements {placements} give {list(got)} (torch says {list(want)})"
        )
    if math.prod(got) == 0:
        return local, [((tuple(int(o) for o in origin), got), (0,) * len(got))]
    first = tuple(int(ix[0]) for ix in indices)  # a range or a tensor: its first index
    if first != tuple(int(o) for o in origin):
        raise TensorMismatch(
            f"{what}: placements {placements} put this rank's first element at {list(first)}, torch says {list(origin)}"
        )
    return local, parts_of(indices, what)


def part_views(t: torch.Tensor, what: str = "tensor") -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """Views of ``t``'s local tensor, one per part, each with the global index of its first element."""
    local, parts = local_parts(t, what)
    out = []
    for (start, extent), lo in parts:
        sl = tuple(slice(a, a + n) for a, n in zip(lo, extent))
        out.append((local[sl] if sl else local, start))
    return out
