"""Faults around a slot tier's completion (SPEC.md §19.3), on real Gloo groups: none may leave
a rank raising between collectives while its peers wait in the next one.

1. A plain tensor several ranks hold whole, but not every rank (a group whose ranks hold
   different modules): a rank that does not hold it still saves through its memory tier
   (``dtensor._keep_dropped_plain`` looked it up in every rank's state).
"""

from __future__ import annotations

import os

import torch
from gloo_group import run_group

import shardstore as ss
from shardstore.backends.memory_tier import MemoryTier


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
