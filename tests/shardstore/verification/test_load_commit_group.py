"""A group's commit read: the manifests read once per group, not once per rank (SPEC.md §16.3).

One Gloo group of 4 processes does everything. Each rank saves a slot of its own tensors
(``save_distributed``: a commit of 4 shard manifests); then, reads counted at the storage layer
(every key: objects and refs):

- ``load_commit`` on its own on every rank, then with ``group=``: the same ``LoadedCommit``;
  in the group the ref is read by rank 0 alone and the commit manifest and each shard manifest
  once in the group (also by full id on a store answering sizes by listing, as on S3); a group
  of one reads as on its own;
- ``restore(..., group=)`` of every rank's tensors on every rank: bitwise the restore on its own
  and the saved values, each manifest read once in the group;
- a target that names nothing (rank 0 fails to resolve it): TargetNotFound on every rank;
- rank 3 naming the commit by its id, the others by the ref: CommitProtocolError on every rank;
- rank 1 sends one shard manifest's bytes with a byte flipped: CorruptObject naming that
  manifest and rank 1 on every rank;
- a shard manifest removed from the store: ObjectNotFound naming it on every rank, through
  ``restore(..., group=)``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_group import run_group_on_store
from read_counter import ReadCounter

import shardstore as ss
import shardstore.verification.commits as commits
from shardstore.store.keys import object_key


class _CountAll(ReadCounter):
    """Counts every key read (objects, refs), not only objects."""

    def _count(self, key: str, n: int) -> None:
        with self._lock:
            self.bytes += n
            self.keys[key] += 1


class _Listed(_CountAll):
    """Answers many sizes at once, as S3Storage does (``ListedSizes``): the store then takes the
    paths where reads are round trips (a full id read as a commit at once, shares read in threads)."""

    def sizes(self, keys: list[str]) -> dict[str, int]:
        return {k: n for k in keys if (n := self.inner.size(k)) is not None}

    def refresh(self, key: str, size: int) -> bool:
        return self.inner.size(key) == size


def _tensors(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {f"w{rank}": torch.randn(48, 32, generator=g), f"b{rank}": torch.randn(32, generator=g)}


def _manifest_keys(lc: ss.LoadedCommit) -> list[str]:
    return [object_key(lc.id), *(object_key(s) for s in sorted(lc.shard_ids.values()))]


def _same(a: ss.LoadedCommit, b: ss.LoadedCommit) -> bool:
    return (a.id, a.commit, a.shards, a.shard_ids) == (b.id, b.commit, b.shards, b.shard_ids)


def _error(fn) -> list[str]:
    try:
        fn()
    except ss.ShardstoreError as e:
        return [type(e).__name__, str(e)]
    return ["none", ""]


def _body(rank: int, world: int, root: str) -> dict:
    store = ss.open_store(root)
    info = ss.CommitInfo(step=3, job="group-load")
    cid = ss.save_distributed(store, _tensors(rank), info=info, rng=False, ref="main", parent=None)
    out: dict = {"cid": cid}
    alone, grouped = _CountAll(store.storage), _CountAll(store.storage)
    la = ss.load_commit(ss.Store(alone, create=False), "main")
    lg = ss.load_commit(ss.Store(grouped, create=False), "main", group=dist.group.WORLD)
    out["same"] = _same(la, lg) and la.id == cid and len(la.shards) == world
    keys = _manifest_keys(la)
    out["alone"] = {k: alone.keys[k] for k in keys} | {"ref": alone.keys["refs/main"]}
    out["grouped"] = {k: grouped.keys[k] for k in keys} | {"ref": grouped.keys["refs/main"]}
    out["grouped_other"] = sorted(set(grouped.keys) - set(keys) - {"refs/main", "config"})  # ("config": opening)
    listed = _Listed(store.storage)
    on_s3 = ss.Store(listed, create=False)
    out["listed_same"] = on_s3.lists_sizes() and _same(la, ss.load_commit(on_s3, cid, group=dist.group.WORLD))
    out["listed"] = {k: listed.keys[k] for k in keys}
    solos = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    solo = _CountAll(store.storage)
    out["solo_same"] = _same(la, ss.load_commit(ss.Store(solo, create=False), "main", group=solos[rank]))
    out["solo_reads_as_alone"] = dict(solo.keys) == dict(alone.keys)
    # restore every rank's tensors on every rank: on its own, then in the group
    names = {n: t for r in range(world) for n, t in _tensors(r).items()}
    back: dict = {}
    for how in ("alone", "grouped"):
        counter = _CountAll(store.storage)
        dest = {n: torch.zeros_like(t) for n, t in names.items()}
        ss.restore(ss.Store(counter, create=False), "main", dest, group=dist.group.WORLD if how == "grouped" else None)
        back[how] = dest
        out[f"restore_{how}"] = {k: counter.keys[k] for k in keys}
    out["restore_equal"] = all(
        torch.equal(back["alone"][n], t) and torch.equal(back["grouped"][n], t) for n, t in names.items()
    )
    # rank 0 cannot resolve the target: every rank raises its error
    out["absent"] = _error(lambda: ss.load_commit(store, "absent", group=dist.group.WORLD))
    # rank 3 names the commit by its id, the others by the ref: refused on every rank
    out["other_target"] = _error(lambda: ss.load_commit(store, cid if rank == 3 else "main", group=dist.group.WORLD))
    # rank 1 sends one shard manifest's bytes with a byte flipped
    ids = sorted({lay.shard for lay in la.commit.layout})
    out["tampered"] = ids[1]  # rank 1's share: ids[1::4]
    real = commits._read_share
    if rank == 1:

        def tamper(store_, oids):
            reads = real(store_, oids)
            data = bytearray(reads[0].data)
            data[len(data) // 2] ^= 0x01
            reads[0] = commits._Read(reads[0].oid, bytes(data))
            return reads

        commits._read_share = tamper
    try:
        out["wrong_bytes"] = _error(lambda: ss.load_commit(store, cid, group=dist.group.WORLD))
    finally:
        commits._read_share = real
    # a shard manifest missing from the store
    gone = la.shard_ids[2]
    out["gone"] = gone
    path = Path(root) / object_key(gone)
    dist.barrier()
    if rank == 0:
        path.rename(path.with_name("moved"))
    dist.barrier()
    dest = {n: torch.zeros_like(t) for n, t in names.items()}
    out["missing"] = _error(lambda: ss.restore(store, cid, dest, group=dist.group.WORLD))
    out["missing_untouched"] = all(bool((t == 0).all()) for t in dest.values())
    dist.barrier()
    if rank == 0:
        path.with_name("moved").rename(path)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_group_on_store(_body, 4, tmp_path_factory.mktemp("group_load"), timeout_s=60)[1]


def test_a_group_reads_each_manifest_once_and_loads_the_same_commit(runs):
    assert all(r["same"] and r["solo_same"] and r["solo_reads_as_alone"] for r in runs)
    assert len({r["cid"] for r in runs}) == 1
    for r in runs:  # on its own, every rank reads the ref, the commit and all 4 shard manifests
        assert set(r["alone"].values()) == {1} and len(r["alone"]) == 6
        assert r["grouped_other"] == []
    total = {k: sum(r["grouped"][k] for r in runs) for k in runs[0]["grouped"]}
    assert total == dict.fromkeys(runs[0]["grouped"], 1)  # once in the group: ref, commit, each shard manifest
    assert runs[0]["grouped"]["ref"] == 1  # rank 0 resolves the target
    assert [sum(r["grouped"].values()) for r in runs] == [3, 1, 1, 1]  # rank 0: ref, commit and its share
    # the commit named by its full id on a store answering sizes by listing (S3's path): the same
    assert all(r["listed_same"] for r in runs)
    assert {k: sum(r["listed"][k] for r in runs) for k in runs[0]["listed"]} == dict.fromkeys(runs[0]["listed"], 1)


def test_a_group_restore_reads_each_manifest_once_and_restores_the_same(runs):
    assert all(r["restore_equal"] for r in runs)
    keys = list(runs[0]["restore_alone"])
    assert all(r["restore_alone"] == dict.fromkeys(keys, 1) for r in runs)
    assert {k: sum(r["restore_grouped"][k] for r in runs) for k in keys} == dict.fromkeys(keys, 1)


def test_a_failure_on_any_rank_fails_every_rank_naming_it(runs):
    for r in runs:
        kind, msg = r["absent"]
        assert kind == "TargetNotFound" and "absent" in msg
        kind, msg = r["wrong_bytes"]
        assert kind == "CorruptObject" and r["tampered"] in msg and "rank 1 of the group" in msg, msg
        kind, msg = r["missing"]
        assert kind == "ObjectNotFound" and r["gone"] in msg, msg
        assert r["missing_untouched"]
    assert all("rank 0" in r["absent"][1] for r in runs[1:])  # the others name the rank that failed
    for r in runs:  # one rank naming another target than rank 0's
        kind, msg = r["other_target"]
        assert kind == "CommitProtocolError" and r["cid"] in msg and "'main'" in msg, msg
    assert all("rank 3 of the group" in r["other_target"][1] for r in runs[:3])
