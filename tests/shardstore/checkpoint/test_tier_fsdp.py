"""A memory tier under FSDP2 holds its slot's whole commit (SPEC.md §19.3), and a lost rank
recovers from its buddy with no byte from the store.

Two Gloo ranks train a ``fully_shard``-ed model (tiny parameters of one block, split in half
between the ranks, so each block straddles both ranks' slices; a larger weight whose two
column tiles each span both ranks' rows; BatchNorm's running statistics,
plain tensors both ranks hold whole and one records) and commit four times through
write-through memory tiers, holding and replicating each commit as shardtrain's committer does
(``SlotTiers.landed``). Then rank 1's host is lost (its tier directory, with its replica of slot
0, is gone): it restores from what rank 0's host sent back. One group does all the checks.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import shardstore as ss

COMMITS = 4


def _model(mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(4096, 300),  # 4.9 MB: two tiles of 300 x 2048; FSDP2 splits at row 150
        torch.nn.BatchNorm1d(300),  # running statistics: plain tensors both ranks hold whole
        torch.nn.ReLU(),
        torch.nn.Linear(300, 4),  # one block each, half on each rank
    )
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)  # the same batch on every rank: equal BatchNorm statistics
    x, y = torch.randn(8, 4096, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step()


def _local(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's local tensors: parameters, their moments, buffers."""
    out = {}
    for n, p in m.named_parameters():
        out[n] = p.to_local().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{n}.{k}"] = opt.state[p][k].to_local().clone()
    for n, b in m.named_buffers():
        out[n] = b.clone()
    return out


def _body(rank: int, world: int, root: str, home: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from shardstore.backends.memory_tier import MemoryTier
    from shardstore.backends.tiers import TieredStorage
    from shardstore.checkpoint.replicas import fetch_replicas, replicate
    from shardstore.format.closure import commit_closure

    mesh = init_device_mesh("cpu", (world,))
    host = os.path.join(home, f"host{rank}")
    tier_for = lambda slot: MemoryTier(host, slot)  # noqa: E731 - this host's tier of a slot
    own = tier_for(rank)
    durable = ss.open_store(root)
    store = ss.Store(TieredStorage(durable.storage, [own], fill=own), create=False)
    m = _model(mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    out: dict = {"commits": []}
    cid = None
    for step in range(1, COMMITS + 1):
        _step(m, opt, step)
        cid = ss.save_distributed(store, m, opt, info=ss.CommitInfo(step=step), rng=False, group=dist.group.WORLD)
        closure = commit_closure(ss.load_commit(store, cid), slot=rank)
        before = sorted(closure.labels.get(o, o) for o in closure.ids() if not own.has(o))
        stats = sorted(v for o, v in closure.labels.items() if v.startswith("tensor '1.") and own.has(o))
        own.hold(cid, closure.ids())
        report = replicate(dist.group.WORLD, slot=rank, commit=cid, objects=closure.ids(), own=own, tier_for=tier_for)
        buddy_of = (rank - 1) % world  # the slot whose replica this host keeps
        mine = closure.ids()
        theirs = commit_closure(ss.load_commit(durable, cid), slot=buddy_of).ids()
        size = lambda ids: sum(durable.object_size(o) or 0 for o in ids)  # noqa: E731
        out["commits"].append(
            {
                "lacked": before,
                "stats": stats,
                "filled": report.filled,
                "received": report.received,
                "local": report.local,
                "holds": own.holds(cid) is not None,
                "buddy_holds": report.held,
                "rejected": report.rejected,
                "own": [sorted(own.objects()) == sorted(mine), own.nbytes(), size(mine)],
                "replica": [sorted(tier_for(buddy_of).objects()) == sorted(theirs), tier_for(buddy_of).nbytes()],
                "replica_bytes": size(theirs),
            }
        )
    saved = _local(m, opt)
    # rank 1's host is lost with its tier (and its replica of slot 0): a replacement starts empty
    if rank == 1:
        shutil.rmtree(host)
        os.makedirs(host, mode=0o700)
        own = tier_for(rank)
    dist.barrier()
    copies, report = fetch_replicas(dist.group.WORLD, slot=rank, commit=cid, own=own, tier_for=tier_for)
    reader = TieredStorage(durable.storage, [own, copies], fill=own)
    m2 = _model(mesh)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    ss.restore(ss.Store(reader, create=False), cid, m2, opt2, rng=False)
    got = _local(m2, opt2)
    out["restore"] = reader.counts()
    out["restore_rejected"] = reader.rejected + report.rejected
    out["restored_equal"] = sorted(n for n in saved if not torch.equal(saved[n], got[n])) == []
    out["restored_holds"] = own.holds(cid) is not None  # the survivor's tier still holds it
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from gloo_group import run_group

    home = tmp_path_factory.mktemp("tier_fsdp")
    root = str(home / "store")
    ss.open_store(root)
    return run_group(_body, 2, home, root, str(home / "tiers"))


def test_each_slots_tier_gets_the_straddling_blocks_and_the_plain_tensors_another_slot_wrote(ranks) -> None:
    """After the save each rank's tier holds the BatchNorm statistics the other slot records (kept
    from its own bytes, hashed) but lacks the blocks (parameters and moments) that straddle both
    ranks' slices that the other owns. ``complete`` fills
    each from the other rank's tier (hashed to its id as it lands), so both tiers hold the commit
    and both buddies hold its replica, at every commit (SPEC.md §19.3; on the old code the rank
    lacking them never held its commit nor its buddy a replica)."""
    lacked = [r["commits"][0]["lacked"] for r in ranks]
    # case (b): each BatchNorm statistic is recorded by one slot, yet both tiers hold all of them
    # after the save (the other rank hashed its own equal copy), so neither lacked one
    for r in ranks:
        assert "tensor '1.running_mean', parameter" in r["commits"][0]["stats"], r["commits"][0]["stats"]
        assert "tensor '1.running_var', parameter" in r["commits"][0]["stats"], r["commits"][0]["stats"]
        assert not any(s.startswith("tensor '1.running") or "num_batches" in s for s in r["commits"][0]["lacked"])
    # case (a): a one-block tensor split in half, its block owned by one rank; the large weight's
    # column tiles each span both ranks' rows
    assert "tensor '3.bias', parameter" in lacked[0] and "tensor '3.bias', exp_avg" in lacked[1], lacked
    assert "tensor '0.weight', parameter block 0" in lacked[1] and "tensor '0.weight', exp_avg block 0" in lacked[0]
    for r in ranks:
        for c in r["commits"]:
            assert c["holds"] and c["buddy_holds"] and not c["rejected"], c
            assert c["lacked"] == [] or c["filled"] > 0, c
    assert all(ranks[1]["commits"][i]["lacked"] for i in range(COMMITS))  # every commit: new bytes each step


def test_a_buddy_keeps_from_its_own_hosts_tier_what_it_holds_there_and_only_the_rest_moves(ranks) -> None:
    """On 2 ranks every block of a slot's closure that the slot lacked was written by its buddy,
    whose host keeps it in its own slot's tier: ``replicate`` copies it from there (hashed) instead
    of having it sent back. Here every block overlaps both ranks' slices (the two slot closures are
    one), so the only bytes that cross the network are those ``complete`` fills."""
    for r in ranks:
        for c in r["commits"]:
            assert c["received"] == c["filled"] > 0 and c["local"] == c["replica_bytes"], c


def test_the_tiers_hold_the_last_commits_closure_and_no_more_over_four_commits(ranks) -> None:
    """K = 1: after each commit a slot's tier, and its buddy's replica of it, hold exactly the
    slot closure of that commit (its bytes), never the pieces of earlier ones."""
    for r in ranks:
        for c in r["commits"]:
            same, held, closure = c["own"]
            assert same and held == closure, c
            same_replica, replica_held = c["replica"]
            assert same_replica and replica_held == c["replica_bytes"], c


def test_a_lost_rank_recovers_from_its_buddy_with_no_byte_from_the_store(ranks) -> None:
    """Rank 1's host lost with its tier: the replacement restores its FSDP2 slices and moments,
    the straddling blocks and the statistics slot 0 records included, from rank 0's replica of
    slot 1 (peers), and rank 0 from its own tier (memory): no byte read from the store, every
    local tensor bitwise the saved one."""
    assert ranks[0]["restore"]["store"] == 0 and ranks[0]["restore"]["memory"] > 0, ranks[0]["restore"]
    assert ranks[1]["restore"]["store"] == 0 and ranks[1]["restore"]["peers"] > 0, ranks[1]["restore"]
    assert ranks[1]["restore"]["memory"] == 0, ranks[1]["restore"]
    for r in ranks:
        assert r["restored_equal"] and not r["restore_rejected"], r
    assert ranks[0]["restored_holds"], ranks[0]  # the survivor's tier was not evicted by the restore
