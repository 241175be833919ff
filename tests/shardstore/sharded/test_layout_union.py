"""Step 1 of the block exchange by layout (SPEC.md §Block exchange): when every rank's layout
digest is the same, each rank works out every rank's boxes from its own DTensors' meshes and
placements (``derive_union``) instead of all-gathering every rank's description. Pure tests,
no processes: the derived union (boxes, the ranks holding each, in order), the plain holders,
the block plan and the recorders are those the descriptions give (``plan_exchange``, the
reference), on FSDP2 x TP meshes (strided shards), uneven and empty splits, replicas, a 3-d
mesh, a group whose ranks are not the mesh's global ranks, and a mesh with ranks outside the
group (whose coverage error names the same ranks). The real multi-process path, with the
commit id against the descriptions' path: tests/shardstore/sharded/test_dtensor_mesh.py."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardstore.errors import TensorMismatch
from shardstore.sharded.dtensor import (
    Described,
    ExchangePlan,
    Layout,
    derive_union,
    gather_union,
    layouts_agree,
    plan_exchange,
    plan_local,
    plan_union,
)
from shardstore.sharded.exchange import NOT_MINE
from shardstore.sharded.placement import mesh_parts


def _llama_like(dp: int, tp: int) -> list[tuple[str, tuple[int, ...], tuple]]:
    """(name, shape, placements) of a tiny transformer layer under FSDP2 (dp) x TP (torchtitan's plan)."""
    col = (_StridedShard(0, split_factor=tp), Shard(0))
    return [
        ("attn.k", (4, 24), col),  # fewer rows than dp x tp: many ranks hold empty slices
        ("attn.o", (24, 24), (Shard(0), Shard(1))),
        ("attn.q", (24, 24), col),
        ("embed", (50, 24), (Shard(0), Shard(1))),
        ("empty", (0, 24), col),  # one empty block, written by a holder of the first slice
        ("multi", (10, 24), (Replicate(), _StridedShard(0, split_factor=2))),  # two parts a rank, replicated
        ("mlp.up", (70, 24), col),  # uneven: 70 rows over tp, then dp
        ("norm", (24,), (Shard(0), Replicate())),  # replicated over tp
        ("long", (3_000_001,), (Shard(0), Replicate())),  # 3 blocks of slices replicated over tp, in turn
        ("wide", (4, 1_200_000), (Replicate(), Shard(1))),  # 5 blocks, a column split replicated over dp
    ]


def _peers(
    mesh_shape: tuple[int, ...], ranks: tuple[int, ...], world: int, g, tensors, roles, plain
) -> list[list[Described]]:
    """Every group rank's descriptions, as ``describe`` gives them (``mesh_parts`` with torch's check)."""
    at = {r: k for k, r in enumerate(ranks)}
    peers = []
    for r in range(world):
        k = at.get(g(r))
        desc = []
        if k is not None:
            coord = []
            for d in reversed(mesh_shape):
                coord.append(k % d)
                k //= d
            coord = tuple(reversed(coord))
            for name, role in sorted((n, role) for n, _, _ in tensors for role in roles):
                shape, pl = next((s, p) for n, s, p in tensors if n == name)
                _, parts = mesh_parts(shape, mesh_shape, coord, pl)
                desc.append(Described(name, role, "float32", shape, tuple(b for b, _ in parts)))
        desc += [Described(n, "plain", dt, sh, ()) for n, dt, sh in plain]
        peers.append(desc)
    return peers


def _layout(mesh_shape, ranks, tensors, roles, plain) -> Layout:
    items = sorted((n, role, "float32", s, 0, p) for n, s, p in tensors for role in roles)
    return Layout(b"", [(mesh_shape, ranks)], items, plain)


MESHES = [
    pytest.param((4, 2), None, id="fsdp2x2-tp2"),
    pytest.param((8, 4), None, id="fsdp8-tp4"),
    pytest.param((3, 2), None, id="fsdp3-tp2-uneven"),
    pytest.param((16,), None, id="fsdp16"),
    pytest.param((2, 2, 2), None, id="3d"),
    pytest.param((2, 2), (4, 5, 6, 7), id="group-not-global"),
]


def _placements_for(mesh_shape: tuple[int, ...], tensors):
    """The tensors' placements fitted to a mesh of another dimension (1-d: Shard(0) or Replicate;
    3-d: a leading Replicate, as a replicated pipeline stage)."""
    if len(mesh_shape) == 2:
        return tensors
    if len(mesh_shape) == 1:
        return [(n, s, (Replicate(),) if n == "norm" else (Shard(0),)) for n, s, _ in tensors]
    return [(n, s, (Replicate(), *p)) for n, s, p in tensors]


def _mesh_case(mesh_shape, global_ranks):
    """The group's size, the mesh's ranks, group rank -> global rank, and the Llama-like tensors."""
    world = 1
    for d in mesh_shape:
        world *= d
    ranks = global_ranks or tuple(range(world))
    g = (lambda r: ranks[r]) if global_ranks else (lambda r: r)
    tp = mesh_shape[-1] if len(mesh_shape) > 1 else 1
    return world, ranks, g, _placements_for(mesh_shape, _llama_like(mesh_shape[0], tp))


def _union_of(mesh_shape, global_ranks):
    world, ranks, g, tensors = _mesh_case(mesh_shape, global_ranks)
    return derive_union(_layout(mesh_shape, ranks, tensors, ("exp_avg", "param"), []), world, g), world


@pytest.mark.parametrize("mesh_shape, global_ranks", MESHES)
def test_each_ranks_local_plan_is_its_part_of_the_whole_plan(mesh_shape, global_ranks):
    """``plan_local``: every block in ``plan_union``'s order; those a rank owns with the whole
    plan's pieces, those it sends a piece of with the whole plan's owner and the pieces it sends
    there (the same sources, so the same bytes cross), the others with neither. Before, every
    rank planned every piece of every block."""
    (union, _), world = _union_of(mesh_shape, global_ranks)
    whole = plan_union(union, world)
    involved_somewhere = set()
    for rank in range(world):
        local = plan_local(union, world, rank)
        assert [(b.key, b.index, b.box, b.dtype) for b in local] == [(b.key, b.index, b.box, b.dtype) for b in whole]
        for mine, b in zip(local, whole):
            if b.owner == rank:
                assert mine == b, (rank, b.key, b.index)
                involved_somewhere.add((b.key, b.index))
            elif any(src == rank for src, _ in b.sends):
                assert mine.owner == b.owner and mine.sends == [(s, c) for s, c in b.sends if s == rank]
                involved_somewhere.add((b.key, b.index))
            else:
                assert (mine.owner, mine.sends) == (NOT_MINE, []), (rank, b.key, b.index)
    assert involved_somewhere == {(b.key, b.index) for b in whole}  # every block is some rank's


def test_a_local_plan_costs_this_ranks_pieces_not_every_piece(monkeypatch):
    """Tensors sharing a slice table (every layer's q_proj, each role) are intersected with the
    grid once, and a rank lists only its blocks' pieces: at 64 x 8 ranks a rank's plan of 24
    such tensors lists under 3% of the whole plan's pieces."""
    import shardstore.sharded.dtensor as sdt

    mesh_shape, world = (64, 8), 512
    col = (_StridedShard(0, split_factor=8), Shard(0))
    tensors = [(f"layers.{i}.q", (4096, 1024), col) for i in range(12)]
    layout = _layout(mesh_shape, tuple(range(world)), tensors, ("exp_avg", "param"), [])
    union, _ = derive_union(layout, world, lambda r: r)
    grids = []
    real = sdt.grid
    monkeypatch.setattr(sdt, "grid", lambda *a, **k: grids.append(a) or real(*a, **k))
    local = plan_local(union, world, 3)
    assert len(grids) == 1  # one skeleton for the 24 tensors
    whole = plan_union(union, world)
    listed = sum(len(b.sends) for b in local)
    assert 0 < listed < 0.03 * sum(len(b.sends) for b in whole)


@pytest.mark.parametrize("mesh_shape, global_ranks", MESHES)
def test_the_union_worked_out_from_the_layout_is_the_descriptions_union(mesh_shape, global_ranks):
    world, ranks, g, tensors = _mesh_case(mesh_shape, global_ranks)
    roles = ("exp_avg", "param")
    plain = [("buf", "float32", (3,))]
    reference = plan_exchange(_peers(mesh_shape, ranks, world, g, tensors, roles, plain))
    union, holders = derive_union(_layout(mesh_shape, ranks, tensors, roles, plain), world, g)
    assert list(union) == list(reference.union)  # the same tensors in the same order
    for key, (dtype, shape, held) in reference.union.items():
        assert union[key][:2] == (dtype, shape), key
        assert list(union[key][2].items()) == list(held.items()), key  # boxes and holders, in order
    assert holders == reference.plain
    planned = ExchangePlan(union, holders, plan_union(union, world))
    assert planned.blocks == reference.blocks  # every owner and every piece's source
    assert planned.recorders() == reference.recorders()  # who records each entry: the commit's bytes


def test_a_mesh_with_ranks_outside_the_group_fails_naming_the_same_ranks():
    """Ranks 0-3 of a 2 x 4 mesh save without 4-7: the slices they hold do not cover the
    tensors, and the error names the same ranks and slices as from the descriptions."""
    mesh_shape, ranks, world = (2, 4), tuple(range(8)), 4
    tensors = [("w", (8, 8), (Shard(0), Shard(1)))]
    peers = _peers(mesh_shape, ranks, world, lambda r: r, tensors, ("param",), [])
    with pytest.raises(TensorMismatch) as old:
        plan_exchange(peers)
    union, _ = derive_union(_layout(mesh_shape, ranks, tensors, ("param",), []), world, lambda r: r)
    with pytest.raises(TensorMismatch) as new:
        plan_union(union, world)
    assert str(new.value) == str(old.value)
    assert "cover 32 of 64" in str(new.value)


def test_layouts_agree_only_on_one_digest_from_every_rank():
    d = b"\x00" + bytes(range(32))
    assert layouts_agree([d, d, d])
    assert not layouts_agree([d, d, b"\x00" + bytes(32)])
    assert not layouts_agree([d, b"\x01" + b"failed"])
    assert gather_union([[], []]) == ({}, {})
