"""gc markers left by a gc that died (``shardstore/store/gc_fence.py``, issue 30 defect 3).

A gc killed after writing its marker on another host, boot or pid namespace left
``gc/<nonce>``, and every later ref move elsewhere waited its own 10 minutes, silently;
nothing reported or removed the marker. Now a marker records when it was written and ages
out once, by its own times (SPEC.md §19.2); a waiting writer says what it waits for
(``GcWait``, printed by the command lines); ``refs`` and ``verify`` report markers with
holder and age; ``shardstore gc STORE --break-marker NONCE`` removes one unless its gc runs.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from typing import Any

import pytest
import torch

import shardstore as ss
from shardstore.backends.holders import this_process
from shardstore.store import gc_fence
from shardstore_cli.shardstore_cli import main as shardstore_main


@pytest.fixture
def store(tmp_path: Any) -> ss.Store:
    return ss.open_store(str(tmp_path / "s"))


def _commits(store: ss.Store) -> tuple[str, str]:
    a = ss.save(store, {"w": torch.zeros(2)}, step=0, rng=False)
    return a, ss.save(store, {"w": torch.ones(2)}, step=1, rng=False)


def _elsewhere() -> dict[str, Any]:
    """A gc on another machine that shares nothing but the store: never judged from here."""
    return {**this_process(), "host": "elsewhere", "pid": 4242}


def _plant(store: ss.Store, *, written: float, refreshed: float | None = None, text: bytes | None = None) -> str:
    """A marker of a gc elsewhere, written ``written`` s ago and last refreshed ``refreshed`` s ago."""
    key = f"gc/{secrets.token_hex(16)}"
    now = time.time()
    doc = {"created": now - written, "holder": _elsewhere()}
    store.storage.write_once(key, text or b"gc " + json.dumps(doc).encode() + b"\n")
    when = now - (written if refreshed is None else refreshed)
    os.utime(os.path.join(store.url, key), (when, when))
    return key


def _timed_move(store: ss.Store, cid: str, expected: str) -> float:
    t0 = time.monotonic()
    store.set_ref("main", cid, expected=expected)
    return time.monotonic() - t0


def test_a_dead_gcs_marker_ages_out_once_by_its_own_time(store: ss.Store, monkeypatch: Any) -> None:
    a, b = _commits(store)
    monkeypatch.setattr(gc_fence, "WAIT_SECONDS", 3.0)  # before the fix each writer waited 600 s: GcRace here
    old = _plant(store, written=700)
    assert _timed_move(store, a, b) < 2.0 and store.ref("main") == a  # aged out already: no wait at all
    store.storage.delete(old)
    for text in (b"gc elsewhere 4242\n", b"gc " + json.dumps(_elsewhere()).encode() + b"\n"):  # older markers
        key = _plant(store, written=700, text=text)
        (info,) = gc_fence.gc_markers(store)
        assert info.created is None and info.holder == (None if b"{" not in text else _elsewhere()) and info.stale
        store.storage.delete(key)
    # a gc that refreshes its marker keeps it live, however long ago it was written
    running = _plant(store, written=700, refreshed=1)
    (info,) = gc_fence.gc_markers(store)
    assert info.blocks and not info.stale and 699 < info.age < 710
    store.storage.delete(running)
    # once: the first writer waits until the marker ages out; the next one does not wait again
    monkeypatch.setattr(gc_fence, "STALE_SECONDS", 1.5)
    _plant(store, written=0)
    assert 1.0 <= _timed_move(store, b, a) < 3.0
    assert _timed_move(store, a, b) < 0.5  # before the fix: its own 1.5 s again
    assert store.ref("main") == a


def test_a_writer_says_what_it_waits_for(store: ss.Store, monkeypatch: Any, capsys: Any) -> None:
    a, b = _commits(store)
    monkeypatch.setattr(gc_fence, "NOTICE_SECONDS", 0.1)
    key = _plant(store, written=30, refreshed=0)
    threading.Timer(0.6, store.storage.delete, [key]).start()  # that gc finishes
    with pytest.warns(gc_fence.GcWait) as seen:
        store.set_ref("main", a, expected=b)
    wait = seen[0].message
    assert isinstance(wait, gc_fence.GcWait) and [m.key for m in wait.markers] == [key]
    text = str(wait)
    assert "gc process 4242 on host 'elsewhere' (cannot be checked from here), written 30 s ago" in text, text
    assert f"shardstore gc STORE --break-marker {key[3:]}" in text
    # the command line prints it on stderr
    dst = str(store.url) + "-copy"
    ss.open_store(dst)
    key = _plant(ss.open_store(dst), written=5, refreshed=0)
    threading.Timer(0.6, ss.open_store(dst).storage.delete, [key]).start()
    assert shardstore_main(["copy", store.url, dst, "main", "--ref", "main"]) == 0
    err = capsys.readouterr().err
    assert "shardstore copy: note: waiting" in err and f"{key}: gc process 4242 on host 'elsewhere'" in err, err


def test_refs_and_verify_report_gc_markers(store: ss.Store, capsys: Any) -> None:
    _commits(store)
    key = _plant(store, written=40, refreshed=2)
    for command in ("refs", "verify"):
        assert shardstore_main([command, store.url]) == 0
        out = capsys.readouterr().out
        assert re.search(rf"gc marker {key}: gc process 4242 on host 'elsewhere' .*, written 4\d s ago", out), out
        assert f"--break-marker {key[3:]}" in out
        assert shardstore_main([command, store.url, "--json"]) == 0
        (doc,) = json.loads(capsys.readouterr().out)["gc_markers"]
        assert doc["marker"] == key and doc["holder"]["host"] == "elsewhere" and doc["holder_state"] == "unknown"
        assert 40 <= doc["age_seconds"] < 60 and doc["blocks_writers"] and not doc["stale"]


def test_break_marker_removes_a_marker_unless_its_gc_runs(store: ss.Store, capsys: Any) -> None:
    _commits(store)
    live = gc_fence.GcMarker(store)  # a gc running in this process
    assert shardstore_main(["gc", store.url, "--break-marker", live.key[3:]]) == 1
    assert "not removing a running gc's marker" in capsys.readouterr().err and store.storage.exists(live.key)
    live.close()
    for key in (_plant(store, written=5, refreshed=0), _plant(store, written=5, text=b"gc elsewhere 4242\n")):
        assert shardstore_main(["gc", store.url, "--break-marker", key[3:]]) == 0
        assert f"removed gc marker {key}" in capsys.readouterr().out and not store.storage.exists(key)
    assert shardstore_main(["gc", store.url, "--break-marker", "0" * 32]) == 4
    assert shardstore_main(["gc", store.url, "--break-marker", "../refs/main"]) == 4
    assert shardstore_main(["gc", store.url, "--break-marker", "0" * 32, "--dry-run"]) == 2
    assert store.ref("main") is not None


@pytest.mark.parametrize("lost", ["tensor", "shard manifest"])
def test_a_pin_naming_a_commit_checks_its_closure_is_present(store: ss.Store, lost: str) -> None:
    """A pin keeps a commit's whole closure (SPEC.md §14.1), so the fence checks that closure
    before the pin moves, as it does for a ref: a gc that took part of it while the pin was
    being set (``copy --with-deps`` racing ``gc --grace 0``) makes the pin refuse. Before, only
    the pinned ids themselves were checked, and the pin named an incomplete commit."""
    from shardstore.store import object_key

    cid, _ = _commits(store)
    lc = ss.load_commit(store, cid)
    shard = lc.commit.layout[0].shard
    gone = shard if lost == "shard manifest" else lc.shards[0].entries[0].param
    os.remove(os.path.join(store.url, object_key(gone)))
    with pytest.raises(ss.GcRace, match="pin"):
        store.pin("deps", [cid], expected=None)
    assert store.pinned("deps") is None
