"""Faults around a slot tier's completion (SPEC.md §19.3), on real Gloo groups: none may leave
a rank raising between collectives while its peers wait in the next one.

1. A plain tensor several ranks hold whole, but not every rank (a group whose ranks hold
   different modules): a rank that does not hold it still saves through its memory tier
   (``dtensor._keep_dropped_plain`` looked it up in every rank's state).
2. A tier that cannot say whether it holds an object (a directory on the way is a symbolic link,
   or a file where a directory should be): ``replicate`` treats it as absent on that rank, as it
   already did for an object's size, instead of raising there while the other rank waits in
   the exchange. Each rank calls it as shardtrain's committer does (``SlotTiers.landed``: an
   error is recorded, the run goes on to its next collective).
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from gloo_group import run_group

import shardstore as ss
from shardstore.backends.memory_tier import MemoryTier
from shardstore.errors import ShardstoreError
from shardstore.format.tensors import hash_bytes

C1, C2 = "d1" * 32, "d2" * 32


def _subset_body(rank: int, world: int, root: str, tiers: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardstore.backends.tiers import TieredStorage
    from shardstore.format.closure import commit_closure

    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, torch.Tensor] = {"w": distribute_tensor(torch.arange(48.0).reshape(12, 4), mesh, [Shard(0)])}
    if rank < 2:  # ranks 0 and 1 hold it whole, rank 2 not at all
        state["buf"] = torch.arange(4.0)
    own = MemoryTier(os.path.join(tiers, f"host{rank}"), rank)
    store = ss.Store(TieredStorage(ss.open_store(root).storage, [own], fill=own), create=False)
    try:
        cid = ss.save_distributed(store, state, info=ss.CommitInfo(step=1), rng=False)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}"}
    closure = commit_closure(ss.load_commit(store, cid), slot=rank)
    return {"error": None, "buf": sorted(v for o, v in closure.labels.items() if "'buf'" in v and own.has(o))}


def test_a_rank_not_holding_a_plain_tensor_other_ranks_hold_whole_saves_through_its_tier(tmp_path) -> None:
    """``buf`` is held whole by ranks 0 and 1 of 3: the one not recording it keeps it in its tier,
    and rank 2, which never held it, saves too (it raised KeyError in ``_keep_dropped_plain``
    while ranks 0 and 1 went on to the block exchange)."""
    root = str(tmp_path / "store")
    ss.open_store(root)
    got = run_group(_subset_body, 3, tmp_path, root, str(tmp_path / "tiers"), timeout_s=30)
    assert all(g["error"] is None for g in got), got
    assert got[0]["buf"] == got[1]["buf"] == ["tensor 'buf', parameter"] and got[2]["buf"] == [], got


def _objs(rank: int, commit: int) -> dict[str, bytes]:
    """Slot ``rank``'s two objects at ``commit``: ``a`` is in the other slot's closure too."""
    return {k: f"{k}{commit}".encode() + bytes([rank]) * (2000 + len(k)) for k in ("a", "b")}


def _block(tier: MemoryTier, oid: str, how: str) -> None:
    """Make the tier's directory for ``oid`` unusable: a symbolic link or a plain file."""
    path = os.path.join(tier.dir, "objects", oid[:2])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if how == "link":
        os.makedirs(os.path.join(tier.dir, "elsewhere"), exist_ok=True)
        os.symlink(os.path.join(tier.dir, "elsewhere"), path)
    else:
        with open(path, "wb") as f:
            f.write(b"not a directory")


def _holds(tier: MemoryTier, cid: str) -> bool:
    """Whether ``tier`` holds ``cid`` (False when it cannot say: ``MemoryTier.holds`` raises then)."""
    try:
        return tier.holds(cid) is not None
    except ShardstoreError:
        return False


def _faulty_tier_body(rank: int, world: int, home: str) -> dict:
    from shardstore.checkpoint.replicas import fetch_replicas, replicate

    out: dict = {}
    for commit, cid, how in ((1, C1, "link"), (2, C2, "file")):
        host = os.path.join(home, f"c{commit}host{rank}")
        tier_for = lambda slot, _host=host: MemoryTier(_host, slot)  # noqa: E731 - this host's tier of a slot
        own = tier_for(rank)
        mine, other = _objs(rank, commit), _objs(1 - rank, commit)
        for data in mine.values():
            own.put(hash_bytes(data), data)
        closure = [hash_bytes(d) for d in mine.values()] + [hash_bytes(other["a"])]
        if commit == 1 and rank == 1:  # rank 1's tier cannot say whether it holds slot 0's ``a``
            _block(own, hash_bytes(other["a"]), how)
        if commit == 2 and rank == 0:  # nor rank 0's the size of slot 1's ``b`` (only in slot 1's closure)
            _block(own, hash_bytes(other["b"]), how)
        own.hold(cid, closure)
        try:
            report = replicate(dist.group.WORLD, slot=rank, commit=cid, objects=closure, own=own, tier_for=tier_for)
            out[how] = {"error": None, "holds": _holds(own, cid), "buddy": report.held}
        except Exception as e:  # noqa: BLE001 - as SlotTiers.landed: recorded, and the run goes on
            out[how] = {"error": f"{type(e).__name__}: {e}"}
        dist.barrier()  # the next collective of the run
        if commit == 1:  # a restart on the same hosts: rank 1's tier cannot say whether it holds commit 1
            try:
                copies, report = fetch_replicas(dist.group.WORLD, slot=rank, commit=cid, own=own, tier_for=tier_for)
                out["restart"] = {"error": None, "copies": len(copies), "rejected": report.rejected}
            except Exception as e:  # noqa: BLE001 - a failed fetch: the restore reads the store
                out["restart"] = {"error": f"{type(e).__name__}: {e}"}
            dist.barrier()
        if commit == 2:  # a restart: rank 1's directory of its ``b`` is now a link out of its tier
            outside = os.path.join(home, "outside")
            if rank == 1:
                os.makedirs(outside)
                where = os.path.join(own.dir, "objects", hash_bytes(mine["b"])[:2])
                shutil.rmtree(where)
                os.symlink(outside, where)
            copies, report = fetch_replicas(dist.group.WORLD, slot=rank, commit=cid, own=own, tier_for=tier_for)
            out["relink"] = {"copies": len(copies), "rejected": report.rejected}
            if rank == 1:
                out["relink"]["outside"] = os.listdir(outside)
            dist.barrier()
    return out


def test_a_tier_that_cannot_say_what_it_holds_fails_no_rank_and_leaves_none_waiting(tmp_path) -> None:
    """Commit 1: rank 1's tier has a symbolic link where slot 0's ``a`` would lie: it cannot keep
    it (its tier does not hold the commit, so rank 0 keeps no replica of it), but ``replicate``
    returns on both ranks, and rank 1 keeps slot 0's replica in its host's tier of slot 0.
    Commit 2: rank 0's tier has a file where slot 1's ``b`` would lie: rank 0 cannot copy it
    from there as a buddy, so slot 1 sends it. Before, ``has`` and ``size`` raised on that rank
    alone, and the other rank waited in the exchange (the group timed out). At a restart after
    commit 1, rank 1's tier cannot say whether it holds it: it asks its buddy (which has nothing
    to send) instead of raising before the exchange's first collective. At a restart after commit
    2, rank 1's directory of an object is a symbolic link out of its tier: the copy its buddy
    sends is kept in memory, not written through the link."""
    got = run_group(_faulty_tier_body, 2, tmp_path, str(tmp_path), timeout_s=30)
    assert all(g[how]["error"] is None for g in got for how in ("link", "file")), got
    assert got[0]["link"] == {"error": None, "holds": True, "buddy": False}, got
    assert got[1]["link"] == {"error": None, "holds": False, "buddy": True}, got
    assert all(g["file"] == {"error": None, "holds": True, "buddy": True} for g in got), got
    # the restart: rank 1 fetches what its tier may lack; rank 0's host holds no replica of slot 1
    assert all(g["restart"] == {"error": None, "copies": 0, "rejected": []} for g in got), got
    # the second restart: rank 1 gets its ``b`` from rank 0's replica, kept in memory, never
    # written through the link out of its tier
    assert got[1]["relink"] == {"copies": 1, "rejected": [], "outside": []}, got
    assert got[0]["relink"] == {"copies": 0, "rejected": []}, got
