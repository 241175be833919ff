"""Ref lock files that record their holder (``shardstore/backends/ref_locks.py``, issue 25).
Transitions on a ref (``shardtrain regroup/grow --commit REF``) are tested in
tests/shardtrain/reshape/test_ref_transitions.py.

A writer killed mid-update left ``refs/main.lock`` and the next ``train --resume main``
could not move the ref until someone deleted it by hand. Now a lock records its holder: a
dead holder's lock on this host is taken over by the next writer; any other is reported
with the command that clears it (``shardstore refs STORE --break-lock NAME``).
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest
import torch

import shardstore as ss
from shardstore.backends.ref_locks import holder_record, holder_state, read_holder
from shardstore_cli.shardstore_cli import main as shardstore_main


def _store(tmp_path: Any) -> tuple[ss.Store, str, str]:
    store = ss.open_store(str(tmp_path / f"store-{uuid.uuid4().hex[:6]}"))
    a = ss.save(store, {"w": torch.zeros(2)}, step=0, rng=False)
    b = ss.save(store, {"w": torch.ones(2)}, step=1, rng=False)
    return store, a, b


def _dead_holder_record() -> bytes:
    """The record a forked child writes into a lock, after the child has exited (reaped)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its record, then die without cleanup
        os.write(w, holder_record())
        os._exit(0)
    os.close(w)
    record = os.read(r, 4096)
    os.close(r)
    os.waitpid(pid, 0)
    return record


def test_a_dead_writers_lock_is_taken_over_by_the_next_writer(tmp_path: Any) -> None:
    store, a, b = _store(tmp_path)
    lock = tmp_path / store.url.rsplit("/", 1)[-1] / "refs" / "main.lock"
    record = _dead_holder_record()
    holder = read_holder(record)
    assert holder is not None and holder["pid"] != os.getpid() and holder_state(holder) == "dead"
    lock.write_bytes(record)
    store.set_ref("main", a, expected=b)  # failed before: RefConflict until the lock was removed by hand
    assert store.ref("main") == a and not lock.exists()


def test_a_live_or_unjudgeable_lock_is_reported_with_its_holder_and_the_command_that_clears_it(
    tmp_path: Any, capsys: Any
) -> None:
    store, a, b = _store(tmp_path)
    lock = tmp_path / store.url.rsplit("/", 1)[-1] / "refs" / "main.lock"
    lock.write_bytes(holder_record())  # this very process: alive
    with pytest.raises(ss.RefConflict, match=rf"locked by process {os.getpid()} on host .* \(still running\)") as e:
        store.set_ref("main", a, expected=b)
    assert "--break-lock" not in str(e.value)
    assert shardstore_main(["refs", store.url, "--break-lock", "main"]) == 1  # never a live writer's
    assert "not breaking a live writer's lock" in capsys.readouterr().err and lock.exists()
    other = {**json.loads(holder_record()), "host": "another-host"}  # a shared filesystem: cannot be checked here
    lock.write_bytes(json.dumps(other).encode())
    with pytest.raises(
        ss.RefConflict,
        match=r"host 'another-host' \(cannot be checked from here\).*shardstore refs STORE --break-lock main",
    ):
        store.set_ref("main", a, expected=b)
    assert store.ref("main") == b
    assert shardstore_main(["refs", store.url, "--break-lock", "main"]) == 0
    assert "removed the lock of ref main (held by process" in capsys.readouterr().out and not lock.exists()
    store.set_ref("main", a, expected=b)
    lock.write_bytes(b"")  # an older writer's lock records nothing
    with pytest.raises(ss.RefConflict, match=r"no holder recorded.*--break-lock main"):
        store.set_ref("main", b, expected=a)


def test_a_lock_holds_its_holder_until_the_new_value_replaces_it(tmp_path: Any) -> None:
    """The record is never part of a ref: after the update the ref file is exactly the 65-byte value."""
    store, a, b = _store(tmp_path)
    store.set_ref("main", a, expected=b)
    ref = tmp_path / store.url.rsplit("/", 1)[-1] / "refs" / "main"
    assert ref.read_bytes() == (a + "\n").encode()
