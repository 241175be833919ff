"""Random layouts (adversarial review of SPEC.md §Block exchange steps 1-3, pure, no processes):
for meshes of 1-3 dims and up to 64 ranks (two meshes per state, one in a shuffled rank order),
tensors split by Shard, _StridedShard and Replicate (uneven, empty slices, several parts a rank,
tensors sharing a slice table), on a grid of tiny blocks so tensors have many:

- ``derive_union`` from the layout is the descriptions' union (boxes, holders, their order);
- ``plan_local`` on each rank is its view of ``plan_union`` (``_as_seen_by``), and each block has
  exactly one owner over the ranks' local plans;
- cut into batches as ``run_plan`` cuts them, what each rank stages (``_Exchange.stage``) pairs
  every receive with one send: the same pair of ranks, batch and tag, and the same piece shape
  (tags are counted per pair of ranks, so a sender and an owner must list that pair's pieces
  in the same order from their own local plans, or a send meets the wrong receive)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import shardstore.sharded.dtensor as sdt
import shardstore.sharded.exchange as sex
from shardstore.format.grid import grid as real_grid
from shardstore.format.tensors import expected_nbytes
from shardstore.sharded.placement import mesh_parts


def _coord(k: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    c = []
    for d in reversed(mesh_shape):
        c.append(k % d)
        k //= d
    return tuple(reversed(c))


def _case(rng: random.Random):
    mesh_shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.choice([1, 2, 2, 3])))
    world = math.prod(mesh_shape)
    perm = list(range(world))
    if rng.random() < 0.3:
        rng.shuffle(perm)
    other = rng.choice([(world,), (1, world)] + [(a, world // a) for a in (2, 3, 4) if world % a == 0])
    perm2 = list(range(world))
    rng.shuffle(perm2)
    meshes = [(mesh_shape, tuple(perm)), (other, tuple(perm2))]
    tensors = []
    for i in range(rng.randint(1, 4)):
        mi = rng.randrange(2)
        ndim = rng.choice([1, 2, 2])
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 13, 24, 40]) for _ in range(ndim))
        pl = []
        for _ in meshes[mi][0]:
            r, d = rng.random(), rng.randrange(ndim)
            pl.append(
                Replicate() if r < 0.3 else Shard(d) if r < 0.8 else _StridedShard(d, split_factor=rng.choice([2, 3]))
            )
        tensors.append((f"t{i}", shape, tuple(pl), rng.choice(["float32", "bfloat16"]), mi))
    if rng.random() < 0.5:  # another name with the same layout: one slice table shared
        n, s, p, dt, mi = tensors[0]
        tensors.append(("u" + n, s, p, dt, mi))
    plain = [("pl", "float32", (3,))] if rng.random() < 0.5 else []
    roles = ("exp_avg", "param") if rng.random() < 0.5 else ("param",)
    return meshes, tensors, plain, roles, world


@pytest.mark.parametrize("block_bytes, batch_bytes", [(64, 256), (16, 40), (256, 1 << 20)])
def test_random_layouts_plan_and_stage_alike_on_every_rank(monkeypatch, block_bytes, batch_bytes):
    monkeypatch.setattr(sdt, "grid", lambda dtype, shape, **k: real_grid(dtype, shape, block_bytes=block_bytes))
    monkeypatch.setattr(sex, "BATCH_BYTES", batch_bytes)
    checked = 0
    for seed in range(70):
        meshes, tensors, plain, roles, world = _case(random.Random(seed))
        peers, locals_of = [], []
        for r in range(world):
            desc, loc = [], {}
            for n, role in sorted((t[0], role) for t in tensors for role in roles):
                _, shape, pl, dt, mi = next(t for t in tensors if t[0] == n)
                ms, ranks = meshes[mi]
                got, parts = mesh_parts(shape, ms, _coord(ranks.index(r), ms), pl)
                desc.append(sdt.Described(n, role, dt, shape, tuple(b for b, _ in parts)))
                # (box, virtual origin), as ``local_region`` gives them
                loc[(n, role)] = (
                    torch.zeros(got, dtype=getattr(torch, dt)),
                    [(b, tuple(s - lo for s, lo in zip(b[0], at))) for b, at in parts],
                )
            desc += [sdt.Described(n, "plain", dt, sh, ()) for n, dt, sh in plain]
            peers.append(desc)
            locals_of.append(loc)
        used = sorted({t[4] for t in tensors})
        items = sorted((n, role, dt, s, used.index(mi), p) for n, s, p, dt, mi in tensors for role in roles)
        union, holders = sdt.derive_union(sdt.make_layout([meshes[m] for m in used], items, plain), world, lambda r: r)
        ref = sdt.plan_exchange(peers)
        assert list(union) == list(ref.union), seed
        for key, (dt, sh, held) in ref.union.items():
            assert union[key][:2] == (dt, sh) and list(union[key][2].items()) == list(held.items()), (seed, key)
        assert holders == ref.plain
        owners = [0] * len(ref.blocks)
        sends, recvs = {}, {}
        for r in range(world):
            local = sdt.plan_local(union, world, r)
            assert [sdt._as_seen_by(r, b) for b in ref.blocks] == local, (seed, r)
            for i, b in enumerate(local):
                owners[i] += b.owner == r
            ex = sex._Exchange(None, r, lambda x: x, None, 1, sex.ExchangeStats(), sex._Arena(), None, locals_of[r])
            i = 0
            while i < len(local):  # run_plan's batches
                j, size = i, 0
                while j < len(local) and (
                    j == i or size + expected_nbytes(local[j].dtype, local[j].box[1]) <= sex.BATCH_BYTES
                ):
                    size += expected_nbytes(local[j].dtype, local[j].box[1])
                    j += 1
                owned, sending, _ = ex.stage(local[i:j], i)
                for o in owned:
                    for tag, src, piece in o.arriving:
                        assert (i, src, r, tag) not in recvs, seed
                        recvs[(i, src, r, tag)] = tuple(piece[1])
                for s in sending:
                    assert (i, r, s.to, s.tag) not in sends, seed
                    sends[(i, r, s.to, s.tag)] = tuple(s.view.shape)
                i = j
        assert owners == [1] * len(ref.blocks), seed
        assert recvs == sends, seed
        checked += bool(sends)
    assert checked > 20  # most cases exchange pieces
