"""The fence between gc and the writers that move refs and pins (SPEC.md §19a, §19b).

gc must never delete an object that a ref or pin names *as it stands when the object is
deleted*, at any grace period, including 0. Reading the refs once and deleting later
cannot promise that on its own: a writer may move a ref onto a commit gc judged garbage
in between. The fence is a two-flag handshake (Dekker's, over the store):

- a **writer** that moves a ref to commit C (or sets a pin) first writes an *intent*
  (``intents/c-<nonce>-<writer>`` naming C, ``intents/p-<nonce>-<writer>`` naming the pin's
  new objects),
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

Liveness: a gc that crashes leaves its marker. A writer ignores a marker whose holder
(``backends.holders``: host, boot id, pid namespace, pid and start time) is dead — a
process of its own host, boot and namespace that no longer exists; never one of another
machine that shares the host name, or of a container — and treats any marker whose
modification time has not changed for ``STALE_SECONDS`` of its own clock as abandoned;
gc refreshes its marker at least every ``REFRESH_SECONDS`` and stops deleting if it could
not refresh it for ``STALE_SECONDS / 2`` (the one timing assumption, as in any lease).
A writer that waits longer than ``WAIT_SECONDS`` raises ``GcRace`` without moving the ref.
An intent's key names its writer the same way (pid, start time, boot id, pid namespace,
a tag of the host name): gc removes, before it marks, the intents whose writer is dead
(it can never move the ref its intent announced); any other intent left by a writer that
crashed keeps its commit like a pin until it is removed (``intents/`` is safe to empty
when no writer runs).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from ..backends.base import Storage
from ..backends.holders import MAX_RECORD, holder_record, holder_state, process_state, read_holder, this_process
from ..errors import GcRace, ObjectNotFound, ShardstoreError
from ..format.closure import commit_closure
from ..format.manifest import (
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    CommitManifest,
    PinManifest,
    ShardManifest,
    decode_manifest,
    encode,
)
from ..format.names import check_oid


class Store(Protocol):
    """What the fence uses of the store (``store.Store`` is one; it calls the fence, so the
    fence names its role here instead of importing it)."""

    storage: Storage
    url: str

    def has(self, oid: str) -> bool: ...

    def commit(self, oid: str) -> CommitManifest: ...

    def shard(self, oid: str) -> ShardManifest: ...


__all__ = [
    "fenced_move",
    "GcMarker",
    "intent_objects",
    "dead_intents",
    "STALE_SECONDS",
    "REFRESH_SECONDS",
    "WAIT_SECONDS",
]

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


def fenced_move(
    store: Store, *, commit: str | None = None, objects: Sequence[str] = (), move: Callable[[], None]
) -> None:
    """Run ``move`` (a ref's or pin's compare-and-swap) behind the fence: intent, wait for no
    gc, presence check of what it will name, move, drop the intent (module docstring).

    ``commit``: a ref move, checking the commit's closure, or only ``objects`` if given (a slot
    copy holds its slot's closure); no ``commit``: a pin naming ``objects``."""
    kind, ids = (
        ("c", [commit]) if commit is not None else ("p", list(objects))
    )  # ``objects`` with a commit: what it needs
    key = f"{INTENTS}/{kind}-{secrets.token_hex(16)}{_owner_suffix()}"
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
    return _Commit(
        cid,
        commit,
        {lay.slot: store.shard(lay.shard) for lay in commit.layout},
        {lay.slot: lay.shard for lay in commit.layout},
    )


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
            raise GcRace(
                f"gc has held {store.url} for over {WAIT_SECONDS:.0f} s ({live[0]}); the ref or pin was not moved"
            )
        time.sleep(_POLL_SECONDS)


def _host_tag(host: str) -> str:
    """16 hex digits naming a host name in a key (a host name may hold any character)."""
    return hashlib.blake2b(host.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()


def _owner_suffix() -> str:
    """``-<pid>-<start>-<boot>-<ns>-<host>`` naming this process in an intent's key (SPEC.md
    §19b: boot id as 32 hex digits, pid namespace as its number, a tag of the host name), or
    "" where it cannot be named so (no /proc): such an intent is never judged dead."""
    me = this_process()
    boot, ns = (me["boot"] or "").replace("-", ""), (me["pidns"] or "").removeprefix("pid:[").removesuffix("]")
    m = _OWNER.fullmatch(f"{me['pid']}-{me['start']}-{boot}-{ns}-{_host_tag(me['host'])}")
    return "-" + m.group(0) if m else ""


def _marker_text() -> bytes:
    """A gc marker's text: ``gc`` and this process's holder record (``backends.holders``)."""
    return b"gc " + holder_record()


def _dead_here(store: Store, key: str) -> bool:
    """True if the marker's holder is dead (``backends.holders``: same host, boot and pid
    namespace, and no process of that pid and start time): a killed gc, so no gc can be
    deleting under it, and waiting out its lease would stall every commit. Any other
    marker (another machine, boot or namespace; an older gc's ``gc <host> <pid>``) is
    left to its lease."""
    try:
        raw = bytes(store.storage.read(key, limit=MAX_RECORD + 3))
    except ShardstoreError:
        return False
    return raw.startswith(b"gc ") and holder_state(read_holder(raw[3:])) == "dead"


_OWNER = re.compile(r"([0-9]{1,7})-([0-9]{1,20})-([0-9a-f]{32})-([0-9]{1,10})-([0-9a-f]{16})")
_INTENT_NAME = re.compile(r"[cp]-[0-9a-f]{32}-(" + _OWNER.pattern + ")")


def dead_intents(store: Store) -> list[str]:
    """The intents (keys) whose writer is dead (``backends.holders``: this host, boot and pid
    namespace, and no process of that pid and start time): it can never move the ref its
    intent announced, so gc drops them before it marks. Intents of other machines, boots or
    namespaces, of running writers, and those named without their writer are kept."""
    tag = _host_tag(this_process()["host"])
    dead = []
    for key in store.storage.list(INTENTS):
        m = _INTENT_NAME.fullmatch(key.rsplit("/", 1)[-1])
        if m is None or m.group(6) != tag:
            continue
        pid, start, boot, ns = int(m.group(2)), m.group(3), m.group(4), m.group(5)
        boot_id = f"{boot[:8]}-{boot[8:12]}-{boot[12:16]}-{boot[16:20]}-{boot[20:]}"
        if process_state(boot_id, f"pid:[{ns}]", pid, start) == "dead":
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
                raise GcRace(
                    f"gc stopped: its marker {self.key} went {since:.0f} s without a refresh, so writers may "
                    f"have taken it for a dead gc's (SPEC.md §19b); run gc again"
                )
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
