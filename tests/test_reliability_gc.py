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

import json
import os
import signal
import time
from typing import Any

import pytest
import torch
from faults import OpLog, kill_at

import shardstore as ss
from shardstore.backends.local import LocalStorage
from shardstore.ops.gc import gc
from shardstore.store import object_key

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
        assert (
            (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL) if k < n else os.WEXITSTATUS(status) == 0
        )
        s = ss.open_store(root, create=False)
        assert ss.verify(s).ok
        assert all(s.has(o) for o in ss.ops.transfer.commit_closure(ss.load_commit(s, pending)).ids())
        again = gc(s, grace_seconds=HOUR, dry_run=False)
        assert len(again.deleted) == n - k if k < n else again.deleted == {}
        assert set(s.objects()) == set(store.objects()) - set(dry.deleted)
        s.set_ref("main", pending, expected=kept)
        assert ss.verify(s).ok
        shutil.rmtree(root)


# -- issue 12, item 1: a copy relying on objects already at the destination -----------------


def _copy_fixture(tmp_path: Any, junk: int = 0) -> tuple[ss.Store, ss.Store, str, str]:
    """A source commit, and a destination that already holds its whole closure, unreachable
    and two hours old (an earlier copy whose ref was dropped), plus ``junk`` old garbage objects."""
    src = ss.open_store(str(tmp_path / "src"))
    cid = ss.save(src, _state(5), step=0, rng=False)
    root = str(tmp_path / "dst")
    dst = ss.open_store(root)
    ss.copy_commit(src, dst, cid, ref="old")
    dst.delete_ref("old", expected=cid)
    _junk(root, junk)
    _age(dst, 2 * HOUR)
    return src, dst, root, cid


def _junk(root: str, n: int) -> None:
    """``n`` small garbage objects, written straight into the layout (no fsync: only their count matters)."""
    from shardstore.format.tensors import hash_bytes

    for i in range(n):
        data = b"junk %d" % i
        path = os.path.join(root, object_key(hash_bytes(data)))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def test_copy_refreshes_objects_it_finds_present(tmp_path: Any) -> None:
    """gc plans its deletes, then a copy finds the whole closure present and moves a ref,
    then gc deletes: the copy's refresh must make gc's last look see young objects. (The
    copy's ref move waits behind the gc fence until this gc is done, so it runs beside it.)"""
    import threading

    src, dst, root, cid = _copy_fixture(tmp_path)
    garbage = len(list(dst.objects()))
    mtimes, copies = [0], []

    def copy() -> None:
        copies.append(ss.copy_commit(src, ss.open_store(root, create=False), cid, ref="main", threads=1))

    def hook(n: int, op: str, key: str) -> None:
        if op == "mtime" and key.startswith("objects/"):
            if mtimes[0] == garbage:  # the first look of the delete phase: the plan is made
                copies.append(threading.Thread(target=copy))
                copies[0].start()
                intents = os.path.join(root, "intents")
                while not (os.path.isdir(intents) and os.listdir(intents)):
                    time.sleep(0.01)  # the copy has refreshed its objects and announced its ref move
            mtimes[0] += 1

    gc(ss.Store(OpLog(LocalStorage(root), hook), create=False), grace_seconds=HOUR, dry_run=False, threads=1)
    assert mtimes[0] > garbage, "the delete phase was never reached"
    copies[0].join(timeout=60)
    assert copies[1].objects_copied == 0  # everything was found present, and kept
    after = ss.open_store(root, create=False)
    assert after.ref("main") == cid
    report = ss.verify(after)
    assert report.ok, [str(p) for p in report.problems]


def test_copy_and_gc_in_two_processes(tmp_path: Any) -> None:
    """The same race without hooks: a forked gc and a forked copy start together, round after
    round, each round at a different offset; whenever the copy moved the ref, the
    destination must hold the commit's whole closure."""
    import random

    src, dst, root, cid = _copy_fixture(tmp_path, junk=200)
    closure = ss.ops.transfer.commit_closure(ss.load_commit(src, cid)).ids()
    rng = random.Random(12)
    for rnd in range(6):
        delay = rng.uniform(0.0, 0.03)
        pids = []
        for who in ("gc", "copy"):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the children
                try:
                    if who == "gc":
                        gc(ss.open_store(root, create=False), grace_seconds=HOUR, dry_run=False, threads=1)
                    else:
                        time.sleep(delay)
                        ss.copy_commit(src, ss.open_store(root, create=False), cid, ref="main", threads=1)
                    os._exit(0)
                except BaseException:
                    os._exit(3)
            pids.append(pid)
        assert [os.WEXITSTATUS(os.waitpid(p, 0)[1]) for p in pids] == [0, 0]
        if dst.ref("main") == cid:
            missing = sorted(o for o in closure if not dst.has(o))
            assert not missing, (rnd, delay, missing)
            dst.delete_ref("main", expected=cid)
        ss.copy_commit(src, dst, cid)  # restore the closure for the next round (unreachable again)
        _junk(root, 200)
        _age(dst, 2 * HOUR)


def test_local_delete_stale_keeps_an_object_refreshed_before_it_is_taken(tmp_path: Any) -> None:
    """gc's local delete renames the object away before it looks at its time, so a refresh
    can never fall between the look and the delete (the window the two-process race hit)."""
    store = ss.open_store(str(tmp_path / "s"))
    old, young = store.put(b"old garbage"), store.put(b"refreshed by a writer")
    _age(store, 2 * HOUR)
    store.ensure(young)
    storage = store.storage
    assert isinstance(storage, LocalStorage)
    cutoff = time.time() - HOUR
    assert storage.delete_stale(object_key(old), cutoff) is True and not store.has(old)
    assert storage.delete_stale(object_key(young), cutoff) is False and store.get(young) == b"refreshed by a writer"
    assert storage.delete_stale(object_key(old), cutoff) is False  # already gone
    assert list(storage.list("tmp")) == []


def test_gc_grace_zero_in_a_loop_against_background_commits(tmp_path: Any) -> None:
    """Issue 24: ``gc --grace 0`` over and over while another thread commits and moves
    ``main`` every few milliseconds. Whatever interleaving the two hit, the commit ``main``
    names must always verify clean (a save whose objects gc took first may fail, GcRace or
    ObjectNotFound or TargetNotFound, with the ref left where it was; it must never move the ref onto a commit
    gc emptied). Before the gc fence this failed within a second or two."""
    root = str(tmp_path / "s")
    store = ss.open_store(root)
    ss.save(store, _state(0), step=0, rng=False)
    stop, saved, refused, failures = [False], [0], [0], []

    def commits() -> None:
        writer = ss.open_store(root, create=False)
        i = 1
        while not stop[0]:
            try:
                ss.save(writer, _state(i % 7), step=i, rng=False)  # old states come back: deduplication
                saved[0] += 1
            except (
                ss.GcRace,
                ss.ObjectNotFound,
                ss.TargetNotFound,
            ):  # grace 0: gc took objects of this save in progress
                refused[0] += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(repr(e))
                return
            i += 1

    import random
    import threading

    t = threading.Thread(target=commits)
    t.start()
    try:
        deadline, rounds, pause = time.monotonic() + 3.0, 0, random.Random(24)
        while time.monotonic() < deadline and not failures:
            time.sleep(pause.uniform(0.0, 0.03))  # some saves finish between rounds, some straddle one
            gc(ss.open_store(root, create=False), grace_seconds=0.0, dry_run=False, threads=2)
            rounds += 1
            cid = store.ref("main")
            assert cid is not None
            report = ss.verify(store, [cid], deep=False)
            assert report.ok, (rounds, saved[0], [str(p) for p in report.problems])
    finally:
        stop[0] = True
        t.join()
    assert not failures, failures
    assert saved[0] > 0 and rounds > 1, (saved[0], refused[0], rounds)
    print("ROUNDS", saved[0], refused[0], rounds)
    report = ss.verify(store, [store.ref("main")])
    assert report.ok, [str(p) for p in report.problems]


def test_the_gc_fence_each_side(tmp_path: Any) -> None:
    """The two halves of the fence, deterministically (SPEC.md §19.1's table): gc at grace 0
    keeps the closure of a commit an intent names though no ref does yet; a writer that
    finds a gc marker waits for it, then refuses (GcRace, ref unmoved) if that gc took part
    of its closure, and a dry run writes no marker."""
    import threading

    from shardstore.ops.transfer import commit_closure
    from shardstore.store import gc_fence

    store = ss.open_store(str(tmp_path / "s"))
    base = ss.save(store, _state(0), step=0, rng=False)
    pending = ss.save(store, _state(1), step=1, rng=False, ref=None)
    closure = commit_closure(ss.load_commit(store, pending)).ids()
    # (1) an intent keeps its commit: the move it announces happens after gc's ref read
    store.storage.write_once("intents/c-test", gc_fence._encode_ids([pending]))
    gc(store, grace_seconds=0.0, dry_run=False)
    assert all(store.has(o) for o in closure)
    store.storage.delete("intents/c-test")
    # (2) a writer waits while a gc marker is live; that gc deletes; the writer refuses
    marker = gc_fence.GcMarker(store)
    outcome: list[BaseException | None] = []

    def move() -> None:
        try:
            store.set_ref("main", pending, expected=base)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - asserted below
            outcome.append(e)

    t = threading.Thread(target=move)
    t.start()
    time.sleep(0.2)
    assert outcome == [] and store.ref("main") == base  # still waiting for the marker
    assert len(list(store.storage.list("intents"))) == 1  # its intent is written first
    victim = sorted(closure - {pending})[0]
    store.storage.delete(object_key(victim))  # what that gc deletes
    marker.close()
    t.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], ss.GcRace), outcome
    assert store.ref("main") == base and list(store.storage.list("intents")) == []
    # (3) a dry run deletes nothing and writes nothing
    gc(store, grace_seconds=0.0, dry_run=True)
    assert list(store.storage.list("gc")) == []


def test_gc_drops_the_intents_of_dead_writers_only(tmp_path) -> None:
    """An intent left by a writer that died (killed between its intent and its ref move)
    kept its commit forever. Its key names its writer (pid, start time, boot id, pid
    namespace, a tag of the host name, SPEC.md §19.2): gc drops the intents of dead writers
    and collects what only they kept; a running writer's intent, one naming another boot
    (another machine sharing the host name) or another pid namespace, and one named without
    its writer keep their commits. The same holder decides a gc marker: a dead gc's is
    ignored at once; another machine's, or an older gc's 3-word text, is left to its lease."""
    import subprocess
    import sys

    from shardstore.ops.transfer import commit_closure
    from shardstore.store import gc_fence

    store = ss.open_store(str(tmp_path / "s"))
    ss.save(store, _state(0), step=0, rng=False)
    pending = [ss.save(store, _state(k), step=k, rng=False, ref=None) for k in (1, 2, 3, 4, 5)]
    closures = [commit_closure(ss.load_commit(store, c)).ids() for c in pending]
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from shardstore.store import gc_fence as g; print(g._owner_suffix()); "
            "print(g._marker_text().decode(), end='')",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_suffix, dead_marker = child.stdout.split("\n", 1)  # a process that has exited
    mine = gc_fence._owner_suffix()
    assert dead_suffix and mine and gc_fence._OWNER.fullmatch(mine[1:])
    pid, start, boot, ns, tag = mine[1:].split("-")
    other_boot = f"-{pid}-{start}-{boot[::-1]}-{ns}-{tag}"  # another machine (or boot) with this host name
    other_ns = f"-{pid}-{start}-{boot}-{int(ns) + 1}-{tag}"  # a container's writer
    names = [
        f"c-{'a' * 32}{dead_suffix}",
        f"c-{'b' * 32}{mine}",
        f"c-{'c' * 32}{other_boot}",
        f"c-{'d' * 32}{other_ns}",
        f"c-{'e' * 32}",
    ]
    for name, cid in zip(names, pending):
        store.storage.write_once(f"intents/{name}", gc_fence._encode_ids([cid]))
    dry = gc(store, grace_seconds=0.0, dry_run=True)
    assert dry.intents_dropped == [f"intents/{names[0]}"] and len(list(store.storage.list("intents"))) == 5
    result = gc(store, grace_seconds=0.0, dry_run=False)
    assert result.intents_dropped == [f"intents/{names[0]}"]
    assert sorted(store.storage.list("intents")) == sorted(f"intents/{n}" for n in names[1:])
    only_dead = closures[0] - set().union(*closures[1:])
    assert only_dead and not any(
        store.has(o) for o in only_dead
    )  # what only the dead writer's intent kept is collected
    assert all(store.has(o) for c in closures[1:] for o in c)
    # the intent a writer writes names it, so a writer killed after writing it is caught the same way
    seen: list[str] = []
    real = store.storage.write_once
    store.storage.write_once = lambda key, data: (seen.append(key), real(key, data))[1]
    try:
        store.set_ref("main", pending[1], expected=store.ref("main"))
    finally:
        store.storage.write_once = real
    assert seen[0].startswith("intents/c-") and seen[0].endswith(mine)
    # gc markers: the same holder record
    doc = json.loads(dead_marker[3:])
    record = doc["holder"]
    for text, state in (
        (dead_marker, "dead"),
        ("gc " + json.dumps({**doc, "holder": {**record, "boot": record["boot"][::-1]}}), "unknown"),
        ("gc " + json.dumps(record), "dead"),  # the previous version's marker: a holder record, no time
        (f"gc {record['host']} {record['pid']}\n", "unknown"),
        (gc_fence._marker_text().decode(), "alive"),
    ):
        store.storage.write_once("gc/probe", text.encode())
        (info,) = gc_fence.gc_markers(store)
        assert info.state == state and info.blocks is (state != "dead"), text
        store.storage.delete("gc/probe")
