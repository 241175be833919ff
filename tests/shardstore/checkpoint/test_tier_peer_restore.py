"""A restore from peers keeps nothing in the replacement's tier, and its next commit fills it
(SPEC.md §19.3), over a real 2-process Gloo group.

Each rank's slot is a few trained parameters and a few frozen ones (never stepped: unchanged
from commit to commit, so the save deduplicates them against the store). The group commits
through write-through tiers, holds and replicates the commit as shardtrain's committer does;
rank 1's host is lost; it restores from rank 0's replica while the copies arrive
(``start_fetch``), as shardtrain's start does. Then both ranks step and commit again, and the
group restarts on the same hosts.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import shardstore as ss

MIB = 1 << 20


def _slot(rank: int) -> tuple[torch.nn.ParameterDict, torch.optim.AdamW, list[str]]:
    """Slot ``rank``'s parameters: three trained (one AdamW step taken) and two frozen ones
    (``requires_grad`` off: no optimizer state, never changed), 256 KiB each."""
    g = torch.Generator().manual_seed(100 + rank)
    n = MIB // 16
    names = [f"s{rank}_w{i}" for i in range(3)] + [f"s{rank}_frozen{i}" for i in range(2)]
    model = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.randn(n, generator=g)) for k in names})
    frozen = [k for k in names if "frozen" in k]
    for k in frozen:
        model[k].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _step(model, seed=rank)
    opt.step()
    return model, opt, frozen


def _step(model: torch.nn.ParameterDict, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)


def _state(model: torch.nn.ParameterDict, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    out = {k: p.detach().numpy().tobytes() for k, p in model.items()}
    for k, p in model.items():
        for name, t in opt.state.get(p, {}).items():
            if torch.is_tensor(t) and t.dim():
                out[f"{k}.{name}"] = t.numpy().tobytes()
    return out


def _body(rank: int, world: int, root: str, home: str) -> dict:
    from shardstore.backends.local import LocalStorage
    from shardstore.backends.memory_tier import MemoryTier
    from shardstore.backends.tiers import TieredStorage
    from shardstore.checkpoint.replicas import replicate, start_fetch
    from shardstore.format.closure import commit_closure

    # every object read from the durable store, by id (the tiers are LocalStorages too: not counted)
    store_reads: list[str] = []
    for name in ("read", "read_hashed", "read_into"):
        real = getattr(LocalStorage, name)

        def counted(self: LocalStorage, key: str, *a: object, _real: object = real, **k: object) -> object:
            if os.path.realpath(self.root) == os.path.realpath(root) and key.startswith("objects/"):
                store_reads.append(key.rsplit("/", 1)[-1])
            return _real(self, key, *a, **k)  # type: ignore[operator]

        setattr(LocalStorage, name, counted)  # this spawned process only

    host = os.path.join(home, f"host{rank}")
    tier_for = lambda slot: MemoryTier(host, slot)  # noqa: E731 - this host's tier of a slot
    durable = ss.open_store(root)
    out: dict = {}

    def commit(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> tuple[str, object, set[str]]:
        """A commit as shardtrain's committer makes it: saved through the tier (write-through),
        its closure read through it, held, and replicated."""
        own = tier_for(rank)
        writer = ss.Store(TieredStorage(durable.storage, [own], fill=own), create=False)
        cid = ss.save_distributed(writer, model, opt, info=ss.CommitInfo(step=step), rng=False)
        ids = set(commit_closure(ss.load_commit(writer, cid), slot=rank).ids())
        own.hold(cid, ids)
        report = replicate(dist.group.WORLD, slot=rank, commit=cid, objects=ids, own=own, tier_for=tier_for)
        return cid, report, ids

    model, opt, frozen = _slot(rank)
    c1, _, ids1 = commit(model, opt, 1)
    saved = _state(model, opt)
    labels = commit_closure(ss.load_commit(durable, c1), slot=rank).labels
    frozen_ids = {o for o, v in labels.items() if any(f"'{k}'" in v for k in frozen)}
    out["frozen_in_c1"] = len(frozen_ids) == len(frozen) and frozen_ids <= ids1

    # rank 1's host is lost, with its tier (and its replica of slot 0)
    if rank == 1:
        shutil.rmtree(host)
    dist.barrier()

    def restore(cid: str) -> tuple[torch.nn.ParameterDict, torch.optim.AdamW, dict, int, bool]:
        own = tier_for(rank)
        fresh, fresh_opt, _ = _slot(rank)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        fetching = start_fetch(dist.group.WORLD, slot=rank, commit=cid, own=own, tier_for=tier_for)
        reader = TieredStorage(durable.storage, [own, fetching.copies], fill=own)
        ss.restore(ss.Store(reader, create=False), cid, fresh, fresh_opt, slot=rank, rng=False)
        copies, _ = fetching.wait()
        return fresh, fresh_opt, reader.counts(), copies.held_peak, fetching.needed

    del store_reads[:]
    model, opt, counts, held_peak, needed = restore(c1)
    out["peer_restore"] = {
        "counts": counts,
        "needed": needed,
        "equal": _state(model, opt) == saved,
        "tier_objects": sorted(tier_for(rank).objects()),
        "held_peak": held_peak,
        "slot_bytes": sum(durable.object_size(o) or 0 for o in ids1),
        "store_reads": list(store_reads),
    }

    # the next commit: the trained parameters change, the frozen ones do not
    _step(model, seed=10 + rank)
    opt.step()
    del store_reads[:]
    c2, report, ids2 = commit(model, opt, 2)
    own = tier_for(rank)
    labels = commit_closure(ss.load_commit(durable, c2), slot=rank).labels
    tensor_ids = {o for o, v in labels.items() if v.startswith("tensor ")}
    out["next_commit"] = {
        "holds": own.holds(c2) is not None,
        "frozen_kept": frozen_ids <= set(own.objects()) and frozen_ids <= ids2,
        "filled": report.filled,  # its own closure's objects from other ranks' tiers: none
        "sent": report.sent,
        "received": report.received,
        "local": report.local,
        "buddy_holds": report.held,
        "new_bytes": sum(durable.object_size(o) or 0 for o in ids2 - ids1),
        "slot_bytes": sum(durable.object_size(o) or 0 for o in ids2),
        "replica_bytes": sum(
            durable.object_size(o) or 0
            for o in commit_closure(ss.load_commit(durable, c2), slot=(rank - 1) % world).ids()
        ),
        "tensors_from_store": sorted(set(store_reads) & tensor_ids),
        "tensors": len(tensor_ids),
        "tier_bytes": own.nbytes(),
    }
    saved = _state(model, opt)

    # the group restarts on the same hosts: every tier holds its commit
    del store_reads[:]
    model, opt, counts, held_peak, needed = restore(c2)
    out["same_host"] = {"counts": counts, "needed": needed, "equal": _state(model, opt) == saved}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from gloo_group import run_group

    home = tmp_path_factory.mktemp("tier_peer_restore")
    root = str(home / "store")
    ss.open_store(root)
    return run_group(_body, 2, home, root, str(home / "tiers"))


def test_a_restore_from_peers_keeps_nothing_in_the_replacements_tier(ranks) -> None:
    """Rank 1 restores its slot from rank 0's replica with no byte from the store, every tensor
    bitwise the saved one, and its tier holds none of the copies (SPEC.md §19.3: its buddy's tier
    holds them); the copies that landed before a read asked were held in memory, at most the slot."""
    r = ranks[1]["peer_restore"]
    assert r["needed"] and r["equal"], r
    assert r["counts"]["store"] == 0 and r["counts"]["memory"] == 0 and r["counts"]["peers"] > 0, r["counts"]
    assert r["tier_objects"] == [] and r["store_reads"] == [], r
    assert 0 <= r["held_peak"] <= r["slot_bytes"], r
    s = ranks[0]["peer_restore"]  # the survivor restores from its own tier while it sends
    assert not s["needed"] and s["equal"] and s["counts"]["store"] == s["counts"]["peers"] == 0, s
    assert all(r["frozen_in_c1"] for r in ranks)


def test_the_next_commit_fills_the_replacements_tier_from_its_own_bytes(ranks) -> None:
    """At its first commit after the restore the replacement's tier gets its whole closure, the
    frozen tensors (deduplicated against the store: not written there) included, from the save's
    own bytes: nothing completed from another rank's tier, no tensor read from the store. It then
    holds the commit, K = 1 bounds it, and only new objects go to its buddy."""
    for rank, r in enumerate(ranks):
        c = r["next_commit"]
        assert c["holds"] and c["frozen_kept"] and c["buddy_holds"], (rank, c)
        assert c["filled"] == 0 and c["tensors_from_store"] == [], (rank, c)
        assert c["tier_bytes"] == c["slot_bytes"], (rank, c)  # the closure of one commit, no more
    # rank 1 sends slot 1's new objects only (rank 0's host holds the frozen ones since commit 1);
    # it receives all of slot 0 but what its own tier holds (its host's replica went with the host)
    c = ranks[1]["next_commit"]
    assert 0 < c["sent"] <= c["new_bytes"], c
    assert c["received"] + c["local"] == c["replica_bytes"] and c["received"] > 0, c
    assert all(r["next_commit"]["tensors"] == 3 * 3 + 2 for r in ranks)  # 3 trained (and moments), 2 frozen


def test_a_restart_on_the_same_hosts_after_that_commit_reads_no_store_and_no_peer(ranks) -> None:
    for r in ranks:
        s = r["same_host"]
        assert not s["needed"] and s["equal"], s
        assert s["counts"]["store"] == s["counts"]["peers"] == 0 and s["counts"]["memory"] > 0, s
