"""Judging a holder (``shardstore/backends/holders.py``, issue 30 defect 1).

A writer that could not read ``/proc/<pid>/stat`` of a gc's or a lock holder's process
(another user under ``hidepid=2``, a private /proc) took the live process for dead: it
moved a ref while that gc deleted, or took over (and ``refs --break-lock`` removed) a live
writer's ref lock; a gc so placed dropped a live writer's intent. A process that exists but cannot be inspected is alive; only "no such
process" (or a readable start time that differs: a reused pid) is dead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

import shardstore as ss
from shardstore.backends import holders
from shardstore.backends.holders import holder_record, holder_state, read_holder
from shardstore.store import gc_fence
from shardstore_cli.shardstore_cli import main as shardstore_main


def _reaped_child_record() -> dict[str, Any]:
    """The record of a process that has exited (and been reaped)."""
    out = subprocess.run(
        [sys.executable, "-c", "from shardstore.backends.holders import holder_record as h; print(h().decode())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def _store(root: str) -> tuple[ss.Store, str, str]:
    store = ss.open_store(os.path.join(root, "s"))
    a = ss.save(store, {"w": torch.zeros(2)}, step=0, rng=False)
    b = ss.save(store, {"w": torch.ones(2)}, step=1, rng=False)
    return store, a, b


def _hide_own_stat(monkeypatch: Any) -> None:
    """As under hidepid: this process's ``/proc/<pid>/stat`` cannot be read (``/proc/self`` still can)."""
    real = holders._read_text
    hidden = f"/proc/{os.getpid()}/stat"
    monkeypatch.setattr(holders, "_read_text", lambda path, *a, **k: None if path == hidden else real(path, *a, **k))


def test_a_live_process_whose_stat_cannot_be_read_is_alive_for_locks_and_gc_markers(
    tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    store, a, b = _store(str(tmp_path))
    me = holder_record()  # taken before the stat is hidden: the record a live holder wrote
    marker = gc_fence.GcMarker(store)  # a live gc's marker
    intent = f"intents/c-{'a' * 32}{gc_fence._owner_suffix()}"  # a live writer's intent
    store.storage.write_once(intent, gc_fence._encode_ids([a]))
    dead = _reaped_child_record()
    _hide_own_stat(monkeypatch)
    assert holder_state(read_holder(me)) == "alive"  # was "dead"
    assert holder_state(dead) == "dead"  # kill(pid, 0): no such process
    assert gc_fence.dead_intents(store) == []  # gc keeps a live writer's intent (it dropped it before)
    store.storage.delete(intent)
    # a writer waits for the live gc instead of moving the ref while it deletes
    done: list[BaseException | None] = []

    def move() -> None:
        try:
            store.set_ref("main", a, expected=b)
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - asserted below
            done.append(e)

    t = threading.Thread(target=move)
    t.start()
    time.sleep(0.3)
    assert done == [] and store.ref("main") == b  # before the fix: moved at once
    marker.close()
    t.join(timeout=30)
    assert done == [None] and store.ref("main") == a
    # a live holder's ref lock is neither taken over nor broken
    lock = tmp_path / "s" / "refs" / "main.lock"
    lock.write_bytes(me)
    with pytest.raises(ss.RefConflict, match=r"still running"):
        store.set_ref("main", b, expected=a)
    assert shardstore_main(["refs", store.url, "--break-lock", "main"]) == 1
    assert "not breaking a live writer's lock" in capsys.readouterr().err and lock.exists()
    assert store.ref("main") == a


def test_a_proc_that_is_not_ours_is_not_read_for_start_times(monkeypatch: Any) -> None:
    """/proc/self/stat naming another pid: the /proc mounted here is another namespace's, its
    start times are not our processes'. Only ``kill`` decides, and our own records name no
    start time (never judged dead)."""
    me = json.loads(holder_record())
    reused = {**me, "start": str(int(me["start"]) + 1)}  # this pid, another start time: a reused pid
    assert holder_state(reused) == "dead"  # with our own /proc, a reused pid is told apart
    dead = _reaped_child_record()
    real = holders._read_text
    monkeypatch.setattr(
        holders,
        "_read_text",
        lambda path, *a, **k: "1 (init) S 0 1 1 0 -1 0" if path == "/proc/self/stat" else real(path, *a, **k),
    )
    assert holder_state(reused) == "alive"  # was "dead": a foreign /proc's start time was trusted
    assert holder_state(dead) == "dead"
    assert holders.this_process()["start"] is None


def test_records_that_name_no_process_are_never_dead() -> None:
    me = json.loads(holder_record())
    for pid in (0, -1, 1 << 40, True):
        assert holder_state({**me, "pid": pid}) == "unknown", pid  # kill(0, 0) would ask about our group
    assert read_holder(json.dumps({**me, "start": 12}).encode()) is None  # a start time that is not text
    assert read_holder(b"[" * 4000) is None  # nested past the parser's depth: no RecursionError


_JUDGE = (  # a private /proc with hidepid=invisible (= 2), then root's uid without a capability or group 0
    "mount -t proc -o hidepid=invisible proc /proc && exec setpriv --regid=nogroup --clear-groups "
    '--bounding-set -all --inh-caps -all "$0" "$@"'
)


def _can_hide_proc() -> str | None:
    """Why the hidepid test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (to mount a private /proc with hidepid and run processes as other users)"
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"needs util-linux's {tool}"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", _JUDGE, "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:  # hidepid=invisible: per-mount /proc options (Linux 5.8+), never the host's /proc
        return f"cannot mount a private /proc with hidepid=invisible and drop privileges here: {probe.stderr.strip()}"
    return None


_CHILD = """
import json, os, sys
import shardstore as ss
from shardstore.backends.holders import holder_state
from shardstore.store import gc_fence
from shardstore_cli.shardstore_cli import main
url, a, b, record = sys.argv[1:5]
print("hidden", os.path.exists("/proc/%d/stat" % json.loads(record)["pid"]), flush=True)
print("state", holder_state(json.loads(record)), flush=True)
gc_fence.WAIT_SECONDS = 1.0
store = ss.open_store(url, create=False)
try:
    store.set_ref("main", a, expected=b)
    print("marker ignored: ref moved", flush=True)
except ss.GcRace:
    print("marker kept: waited", flush=True)
input()  # the test removes the marker and plants a lock
try:
    store.set_ref("main", a, expected=b)
    print("lock taken over", flush=True)
except ss.RefConflict:
    print("lock refused", flush=True)
print("break-lock exit", main(["refs", url, "--break-lock", "main", "-q"]), flush=True)
"""


def test_a_live_holder_behind_hidepid_is_alive_to_another_user(tmp_path: Any) -> None:
    """The case as it happens: the holder (a gc, then a ref lock's writer) runs as ``nobody``;
    the judge runs as another user (root's uid without capabilities or group 0) under a
    private /proc mounted ``hidepid=invisible`` (= 2), so it can neither read the holder's
    stat nor signal it (EPERM)."""
    why = _can_hide_proc()
    if why is not None:
        pytest.skip(why)
    store, a, b = _store(str(tmp_path))
    holder = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sleep", "120"])
    try:
        start = holders._start_time(holder.pid)
        assert start is not None
        record = json.dumps({**json.loads(holder_record()), "pid": holder.pid, "start": start})
        key = "gc/" + "ab" * 16
        store.storage.write_once(key, b"gc %s\n" % record.encode())  # as the previous version writes (no time)
        child = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", _JUDGE]
            + [sys.executable, "-c", _CHILD, store.url, a, b, record],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdin is not None
        lines = [child.stdout.readline().strip() for _ in range(3)]
        if lines != ["hidden False", "state alive", "marker kept: waited"]:
            child.kill()  # it waits for the next step on stdin
            pytest.fail(f"{lines}: {child.communicate()[1]}")  # before the fix: "state dead", the ref moved
        store.storage.delete(key)
        lock = tmp_path / "s" / "refs" / "main.lock"
        lock.write_text(record + "\n")
        child.stdin.write("\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=60)
        assert out.split("\n")[:2] == ["lock refused", "break-lock exit 1"], (out, err)
        assert lock.exists() and store.ref("main") == b
    finally:
        holder.kill()
        holder.wait()
