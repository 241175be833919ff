"""The fence between gc and the writers that move refs and pins (SPEC.md §19a, §19b).

gc must never delete an object that a ref or pin names *as it stands when the object is
deleted*, at any grace period, including 0. Reading the refs once and deleting later
cannot promise that on its own: a writer may move a ref onto a commit gc judged garbage
in between. The fence is a two-flag handshake (Dekker's, over the store):

- a **writer** that moves a ref to commit C (or sets a pin) first writes an *intent*
  (``intents/c-<nonce>`` naming C, ``intents/p-<nonce>`` naming the pin's new objects),
  then waits until no live *gc marker* exists, then checks that everything it is about to
  name is present (a commit: its whole closure), then moves the ref by compare-and-swap,
  then deletes its intent. A missing object means a gc took it first: ``GcRace``, and the
  ref is not moved.
- **gc** first writes its marker (``gc/<nonce>``), then lists objects, reads refs, pins
  and intents and keeps what they name (an intent's commit with its closure), and deletes
  its marker only after its last delete. It refreshes the marker while it sweeps.

Why it holds: suppose gc Γ deletes X while a ref names C ∋ X, moved there by a writer W.
W saw no live marker at some instant *a* after writing its intent. If Γ's marker was gone
by *a*, Γ's deletes came before *a*, hence before W's presence check, which would have
refused. Otherwise Γ's marker was written after *a*, so after W's intent: Γ lists intents
later still and finds W's intent (deleted only after the ref moved, and then Γ's later
read of the refs finds C), so it keeps C's closure. Either way X is not deleted.

Liveness: a gc that crashes leaves its marker. A writer ignores a marker that names a
process of its own host and pid namespace that no longer exists (the marker holds host,
pid and pid namespace: a process of another namespace, a container sharing the host's
name, is never judged by this one's pids), and treats any marker whose modification time
has not changed for ``STALE_SECONDS`` of its own clock as abandoned;
gc refreshes its marker at least every ``REFRESH_SECONDS`` and stops deleting if it could
not refresh it for ``STALE_SECONDS / 2`` (the one timing assumption, as in any lease).
A writer that waits longer than ``WAIT_SECONDS`` raises ``GcRace`` without moving the ref.
An intent's key names its writer the same way (pid, pid namespace, a tag of the host
name): gc removes, before it marks, the intents of writers of its own host and namespace
that no longer exist (such a writer can never move the ref its intent announced); any
other intent left by a writer that crashed keeps its commit like a pin until it is
removed (``intents/`` is safe to empty when no writer runs).
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from ..backends.base import Storage
from ..errors import GcRace, ObjectNotFound, ShardstoreError
from ..format.closure import commit_closure
from ..format.manifest import FORMAT_VERSION, MAX_MANIFEST_BYTES, CommitManifest, PinManifest, ShardManifest, decode_manifest, encode
from ..format.names import check_oid


class Store(Protocol):
    """What the fence uses of the store (``store.Store`` is one; it calls the fence, so the
    fence names its role here instead of importing it)."""

    storage: Storage
    url: str

    def has(self, oid: str) -> bool: ...

    def commit(self, oid: str) -> CommitManifest: ...

    def shard(self, oid: str) -> ShardManifest: ...

__all__ = ["fenced_move", "GcMarker", "intent_objects", "dead_intents", "STALE_SECONDS", "REFRESH_SECONDS", "WAIT_SECONDS"]

INTENTS = "intents"
MARKERS = "gc"
#: A gc marker unchanged for this long (by the writer's own clock) belongs to a gc that died.
STALE_SECONDS = 600.0
#: gc refreshes its marker at least this often while it runs.
REFRESH_SECONDS = 30.0
#: The longest a writer waits for running gcs before it gives up (GcRace, ref not moved).
WAIT_SECONDS = 3600.0
_POLL_SECONDS = 0.02


def _encode_ids(ids: Sequence[str]) -> bytes:
    return encode(PinManifest(version=FORMAT_VERSION, objects=tuple(sorted(set(ids)))))


def fenced_move(store: Store, *, commit: str | None = None, objects: Sequence[str] = (), move: Callable[[], None]) -> None:
    """Run ``move`` (a ref's or pin's compare-and-swap) behind the fence: intent, wait for no
    gc, presence check of what it will name, move, drop the intent (module docstring).

    ``commit``: a ref move, checking the commit's closure, or only ``objects`` if given (a slot
    copy holds its slot's closure); no ``commit``: a pin naming ``objects``."""
    kind, ids = ("c", [commit]) if commit is not None else ("p", list(objects))  # ``objects`` with a commit: what it needs
    host, ns, pid = _owner()
    key = f"{INTENTS}/{kind}-{secrets.token_hex(16)}-{pid}-{ns}-{_host_tag(host)}"
    store.storage.write_once(key, _encode_ids([check_oid(i, what="object id in an intent") for i in ids]))
    try:
        _wait_for_no_gc(store)
        missing = _missing(store, commit, objects)
        if missing:
            what = f"commit {commit}" if commit is not None else "the pin"
            raise GcRace(
                f"{len(missing)} object(s) {what} needs are missing from {store.url} (e.g. {missing[0]}): never "
                f"written, or a gc removed them while they were being written (SPEC.md §19b); the ref or pin was not moved"
            )
        move()
    finally:
        try:
            store.storage.delete(key)
        except ShardstoreError:
            pass  # a leftover intent only keeps its commit, like a pin


@dataclass(frozen=True)
class _Commit:
    """A commit and its shard manifests, read as the fence needs them (ids only, no checks:
    the writer checked the commit before it moved a ref to it)."""

    id: str
    commit: CommitManifest
    shards: dict[int, ShardManifest]
    shard_ids: dict[int, str]


def _read(store: Store, cid: str) -> _Commit:
    commit = store.commit(cid)
    return _Commit(cid, commit, {lay.slot: store.shard(lay.shard) for lay in commit.layout}, {lay.slot: lay.shard for lay in commit.layout})


def _missing(store: Store, commit: str | None, objects: Sequence[str]) -> list[str]:
    if commit is None or objects:
        ids = sorted(set(objects) | ({commit} if commit else set()))
    else:
        if not store.has(commit):
            return [commit]  # never written, or taken by a gc: a ref never names a missing commit
        try:
            ids = sorted(commit_closure(_read(store, commit)).ids())
        except ObjectNotFound as e:  # a shard manifest gc took: the commit no longer loads
            raise GcRace(f"commit {commit} in {store.url} no longer loads ({e}); the ref was not moved") from None
        except ShardstoreError:
            ids = [commit]  # not a commit (the low-level API lets a ref name any object): nothing more to keep
    with ThreadPoolExecutor(max_workers=8) as pool:  # a HEAD each on S3
        present = list(pool.map(store.has, ids))
    return [oid for oid, ok in zip(ids, present) if not ok]


def _wait_for_no_gc(store: Store) -> None:
    """Return once no live gc marker exists; GcRace after ``WAIT_SECONDS``."""
    seen: dict[str, tuple[float | None, float]] = {}  # marker -> (its mtime, when that mtime was first seen)
    start = time.monotonic()
    while True:
        now = time.monotonic()
        live = []
        for key in store.storage.list(MARKERS):
            mtime = store.storage.mtime(key)
            if mtime is None or _dead_here(store, key):
                continue  # gone (that gc finished), or its process on this host is no more
            old = seen.get(key)
            if old is None or old[0] != mtime:
                seen[key] = (mtime, now)
            if now - seen[key][1] < STALE_SECONDS:
                live.append(key)
        if not live:
            return
        if now - start > WAIT_SECONDS:
            raise GcRace(f"gc has held {store.url} for over {WAIT_SECONDS:.0f} s ({live[0]}); the ref or pin was not moved")
        time.sleep(_POLL_SECONDS)


def _owner() -> tuple[str, int, int]:
    """This process as another process can check it: (host name, pid namespace, pid). The
    namespace is the inode of ``/proc/self/ns/pid`` (0 without one: then there are no pid
    namespaces either); a pid means a process only within its namespace."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return socket.gethostname(), ns, os.getpid()


def _host_tag(host: str) -> str:
    """16 hex digits naming a host name in a key (a host name may hold any character)."""
    return hashlib.blake2b(host.encode(), digest_size=8).hexdigest()


def _gone(pid: int) -> bool:
    """True if no process ``pid`` exists in this namespace (one that exists but is not ours counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):
        return False
    return False


def _marker_text() -> bytes:
    host, ns, pid = _owner()
    return f"gc {host} {pid} {ns}\n".encode()


def _dead_here(store: Store, key: str) -> bool:
    """True if the marker names a process of this host and pid namespace that no longer
    exists (a killed gc): then no gc can be deleting under it, and waiting out its lease
    would stall every commit. A marker of another namespace, or of a gc that wrote no
    namespace (before the field), is left to its lease."""
    try:
        words = bytes(store.storage.read(key, limit=512)).decode("ascii", "replace").split()
    except ShardstoreError:
        return False
    host, ns, _pid = _owner()
    if len(words) != 4 or words[0] != "gc" or words[1] != host or not words[2].isdigit() or words[3] != str(ns):
        return False
    return _gone(int(words[2]))


_INTENT_NAME = re.compile(r"[cp]-[0-9a-f]{32}-([0-9]{1,10})-([0-9]{1,20})-([0-9a-f]{16})")


def dead_intents(store: Store) -> list[str]:
    """The intents (keys) whose writer was a process of this host and pid namespace that no
    longer exists: it can never move the ref its intent announced, so gc drops them before
    it marks. Intents of other hosts or namespaces, and those named without their writer
    (before the field), are never judged here."""
    host, ns, _pid = _owner()
    tag = _host_tag(host)
    dead = []
    for key in store.storage.list(INTENTS):
        m = _INTENT_NAME.fullmatch(key.rsplit("/", 1)[-1])
        if m and m.group(3) == tag and m.group(2) == str(ns) and _gone(int(m.group(1))):
            dead.append(key)
    return dead


def intent_objects(store: Store, skip: frozenset[str] = frozenset()) -> tuple[list[str], set[str]]:
    """(the commits intents name, the objects pin intents name), leaving out the intents
    ``skip`` names (dead writers'); refuses (typed) if one does not parse."""
    commits: list[str] = []
    objects: set[str] = set()
    for key in store.storage.list(INTENTS):
        if key in skip:
            continue
        try:
            raw = bytes(store.storage.read(key, limit=MAX_MANIFEST_BYTES))
        except ShardstoreError as e:
            if not store.storage.exists(key):
                continue  # its writer finished
            raise type(e)(f"gc refused: intent {key} is unreadable, so what it keeps is unknown: {e}") from None
        ids = decode_manifest(raw, PinManifest, what=f"intent {key}").objects
        name = key.rsplit("/", 1)[-1]
        (commits.extend if name.startswith("c-") else objects.update)(ids)
    return commits, objects


class GcMarker:
    """gc's flag (module docstring): written before gc reads anything, refreshed while it
    sweeps, deleted after its last delete. ``check()`` before each delete keeps the lease."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.key = f"{MARKERS}/{secrets.token_hex(16)}"
        self._lock = threading.Lock()
        store.storage.write_once(self.key, _marker_text())
        self._refreshed = time.monotonic()

    def check(self) -> None:
        """Refresh the marker if due; GcRace (stop deleting) if it could not be kept fresh."""
        with self._lock:
            since = time.monotonic() - self._refreshed
            if since < REFRESH_SECONDS:
                return
            if since >= STALE_SECONDS / 2:
                raise GcRace(f"gc stopped: its marker {self.key} went {since:.0f} s without a refresh, so writers may "
                             f"have taken it for a dead gc's (SPEC.md §19b); run gc again")
            self._touch()

    def renew_before_sweep(self) -> bool:
        """Refresh the marker if it is due (whatever its age); True if so, and then gc marks
        again: a writer may have taken a long-unrefreshed marker for a dead gc's and moved a
        ref, which that new marking pass (its intent, or the ref) sees."""
        with self._lock:
            if time.monotonic() - self._refreshed < REFRESH_SECONDS:
                return False
            self._touch()
            return True

    def _touch(self) -> None:
        touch = getattr(self.store.storage, "touch", None)
        if touch is None or touch(self.key) is None:
            raise GcRace(f"gc stopped: its marker {self.key} could not be refreshed (removed?); run gc again")
        self._refreshed = time.monotonic()

    def close(self) -> None:
        self.store.storage.delete(self.key)
