"""Kill at every write point (issue 8, part 1).

A two-slot store holds commit c0 (step 1). Two more two-slot saves (steps 2 and 3) are
run in a forked child that SIGKILLs itself just before the k-th operation, for every k:
once counting Storage calls (write_once, sync, swap, reads: object, manifest, read-back
"ack", ref and journal steps) and once counting the local backend's system calls (open,
write, fsync, link, rename, unlink, makedirs, ...). After each kill the store is reopened
and must show:

- the ref on c0, c1 or c2 (never anything else), and a leftover ``refs/main.lock`` only
  where the kill fell inside the ref update (the ref itself unchanged);
- ``verify`` clean for everything reachable, and a restore bitwise equal to that commit's
  state;
- recovery: finishing the remaining saves from there reproduces exactly c2 (leftovers
  of the killed save never poison a later one), and ``gc`` then leaves exactly the
  objects an uninterrupted run leaves.

Plus random-time kills of a child saving six steps in a loop: every commit it had
acknowledged (recorded after ``save_slots`` returned) is on the ref's history.

Children are forked from this process (torch already imported): ``os.fork`` and
``os._exit``, never multiprocessing. ``SHARDSTORE_SLOW=1`` runs every syscall point in
both phases and more random kills.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from typing import Any

import pytest
import torch
from conftest import TinyNet, make_optimizer, train_steps
from faults import (
    KILL,
    FaultyOs,
    OpLog,
    fast_dir,
    frozen_slots,
    kill_at,
    patch_local_os,
    set_local_os,
    slots_snapshot,
    snapshot,
)
from sweeps import DENSITIES

import shardstore as ss
from shardstore.backends.local import LocalStorage
from shardstore.backends.ref_locks import holder_state, read_holder
from shardstore.ops.gc import gc

SLOW = bool(os.environ.get("SHARDSTORE_SLOW"))
STEPS = 3  # c0 = step 1 (the base), then the saves under test: steps 2 and 3
SPLIT = 3


@pytest.fixture(scope="module")
def plan(tmp_path_factory: Any) -> dict[str, Any]:
    """States for steps 1..6, a base store holding c0, and the reference commit ids."""
    torch.manual_seed(0)
    model = TinyNet(width=4)
    opt = make_optimizer(model)
    states, infos = [], []
    for step in range(1, 7):
        train_steps(model, opt, 1, seed=step)
        rng = {"torch": bytes(range(step, step + 16))}
        states.append(frozen_slots(model, opt, SPLIT, rng=rng))
        infos.append(ss.CommitInfo(step=step, config={"width": 4, "eps": 1e-5}, data_cursor=8 * step))
    base = str(tmp_path_factory.mktemp("crash") / "base")
    store = ss.open_store(base)
    c0 = ss.save_slots(store, states[0], info=infos[0], threads=1)
    ref_root = str(tmp_path_factory.mktemp("crash") / "reference")
    shutil.copytree(base, ref_root)
    ref_store = ss.open_store(ref_root)
    ids = [c0]
    for i in range(1, 6):
        ids.append(ss.save_slots(ref_store, states[i], info=infos[i], threads=1))
    return {"states": states, "infos": infos, "base": base, "ids": ids, "snap": [slots_snapshot(s) for s in states]}


@pytest.fixture
def tmp_path(tmp_path: Any) -> Any:  # noqa: F811 - hundreds of stores: keep them in RAM where possible
    import pathlib

    d = fast_dir(str(tmp_path))
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_disk_waits(monkeypatch: Any) -> None:
    """Process kills lose nothing the page cache holds, so fsync need not reach the disk here
    (it is still called and counted; power loss is tests/reliability/test_reliability_powerloss.py)."""
    patch_local_os(monkeypatch, FaultyOs(fsync=False))


def _restore_snapshot(store: ss.Store, target: str) -> dict[str, bytes]:
    model = TinyNet(width=4, seed=99)
    opt = make_optimizer(model, lr=0.5)
    ss.restore(store, target, model, opt)
    return snapshot(model, opt)


def _fork(child: Any) -> int:
    """Run ``child()`` in a forked process; return its wait status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            child()
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _check_after_crash(root: str, plan: dict[str, Any], last: int) -> dict[str, Any]:
    """Every invariant of a store after a kill during the saves of steps 2..``last``+1."""
    ids = plan["ids"]
    store = ss.open_store(root, create=False)
    lock = os.path.join(root, "refs", "main.lock")
    ref = store.ref("main")
    assert ref in ids[: last + 1], f"ref main is {ref}, not one of the commits being saved"
    stale_lock = os.path.exists(lock)
    if stale_lock:
        # A kill inside the ref update (SPEC §Refs): a lock still recording its holder (the dead
        # child, on this host) is taken over by the next writer; one caught after the new value
        # was written into it records none, and updates refuse, naming `refs --break-lock`.
        with open(lock, "rb") as f:
            holder = read_holder(f.read())
        if holder is None:
            with pytest.raises(ss.RefConflict, match=r"main\.lock.*--break-lock main"):
                store.set_ref("main", ids[0], expected=ref)
        else:
            assert holder["pid"] != os.getpid() and holder_state(holder) == "dead"
        assert store.ref("main") == ref and store.ref_names() == ["main"]
    report = ss.verify(store)
    assert report.ok, [str(p) for p in report.problems]
    i = ids.index(ref)
    assert _restore_snapshot(store, "main") == plan["snap"][i]
    if stale_lock and holder is None:
        os.unlink(lock)  # what `shardstore refs --break-lock main` does
    # recovery (a dead holder's lock is taken over by the first save): finish the remaining saves; the ids are exactly the uninterrupted run's
    for j in range(i + 1, last + 1):
        assert ss.save_slots(store, plan["states"][j], info=plan["infos"][j], threads=1) == ids[j]
    assert store.ref("main") == ids[last]
    past = time.time() - 3600  # the crashed writes are old: gc spares tmp/ files younger than TMP_MIN_AGE
    for key in store.storage.list("tmp"):
        os.utime(os.path.join(root, key), (past, past), follow_symlinks=False)
    gc(store, grace_seconds=0, dry_run=False)
    assert ss.verify(store).ok
    assert list(store.storage.list("tmp")) == []
    return {"ref": i, "lock": stale_lock, "taken_over": stale_lock and holder is not None}


def _fresh(tmp_path: Any, plan: dict[str, Any], name: str) -> str:
    root = str(tmp_path / name)
    shutil.copytree(plan["base"], root)
    return root


def _saves(root: str, plan: dict[str, Any], wrap: Any = None) -> None:
    storage: Any = LocalStorage(root)
    if wrap is not None:
        storage = wrap(storage)
    store = ss.Store(storage, create=False)
    for j in range(1, STEPS):
        ss.save_slots(store, plan["states"][j], info=plan["infos"][j], threads=1)


def _reference_ops(tmp_path: Any, plan: dict[str, Any]) -> OpLog:
    root = _fresh(tmp_path, plan, "count")
    holder: list[OpLog] = []

    def wrap(inner: Any) -> OpLog:
        holder.append(OpLog(inner))
        return holder[0]

    _saves(root, plan, wrap)
    return holder[0]


@pytest.mark.parametrize("density", DENSITIES)
def test_kill_before_every_storage_operation(tmp_path: Any, plan: dict[str, Any], density: str) -> None:
    """A kill before each storage operation (CI's long step), or before every third one and on
    each side of both swaps (the test command): the ref is on the old commit or the new one."""
    ops = _reference_ops(tmp_path, plan)
    labels = {lab for _, _, lab in ops.log if lab}
    assert {"object", "shard manifest", "commit manifest", "ref", "journal"} <= labels
    assert sum(op == "sync" for op, _, _ in ops.log) >= 6 and sum(op == "swap" for op, _, _ in ops.log) == 2
    n = len(ops.log)
    swaps = [i for i, (op, _, _) in enumerate(ops.log) if op == "swap"]
    points = range(n + 1)
    if density == "sample" and not SLOW:
        points = sorted({*range(0, n + 1, 3), n, *(s + d for s in swaps for d in (0, 1))})
    outcomes = []
    for k in points:
        root = _fresh(tmp_path, plan, f"k{k}")
        status = _fork(lambda: _saves(root, plan, lambda inner: OpLog(inner, kill_at(k))))
        if k < n:
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (k, ops.log[k])
        else:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        outcomes.append(_check_after_crash(root, plan, STEPS - 1)["ref"])
        shutil.rmtree(root)
    # the ref moved exactly at the two swaps, no earlier and no later
    expected = [0] * (swaps[0] + 1) + [1] * (swaps[1] - swaps[0]) + [2] * (n - swaps[1])
    assert outcomes == [expected[k] for k in points]
    print(f"storage-op kill points: {len(points)} of {n + 1}")


def _syscall_count(tmp_path: Any, plan: dict[str, Any]) -> list[str]:
    root = _fresh(tmp_path, plan, "syscount")
    fos = FaultyOs(fsync=False)
    saved = set_local_os(fos)
    try:
        _saves(root, plan)
    finally:
        set_local_os(saved)
    return fos.calls


@pytest.mark.long
def test_kill_before_every_system_call(tmp_path: Any, plan: dict[str, Any]) -> None:
    calls = _syscall_count(tmp_path, plan)
    assert {"open:w", "write", "fsync", "link", "replace", "unlink"} <= set(calls)
    points = list(range(len(calls) + 1))
    if not SLOW:  # CI: every call that creates, links, renames or removes a name
        points = [
            k for k in points if k == len(calls) or calls[k] in ("open:w", "link", "replace", "unlink", "makedirs")
        ]
    locks = refs = taken = 0
    for k in points:
        root = _fresh(tmp_path, plan, f"s{k}")

        def child() -> None:
            set_local_os(FaultyOs(at=k, err=KILL, fsync=False))
            _saves(root, plan)

        status = _fork(child)
        assert os.WIFSIGNALED(status) or (k == len(calls) and os.WEXITSTATUS(status) == 0), k
        out = _check_after_crash(root, plan, STEPS - 1)
        locks += out["lock"]
        taken += out["taken_over"]
        refs |= 1 << out["ref"]
        shutil.rmtree(root)
    # every outcome occurred, including a lock left by a kill in the ref update: one recording its
    # dead holder (taken over by the recovery's first save) and one holding the new value (refused)
    assert refs == 0b111 and locks > taken >= 1
    print(f"system-call kill points: {len(points)} of {len(calls) + 1}, stale locks: {locks}, taken over: {taken}")


def test_kill_at_random_times(tmp_path: Any, plan: dict[str, Any]) -> None:
    """A child saves steps 2..6 (two threads per slot, as by default) and records each commit
    id after save_slots returns; it is killed at a random time."""
    rounds = 60 if SLOW else 16
    root0 = _fresh(tmp_path, plan, "timing")
    t0 = time.perf_counter()
    _fork(
        lambda: [
            ss.save_slots(ss.open_store(root0, create=False), plan["states"][j], info=plan["infos"][j])
            for j in range(1, 6)
        ]
    )
    full = time.perf_counter() - t0
    rnd = random.Random(8)
    seen = set()
    for r in range(rounds):
        root = _fresh(tmp_path, plan, f"r{r}")
        acks = os.path.join(str(tmp_path), f"acks{r}")
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                store = ss.open_store(root, create=False)
                fd = os.open(acks, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                for j in range(1, 6):
                    cid = ss.save_slots(store, plan["states"][j], info=plan["infos"][j])
                    os.write(fd, cid.encode() + b"\n")
                os._exit(0)
            except BaseException:
                os._exit(3)
        time.sleep(rnd.uniform(0, full * 1.1))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0
        acked = open(acks).read().split() if os.path.exists(acks) else []
        store = ss.open_store(root, create=False)
        ref = store.ref("main")
        history, c = [], ref
        while c is not None:
            history.append(c)
            c = store.commit(c).parent
        assert set(acked) <= set(history), "an acknowledged commit was lost"
        assert acked == plan["ids"][1 : len(acked) + 1]
        out = _check_after_crash(root, plan, 5)
        assert out["ref"] >= len(acked)
        seen.add(out["ref"])
        shutil.rmtree(root)
    assert len(seen) >= 2, seen  # the kills did land at different points
    print(f"random kills: {rounds}, refs seen at steps {sorted(s + 1 for s in seen)}")
