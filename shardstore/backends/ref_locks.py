"""Ref lock files of the local backend, and what to do with one whose writer is gone (SPEC.md §14).

A ref (or pin) moves under ``<key>.lock``, created exclusively (a hard link that fails if it exists); the
new value is written into it and it is renamed over the ref. A writer killed in between
leaves the lock behind, and every later update of that ref fails until it is removed.

So the lock records its **holder** from creation until the new value replaces it: one
line of JSON, ``{"boot": …, "host": …, "pid": …, "pidns": …, "start": …}`` — the host
name, the process id, the process's start time (field 22 of ``/proc/<pid>/stat``), the
kernel's boot id and the process's pid namespace. It is never hashed and never part of a
ref's value: the writer truncates it and writes the ref value into the same file just
before the rename. A later writer that finds the lock held judges the holder:

- **dead** — same host, boot id and pid namespace, and no process ``pid`` with that start
  time exists (it exited, or its pid was reused): the lock is stale. The writer takes it
  over safely — under ``flock`` on the lock file (so two writers never both take it), it
  checks that the path still names the same file holding the same record, removes it and
  creates its own lock as usual;
- **alive** (including a process that exists but cannot be inspected: another user's under
  ``hidepid``, ``backends.holders``), or **not judgeable** (another host, another boot or
  namespace, an old lock without a record, or a lock caught after its value was written): ``RefConflict`` naming
  the holder and the command that clears it, ``shardstore refs STORE --break-lock NAME``,
  to run only once no writer of that ref is running.

S3 moves refs by conditional requests and has no lock files.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import RefConflict
from .holders import MAX_RECORD as _MAX_RECORD
from .holders import holder_record, holder_state, read_holder

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: locks are reported, never taken over
    fcntl = None  # type: ignore[assignment]

__all__ = ["holder_record", "read_holder", "holder_state", "take_lock", "break_lock", "describe"]


def describe(key: str, lock: str, holder: dict[str, Any] | None, state: str) -> str:
    name = key.split("/", 1)[1] if key.startswith(("refs/", "pins/")) else key
    who = (
        "an older writer or a writer caught finishing (no holder recorded)"
        if holder is None
        else f"process {holder['pid']} on host {holder['host']!r} ({'still running' if state == 'alive' else 'cannot be checked from here'})"
    )
    fix = (
        ""
        if state == "alive"
        else (
            f"; if no writer of it is running, clear it with `shardstore refs STORE --break-lock {name}`"
            if key.startswith("refs/")
            else "; if no writer of it is running, remove the lock file"
        )
    )
    return f"{key} is locked by {who}: {lock} exists{fix} (SPEC.md §Refs)"


def _read_lock(osm: Any, lock: str) -> bytes | None:
    """The first bytes of ``lock`` (enough for any record), None if it is gone."""
    try:
        fd = osm.open(lock, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    try:
        return bytes(osm.read(fd, _MAX_RECORD + 1))
    finally:
        osm.close(fd)


def _take_over(osm: Any, lock: str, seen: bytes) -> bool:
    """Remove ``lock`` if it still is the file that recorded a dead holder as ``seen``; True if removed."""
    if fcntl is None:
        return False
    try:
        fd = osm.open(lock, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return True  # gone meanwhile: someone finished or took it over; try to create ours
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one taker at a time; released if we die
        st = osm.fstat(fd)
        now = osm.stat(lock, follow_symlinks=False)
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev) or osm.pread(fd, _MAX_RECORD + 1, 0) != seen:
            return False  # another taker already replaced it
        osm.unlink(lock)
        return True
    except BlockingIOError:
        return False  # another taker holds it: let the caller report
    finally:
        osm.close(fd)


def take_lock(key: str, lock: str, tmp: str, osm: Any = os) -> int:
    """Create ``lock`` exclusively, holding this process's record from its first instant, and return
    a descriptor of it; a lock of a dead holder on this host is taken over, any other is RefConflict
    (OSError passes up).

    The record is written into ``tmp`` (a fresh name in the store's ``tmp/``) which is then
    hard-linked as ``lock``: ``link`` fails if the name exists, as ``O_EXCL`` does, and a lock is
    never seen empty. ``osm``: the ``os`` module to call (the local backend's, which
    fault-injection tests replace)."""
    osm.makedirs(os.path.dirname(tmp), exist_ok=True)
    fd = osm.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        osm.write(fd, holder_record())
        for _ in range(3):
            try:
                osm.link(tmp, lock)
                return fd
            except FileExistsError:
                seen = _read_lock(osm, lock)
                if seen is None:
                    continue  # released meanwhile
                holder = read_holder(seen)
                state = holder_state(holder)
                if state == "dead" and _take_over(osm, lock, seen):
                    continue
                raise RefConflict(describe(key, lock, holder, state)) from None
        raise RefConflict(describe(key, lock, None, "unknown"))
    except BaseException:
        osm.close(fd)
        raise
    finally:
        try:
            osm.unlink(tmp)  # the lock's other name; the lock (if linked) stays
        except OSError:
            pass  # a stale tmp/ file: gc removes it


def break_lock(lock: str, key: str, osm: Any = os) -> dict[str, Any] | None:
    """Remove ``lock`` (an operator's ``refs --break-lock``) unless its holder is alive on this host; return the holder it recorded."""
    seen = _read_lock(osm, lock)
    if seen is None:
        raise RefConflict(f"{key} is not locked ({lock} does not exist)")
    holder = read_holder(seen)
    if holder_state(holder) == "alive":
        raise RefConflict(describe(key, lock, holder, "alive") + "; not breaking a live writer's lock")
    osm.unlink(lock)
    return holder
