"""Which elements of the global tensor a DTensor's local tensor holds, as boxes
(SPEC.md §Slices on the grid).

A DTensor's placements say how each mesh dim splits the tensor: ``Shard(d)`` cuts dim
``d`` into ``torch.chunk`` pieces, ``Replicate`` copies it, and ``_StridedShard(d,
split_factor=f)`` (what FSDP2 puts on top of tensor parallelism when both split dim ``d``:
placements ``(_StridedShard(0, sf=tp), Shard(0))`` for a colwise-parallel weight) cuts each
of ``f`` pieces of dim ``d`` and concatenates the rank's cut of every piece. Applied left to
right over the mesh dims, they give, for every tensor dim, the list of global indices the
local tensor's indices stand for. Those lists are DTensor's own: ``torch.chunk``'s
arithmetic (``Shard.local_shard_size_and_offset``, in plain ints), applied to each of a
strided split's pieces while the list is still a range — so a rank works out its own list
in O(split factor), never splitting the dim for every rank of the mesh — else the
placement's ``_split_tensor`` (the function ``distribute_tensor`` splits tensors with)
applied to a tensor of indices. The result is checked against
``compute_local_shape_and_global_offset`` (what DCP uses) and the local tensor's shape;
``mesh_parts`` gives any rank's parts from its coordinate, without a DTensor.

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

__all__ = [
    "MAX_PARTS",
    "Part",
    "dim_indices",
    "index_runs",
    "parts_of",
    "mesh_parts",
    "local_parts",
    "part_views",
    "placement_key",
]

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


def placement_key(p: Any) -> tuple[Any, ...]:
    """A placement as plain values, what its split depends on: ``("shard", dim)``,
    ``("strided", dim, split_factor)`` or ``("replicate",)``; ``("other", repr)`` for a placement
    that is not supported (``dim_indices`` refuses it)."""
    kind = _kind(p)
    if kind == "shard":
        return (kind, int(p.dim))
    if kind == "strided":
        return (kind, int(p.dim), int(p.split_factor))
    if kind == "replicate":
        return (kind,)
    return (kind, repr(p))


def dim_indices(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    what: str = "tensor",
) -> list[range | torch.Tensor]:
    """For each dim of a ``shape`` tensor, the global index of each index of the local tensor
    that mesh ``coordinate`` holds under ``placements``: a ``range`` while only ``Shard``
    splits the dim (``Shard.local_shard_size_and_offset``'s torch.chunk arithmetic), else an
    integer tensor of the rank's own indices (a strided split of a range: that arithmetic
    piece by piece, O(split factor) whatever the mesh; of indices already strided: the
    placement's ``_split_tensor``).

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
        if kind == "shard":  # torch.chunk's arithmetic: a range stays a range
            size, off = _chunk(len(ix) if isinstance(ix, range) else int(ix.numel()), int(mesh_shape[mesh_dim]), c)
            idx[d] = ix[off : off + size]
            continue
        if (
            isinstance(ix, range) and kind == "strided"
        ):  # the same chunk arithmetic per piece: O(split factor), not O(mesh)
            idx[d] = _strided_range(ix, int(p.split_factor), int(mesh_shape[mesh_dim]), c)
            continue
        if isinstance(ix, range):
            ix = _arange(ix)
        probe = ix.reshape([1] * d + [-1])  # the indices so far, laid along dim d
        pieces, _ = p._split_tensor(probe, int(mesh_shape[mesh_dim]), with_padding=False, contiguous=False)
        idx[d] = pieces[c].reshape(-1) if c < len(pieces) else ix[:0]
    return idx


def _chunk(n: int, chunks: int, c: int) -> tuple[int, int]:
    """(size, offset) of chunk ``c`` when ``n`` indices are cut into ``chunks`` as ``torch.chunk``
    cuts them (empty chunks at the end): DTensor's ``Shard.local_shard_size_and_offset`` in plain ints."""
    if n % chunks == 0:
        return n // chunks, n // chunks * c
    full = -(-n // chunks)
    start = min(full * c, n)
    return max(0, min(n, full * c + full) - start), start


def _arange(ix: range) -> torch.Tensor:
    return torch.arange(ix.start, ix.stop, dtype=torch.int32 if ix.stop < 2**31 else torch.int64)


def _strided_range(ix: range, split_factor: int, mesh_size: int, c: int) -> range | torch.Tensor:
    """What ``_StridedShard._split_tensor`` gives coordinate ``c`` of the indices ``ix`` (a
    range), without splitting them for every coordinate: ``ix`` cut into ``split_factor``
    pieces, each piece cut into ``mesh_size`` chunks, chunk ``c`` of every piece joined (the
    torch.chunk arithmetic of ``Shard.local_shard_size_and_offset`` at both cuts). A range if
    the chunks are consecutive, else an integer tensor of the rank's own indices."""
    runs = []
    for j in range(split_factor):
        size, off = _chunk(len(ix), split_factor, j)
        piece = ix[off : off + size]
        size, off = _chunk(len(piece), mesh_size, c)
        run = piece[off : off + size]
        if len(run):
            runs.append(run)
    if not runs:
        return ix[:0]
    if all(a.stop == b.start for a, b in zip(runs, runs[1:])):
        return range(runs[0].start, runs[-1].stop)
    return torch.cat([_arange(r) for r in runs])


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
    got, parts = mesh_parts(shape, tuple(mesh.shape), coordinate, placements, what)
    if tuple(local.shape) != got:
        raise TensorMismatch(
            f"{what}: DTensor's local tensor has shape {list(local.shape)}; its placements {placements} give {list(got)}"
        )
    return local, parts


def mesh_parts(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    what: str = "tensor",
    *,
    check: bool = True,
) -> tuple[tuple[int, ...], list[Part]]:
    """(local shape, parts) of the ``shape`` tensor that mesh ``coordinate`` holds under
    ``placements``: ``local_parts`` without a DTensor (a pure function of its arguments, so the
    parts of any rank can be worked out anywhere). An empty local tensor is one part of extent
    zero at the offset torch gives it. TensorMismatch naming ``what`` as ``local_parts``.

    ``check``: compare the local shape and first offset with torch's own
    (``_compute_local_shape_and_global_offset``, which costs O(mesh size + dim size) for a
    strided dim). ``local_parts`` always checks; a planner working out other ranks' parts,
    from placements whose own rank checked them, may skip it.
    """
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape = tuple(int(d) for d in shape)
    indices = dim_indices(shape, mesh_shape, coordinate, placements, what)
    got = tuple(len(ix) if isinstance(ix, range) else int(ix.numel()) for ix in indices)
    empty = math.prod(got) == 0
    if not check:
        if not empty:
            return got, parts_of(indices, what)
        # torch's offset of an empty local tensor: on each dim, the dim's size where this rank
        # has no index, else its first index (tests/shardstore/sharded/test_placement.py holds it to torch's own)
        origin = tuple(d if n == 0 else int(ix[0]) for d, n, ix in zip(shape, got, indices))
        return got, [((origin, got), (0,) * len(got))]
    want, origin = _compute_local_shape_and_global_offset(shape, tuple(mesh_shape), list(coordinate), placements)
    if tuple(want) != got:
        raise TensorMismatch(
            f"{what}: placements {placements} give a local tensor of shape {list(got)}, torch says {list(want)}"
        )
    if empty:
        return got, [((tuple(int(o) for o in origin), got), (0,) * len(got))]
    first = tuple(int(ix[0]) for ix in indices)  # a range or a tensor: its first index
    if first != tuple(int(o) for o in origin):
        raise TensorMismatch(
            f"{what}: placements {placements} put this rank's first element at {list(first)}, torch says {list(origin)}"
        )
    return got, parts_of(indices, what)


def part_views(t: torch.Tensor, what: str = "tensor") -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """Views of ``t``'s local tensor, one per part, each with the global index of its first element."""
    local, parts = local_parts(t, what)
    out = []
    for (start, extent), lo in parts:
        sl = tuple(slice(a, a + n) for a, n in zip(lo, extent))
        out.append((local[sl] if sl else local, start))
    return out
