"""gc against saves in progress, and gc killed at every delete (issue 8, part 9).

- A save is paused at each of its durability barriers (after its objects, after its shard
  manifests, after its commit manifest, before the ref moves) while a whole gc runs with a
  grace period; the save then finishes and the store verifies clean.
- The same with deduplication: the save finds an *old, unreachable* object already present
  (content addressing skips the write) and is paused before any manifest names it. gc
  must not delete it (the local backend refreshes the object's mtime when a write finds it
  present, so it is young again).
- gc is killed (SIGKILL, in a forked child) before each of its deletes: afterwards every
  reachable object is present, the store verifies clean, and a second gc finishes the job.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

import shardstore as ss
from shardstore.gc import gc
from shardstore.local import LocalStorage
from shardstore.store import object_key
from faults import OpLog, kill_at

HOUR = 3600.0


def _age(store: ss.Store, seconds: float) -> None:
    past = time.time() - seconds
    for oid in store.objects():
        os.utime(os.path.join(store.url, object_key(oid)), (past, past), follow_symlinks=False)


def _state(seed: int, extra: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"a": torch.randn(8, generator=g), "b": torch.randn(3, 3, generator=g)}
    if extra is not None:
        out["frozen"] = extra
    return out


@pytest.mark.parametrize("pause_at", [0, 1, 2, 3])
@pytest.mark.parametrize("dedup", [False, True], ids=["fresh", "dedup"])
def test_gc_during_a_paused_save(tmp_path: Any, pause_at: int, dedup: bool) -> None:
    root = str(tmp_path / "s")
    store = ss.open_store(root)
    ss.save(store, _state(0), step=0, rng=False)
    frozen = torch.arange(16.0)
    if dedup:  # an old commit, since dropped, holds `frozen`: unreachable and old
        orphan = ss.save(store, _state(1, frozen), step=0, rng=False, ref="old")
        store.delete_ref("old", expected=orphan)
    _age(store, 2 * HOUR)
    syncs = [0]
    ran: list[ss.GcResult] = []

    def hook(n: int, op: str, key: str) -> None:
        if op == "sync" or op == "swap":
            if syncs[0] == pause_at:  # the save is paused here while a whole gc runs
                ran.append(gc(ss.open_store(root, create=False), grace_seconds=HOUR, dry_run=False))
            syncs[0] += 1

    saver = ss.Store(OpLog(LocalStorage(root), hook), create=False)
    cid = ss.save(saver, _state(2, frozen), step=1, rng=False, threads=1)
    assert ran, "the pause point was never reached"
    after = ss.open_store(root, create=False)
    assert after.ref("main") == cid
    report = ss.verify(after)
    assert report.ok, (pause_at, dedup, ran[0].deleted, [str(p) for p in report.problems])
    restored = {"a": torch.zeros(8), "b": torch.zeros(3, 3), "frozen": torch.zeros(16)}
    ss.restore(after, "main", restored)
    assert torch.equal(restored["frozen"], frozen)


def _fork_gc(root: str, k: int) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            store = ss.Store(OpLog(LocalStorage(root), kill_at(k, ops=("delete",))), create=False)
            gc(store, grace_seconds=HOUR, dry_run=False, threads=1)
            os._exit(0)
        except BaseException:
            os._exit(3)
    return os.waitpid(pid, 0)[1]


def test_gc_killed_before_every_delete(tmp_path: Any) -> None:
    base = str(tmp_path / "base")
    store = ss.open_store(base)
    kept = ss.save(store, _state(0), step=0, rng=False)
    for i in range(3):  # garbage: three dropped commits, old
        c = ss.save(store, _state(10 + i), step=0, rng=False, ref=f"drop{i}")
        store.delete_ref(f"drop{i}", expected=c)
    _age(store, 2 * HOUR)
    # a save in progress: its objects are young and named by no ref yet
    info = ss.CommitInfo(step=1)
    sid = ss.write_shard(store, ss.capture(_state(99), rng=False), info=info, parent=kept, slot=0, slots=1)
    pending = ss.write_commit(store, [sid], info=info, parent=kept)
    dry = gc(store, grace_seconds=HOUR, dry_run=True)
    n = len(dry.deleted)
    assert n >= 9
    import shutil

    for k in range(n + 1):
        root = str(tmp_path / f"k{k}")
        shutil.copytree(base, root, symlinks=True, copy_function=shutil.copy2)
        status = _fork_gc(root, k)
        assert (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL) if k < n else os.WEXITSTATUS(status) == 0
        s = ss.open_store(root, create=False)
        assert ss.verify(s).ok
        assert all(s.has(o) for o in ss.transfer.commit_closure(ss.load_commit(s, pending)).ids())
        again = gc(s, grace_seconds=HOUR, dry_run=False)
        assert len(again.deleted) == n - k if k < n else again.deleted == {}
        assert set(s.objects()) == set(store.objects()) - set(dry.deleted)
        s.set_ref("main", pending, expected=kept)
        assert ss.verify(s).ok
        shutil.rmtree(root)
