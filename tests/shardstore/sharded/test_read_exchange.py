"""Restore by exchange over real Gloo groups: each block read once per group (SPEC.md §16.2).

One group of 4 processes does everything (starting processes is the expensive part). FSDP2
trains 2 AdamW steps on all 4 and saves; ``fc1.weight`` is 10 x 131072 float32, two column
tiles, so every rank's rows overlap both tiles and a restore on its own reads both on every rank.
Then, each time against a fresh FSDP2 model and optimizer, its object reads counted:

- on 4 ranks and on 2 (ranks 0-1, a group of their own): the restore on its own, then by
  exchange (``restore(..., group=)``), whose local tensors must be bitwise those of the first;
- a group of one process: the restore on its own, unchanged;
- ``load_state_dict_into(..., group=)`` of a state dict saved from the FSDP2 model's, and
  ``dcp.load`` through ``StoreReader(group=)`` of the state saved whole by rank 0;
- a 4096 x 1024 tensor saved whole (4 bands of rows) restored into ``Shard(1)``: one band read
  by each rank, column strips sent;
- a rank whose plan fails (a model of another shape): every rank raises its TensorMismatch;
- one block removed: ObjectNotFound naming it on every rank, no destination touched on any;
- one block overwritten with other bytes of its size: CorruptObject naming it on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dtensor_models import Net
from dtensor_models import adamw as _opt
from dtensor_models import fsdp as _fsdp
from dtensor_models import train as _train
from gloo_group import run_group_on_store
from read_counter import ReadCounter

import shardstore as ss
from shardstore.format.grid import grid, payload_blocks
from shardstore.format.manifest import state_payloads, tensor_payloads
from shardstore.sharded.read_exchange import TILES, Needed, last_group_read, plan_group_read
from shardstore.store.keys import object_key


def _locals(model, opt) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(p.to_local().clone())
        for k in ("exp_avg", "exp_avg_sq"):
            out.append(opt.state[p][k].to_local().clone())
        out.append(torch.as_tensor(float(opt.state[p]["step"])))
    return out


def _blocks(store: ss.Store, cid: str) -> dict[str, int]:
    """Object key -> bytes of every tensor block the commit names."""
    out = {}
    for e in ss.load_commit(store, cid).entries().values():
        for _, p, d in tensor_payloads(e):
            out.update({object_key(o): n for o, _, n in payload_blocks(p, d, e.shape)})
        for _, p, d, shape in state_payloads(e):
            out.update({object_key(o): n for o, _, n in payload_blocks(p, d, shape)})
    return out


def _restore(store: ss.Store, cid: str, mesh, group) -> dict:
    """A fresh FSDP2 model restored on its own and by exchange: reads (block keys) and equality."""
    blocks = _blocks(store, cid)
    out: dict = {}
    locs = []
    for how in ("alone", "exchange"):
        m = _fsdp(mesh)
        opt = _opt(m)
        counter = ReadCounter(store.storage)
        r = ss.restore(ss.Store(counter, create=False), cid, m, opt, group=group if how == "exchange" else None)
        out[how] = {k: n for k, n in counter.keys.items() if k in blocks}
        out[f"{how}_bytes_read"] = r.bytes_read
        locs.append(_locals(m, opt))
    out["equal"] = all(torch.equal(a, b) for a, b in zip(*locs)) and len(locs[0]) == len(locs[1])
    out["stats"] = vars(last_group_read()).copy()
    return out


def _failures(rank: int, root: str, store: ss.Store, cid: str, mesh, group) -> dict:
    out: dict = {}
    e = ss.load_commit(store, cid).entries()["fc1.weight"]
    # two tiles of fc1.weight, each read by one rank and sent in pieces to the others
    blocks = [object_key(e.param[0].object), object_key(e.optim.exp_avg_sq[1].object)]
    # a rank whose plan fails: a model of another shape on rank 3
    m = _fsdp(mesh, Net(rows=12) if rank == 3 else None)
    try:
        ss.restore(store, cid, m, _opt(m), group=group)
    except ss.ShardstoreError as e:
        out["plan"] = [type(e).__name__, str(e)]
    # a missing block: refused on every rank before any byte lands on any
    gone = blocks[0]
    path = Path(root) / gone
    dist.barrier()
    if rank == 0:
        path.rename(path.with_name("moved"))
    dist.barrier()
    m = _fsdp(mesh)
    opt = _opt(m)
    with torch.no_grad():
        for p in m.parameters():
            p.to_local().fill_(7.0)
    try:
        ss.restore(store, cid, m, opt, group=group)
    except ss.ShardstoreError as e:
        out["missing"] = [type(e).__name__, str(e), gone.rsplit("/", 1)[1]]
    out["missing_untouched"] = all(bool((p.to_local() == 7.0).all()) for p in m.parameters())
    dist.barrier()
    if rank == 0:
        path.with_name("moved").rename(path)
        bad = Path(root) / blocks[1]  # right size, other bytes
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0xFF
        os.chmod(bad, 0o644)
        bad.write_bytes(bytes(data))
    dist.barrier()
    m = _fsdp(mesh)
    try:
        ss.restore(store, cid, m, _opt(m), group=group)
    except ss.ShardstoreError as e:
        out["corrupt"] = [type(e).__name__, str(e), blocks[1].rsplit("/", 1)[1]]
    return out


def _body(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    store = ss.open_store(root)
    pair = dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (world,))
    m = _fsdp(mesh)
    opt = _opt(m)
    _train(m, opt, 2, seed=1)
    cid = ss.save_distributed(store, m, opt, info=ss.CommitInfo(step=2, job="read-exchange"), rng=False, ref="main")
    result: dict = {"four": _restore(store, cid, mesh, dist.group.WORLD)}
    solos = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    m1 = _fsdp(mesh)
    before = last_group_read()
    one = ss.restore(store, cid, m1, _opt(m1), group=solos[rank])  # a group of one: the restore on its own
    result["solo"] = {"untouched": last_group_read() is before, "bytes_read": one.bytes_read}
    if rank < 2:
        result["two"] = _restore(store, cid, DeviceMesh.from_group(pair, "cpu"), pair)
    dist.barrier()
    # the state-dict entry point: DTensors saved by save_state_dict, loaded in place by exchange
    sd = ss.save_state_dict(store, {"model": m.state_dict()}, ref=None, parent=None)
    back = _fsdp(mesh)
    with torch.no_grad():
        for p in back.parameters():
            p.to_local().zero_()
    ss.load_state_dict_into(store, {"model": back.state_dict()}, sd, group=dist.group.WORLD)
    result["state_dict_equal"] = all(
        torch.equal(p.to_local(), q.to_local()) for p, q in zip(m.parameters(), back.parameters())
    )
    result["state_dict_read"] = last_group_read().bytes_read
    # DCP's load through StoreReader(group=): the state saved whole by rank 0 (dcp.save, one chunk per
    # tensor), loaded into FSDP2 on all 4 ranks: every block of fc1.weight is needed by every rank
    import torch.distributed.checkpoint as dcp

    from shardstore.dcp import StoreReader, StoreWriter

    full = {k: v.full_tensor() for k, v in m.state_dict().items()}
    if rank == 0:
        dcp.save({"model": full}, storage_writer=StoreWriter(root, ref="dcp", step=2), no_dist=True)
    dist.barrier()
    back = _fsdp(mesh)
    with torch.no_grad():
        for p in back.parameters():
            p.to_local().zero_()
    reader = StoreReader(root, "dcp", group=dist.group.WORLD)
    dcp.load({"model": back.state_dict()}, storage_reader=reader)
    result["dcp_equal"] = all(
        torch.equal(p.to_local(), q.to_local()) for p, q in zip(m.parameters(), back.parameters())
    )
    result["dcp"] = vars(last_group_read()).copy()
    result["dcp_commit"] = reader.commit
    # a plain model on every rank: each block's one region held by all 4 (replicas), read once in the group
    plain = Net()
    ss.restore(store, cid, plain, _opt(plain), group=dist.group.WORLD)
    result["plain_equal"] = all(torch.equal(p, q.full_tensor()) for p, q in zip(plain.parameters(), m.parameters()))
    result["plain"] = vars(last_group_read()).copy()
    # columns out of row bands: 4096 x 1024 float32 saved whole (tiles: 4 bands of 1024 rows), restored
    # into Shard(1) on 4 ranks; every piece is a column strip of its block (copied out to be sent)
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(3))
    if rank == 0:
        ss.save(store, {"cols": full}, step=0, job="read-exchange", rng=False, ref="cols", parent=None)
    dist.barrier()
    cols = {"cols": distribute_tensor(torch.zeros(4096, 1024), mesh, (Shard(1),), src_data_rank=None)}
    ss.restore(store, "cols", cols, group=dist.group.WORLD)
    result["cols_equal"] = torch.equal(cols["cols"].to_local(), full[:, rank * 256 : (rank + 1) * 256])
    result["cols"] = vars(last_group_read()).copy()
    result["failures"] = _failures(rank, root, store, cid, mesh, dist.group.WORLD)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_group_on_store(_body, 4, tmp_path_factory.mktemp("read_exchange"), timeout_s=90)


@pytest.mark.parametrize("which", ["four", "two"])
def test_exchange_is_bitwise_the_restore_alone_and_reads_each_block_once(runs, which):
    root, results = runs
    ranks = [r[which] for r in results if which in r]
    assert len(ranks) == (4 if which == "four" else 2)
    assert all(r["equal"] for r in ranks)
    store = ss.open_store(root, create=False)
    sizes = _blocks(store, store.ref("main"))
    needed = set().union(*(r["alone"] for r in ranks))  # every block some rank's slices overlap
    assert needed and needed <= set(sizes)
    read = {}
    for r in ranks:
        for k, n in r["exchange"].items():
            read[k] = read.get(k, 0) + n
    assert read == dict.fromkeys(needed, 1)  # each needed block read exactly once in the group
    assert sum(r["exchange_bytes_read"] for r in ranks) == sum(sizes[k] for k in needed)
    alone = sum(r["alone_bytes_read"] for r in ranks)
    assert alone > sum(sizes[k] for k in needed)  # on its own, ranks read blocks twice or more
    # the pieces sent are the pieces received; the reads balanced within a block's size
    stats = [r["stats"] for r in ranks]
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats) > 0
    per = [r["exchange_bytes_read"] for r in ranks]
    assert max(per) - min(per) <= max(sizes[k] for k in needed)


def test_replicas_each_block_read_once_for_all_of_them(runs):
    root, results = runs
    assert all(r["plain_equal"] for r in results)
    store = ss.open_store(root, create=False)
    blocks = _blocks(store, store.ref("main"))
    stats = [r["plain"] for r in results]
    assert sum(s["bytes_read"] for s in stats) == sum(blocks.values())
    assert sum(s["bytes_received"] for s in stats) == 3 * sum(blocks.values())  # each block to the other 3


def test_column_strips_out_of_row_bands(runs):
    _, results = runs
    assert all(r["cols_equal"] for r in results)
    stats = [r["cols"] for r in results]
    assert [s["blocks_read"] for s in stats] == [1, 1, 1, 1]  # 4 bands, one each (every rank needs all 4)
    assert [s["bytes_read"] for s in stats] == [4 << 20] * 4
    assert [s["pieces_sent"] for s in stats] == [3] * 4 and [s["pieces_received"] for s in stats] == [3] * 4


def test_a_group_of_one_is_the_restore_on_its_own(runs):
    _, results = runs
    assert all(r["solo"]["untouched"] for r in results)
    assert [r["solo"]["bytes_read"] for r in results] == [r["four"]["alone_bytes_read"] for r in results]


def _needed(rank_rows: list[tuple[int, int]], shape: tuple[int, int]) -> list[list[Needed]]:
    """Each rank's description of one float32 payload: rows [a, b) of it (an empty range: nothing)."""
    return [
        [Needed("k" * 64, TILES, "float32", shape, (((a, 0), (b - a, shape[1])),))] if b > a else []
        for a, b in rank_rows
    ]


@pytest.mark.parametrize(
    "shape, rows",
    [
        ((96, 262144), [(0, 30), (30, 31), (31, 64), (64, 64), (64, 96)]),  # 32 tiles of 96 x 8192: all rows each
        ((4096, 1024), [(0, 1000), (1000, 1030), (1030, 2500), (2500, 2500), (2500, 4096)]),  # 4 bands of 1024 rows
        ((4096, 1024), [(0, 2048), (0, 2048), (2048, 4096), (1000, 3000), (4000, 4000)]),  # replicas and overlaps
    ],
)
def test_the_assignment_reads_each_block_once_by_a_rank_needing_it(shape, rows):
    """SPEC.md §16.2's rule, no processes: rows split unevenly over 5 ranks, one needing nothing; or
    held by replicas and overlapping; and each rank's own plan (``rank=``) agrees with the whole one."""
    peers = _needed(rows, shape)
    plan = plan_group_read(peers)
    assert [p.index for p in plan] == list(range(len(grid("float32", shape))))  # every block, in grid order, once
    loads = [0] * len(rows)
    for p in plan:
        lo, hi = p.box[0][0], p.box[0][0] + p.box[1][0]
        needers = {r for r, (a, b) in enumerate(rows) if b > a and a < hi and lo < b}
        assert {r for r, _, _ in p.pieces} == needers and p.reader in needers
        assert p.reader == min(needers, key=lambda r: (loads[r], r))  # the fewest bytes so far, then the lowest rank
        loads[p.reader] += p.n
        for r, region, common in p.pieces:  # each piece: the block's rows that rank holds
            a, b = rows[r]
            assert region == ((a, 0), (b - a, shape[1]))
            assert common == ((max(a, lo), p.box[0][1]), (min(b, hi) - max(a, lo), p.box[1][1]))
    assert all(load == 0 for load, (a, b) in zip(loads, rows) if a == b)
    if len(plan) > 4:  # every rank but 3 needs every block: balanced to within one block
        assert max(loads) - min(x for x in loads if x) <= max(p.n for p in plan)
    assert plan_group_read(peers) == plan  # deterministic
    for r in range(len(rows)):  # a rank's own plan: the same readers; all pieces of its blocks, its own of others'
        own = plan_group_read(peers, r)
        assert [(p.index, p.reader, p.n) for p in own] == [(p.index, p.reader, p.n) for p in plan]
        for mine, whole in zip(own, plan):
            assert mine.pieces == (whole.pieces if whole.reader == r else tuple(x for x in whole.pieces if x[0] == r))


def test_load_state_dict_into_and_dcp_load_by_exchange(runs):
    _, results = runs
    assert all(r["state_dict_equal"] for r in results)
    assert all(r["state_dict_read"] > 0 for r in results)
    assert all(r["dcp_equal"] for r in results)  # dcp.load through StoreReader(group=)
    store = ss.open_store(runs[0], create=False)
    stats = [r["dcp"] for r in results]
    blocks = _blocks(store, results[0]["dcp_commit"])  # each read once in the group, pieces sent to the others
    assert sum(s["bytes_read"] for s in stats) == sum(blocks.values())
    assert sum(s["blocks_read"] for s in stats) == len(blocks)
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats) > 0


def test_a_failure_on_any_rank_fails_every_rank_by_type_naming_it(runs):
    _, results = runs
    fails = [r["failures"] for r in results]
    plan = [f["plan"] for f in fails]
    assert all(t == "TensorMismatch" for t, _ in plan)
    assert all("tensor 'fc1.bias'" in m and "float32[12]" in m for _, m in plan), plan
    assert all("rank 3" in m for _, m in plan[:3])
    missing = [f["missing"] for f in fails]
    assert all(t == "ObjectNotFound" and oid in m for t, m, oid in missing), missing
    assert all(f["missing_untouched"] for f in fails)  # refused before any byte landed on any rank
    corrupt = [f["corrupt"] for f in fails]
    assert all(t == "CorruptObject" and oid in m for t, m, oid in corrupt), corrupt
