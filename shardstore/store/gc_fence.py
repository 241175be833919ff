"""The fence between gc and the writers that move refs and pins (SPEC.md §19.1, §19.2).

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
machine that shares the host name, or of a container, and never one that exists but
cannot be inspected — and ignores any marker that has *aged out*: its last sign of life,
the later of the creation time it records and its modification time (gc refreshes it at
least every ``REFRESH_SECONDS``), is ``STALE_SECONDS`` old by the writer's clock. So a dead
gc's marker stalls ref moves once, until it ages out, not each writer for its own
``STALE_SECONDS`` (a writer also stops waiting for a marker it has itself seen unchanged
for that long, whatever the clocks say). gc stops deleting if it could not refresh its
marker for ``STALE_SECONDS / 2`` (the one timing assumption, as in any lease, with the
clocks of the hosts sharing a store agreeing within that). A writer that waits says so
(a ``GcWait`` warning naming each marker, its holder and age, after ``NOTICE_SECONDS`` and
every ``NOTICE_EVERY`` seconds after), and raises ``GcRace`` without moving the ref after
``WAIT_SECONDS``. ``gc_markers`` lists the markers present (``verify`` and ``refs`` report
them) and ``break_gc_marker`` removes one unless its holder is alive.
An intent's key names its writer the same way (pid, start time, boot id, pid namespace,
a tag of the host name): gc removes, before it marks, the intents whose writer is dead
(it can never move the ref its intent announced); any other intent left by a writer that
crashed keeps its commit like a pin until it is removed (``intents/`` is safe to empty
when no writer runs).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from ..backends.base import Storage
from ..backends.holders import MAX_RECORD, check_holder, holder_state, process_state, this_process
from ..errors import GcRace, ObjectNotFound, ShardstoreError, TargetNotFound
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
    "GcWait",
    "MarkerInfo",
    "gc_markers",
    "break_gc_marker",
    "intent_objects",
    "dead_intents",
    "STALE_SECONDS",
    "REFRESH_SECONDS",
    "WAIT_SECONDS",
    "NOTICE_SECONDS",
    "NOTICE_EVERY",
]

INTENTS = "intents"
MARKERS = "gc"
#: A gc marker whose last sign of life (recorded creation time, modification time) is this old belongs to a gc that died.
STALE_SECONDS = 600.0
#: gc refreshes its marker at least this often while it runs.
REFRESH_SECONDS = 30.0
#: The longest a writer waits for running gcs before it gives up (GcRace, ref not moved).
WAIT_SECONDS = 3600.0
#: A writer that has waited this long for gcs says what it waits for (``GcWait``) ...
NOTICE_SECONDS = 2.0
#: ... and says it again this often while it still waits.
NOTICE_EVERY = 60.0
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
                f"written, or a gc removed them while they were being written (SPEC.md §19.2); the ref or pin was not moved"
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
    if commit is None:  # a pin: what it names, and the closure of each commit among them (SPEC.md §14.1)
        ids = sorted(set(objects).union(*(_pinned_closure(store, oid) for oid in set(objects))))
    elif objects:
        ids = sorted(set(objects) | {commit})
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


def _pinned_closure(store: Store, oid: str) -> set[str]:
    """The closure of ``oid`` if it is a commit (a pinned commit keeps its whole closure, as gc
    keeps it), else nothing more. Only an object small enough to be a manifest is read, bounded;
    GcRace if it is a commit whose shard manifests a gc already took."""
    size = store.object_size(oid)
    if size is None or size > MAX_MANIFEST_BYTES:
        return set()  # absent (the presence check names it) or too large to be a commit
    try:
        return set(commit_closure(_read(store, oid)).ids())
    except ObjectNotFound as e:  # a commit, but a shard manifest of it is gone
        raise GcRace(f"pinned commit {oid} in {store.url} no longer loads ({e}); the pin was not moved") from None
    except ShardstoreError:
        return set()  # not a commit: a pin may name any object


@dataclass(frozen=True)
class MarkerInfo:
    """A gc marker as a reader found it (``gc_markers``): whose it is, and how old by the
    reader's clock (seconds since the epoch throughout)."""

    key: str  # gc/<nonce>
    holder: dict[str, Any] | None  # the gc's holder record; None: an older gc's text, or text that does not parse
    created: float | None  # the creation time it records (the gc's clock); None: an older gc's marker
    refreshed: float  # its modification time: the gc's last refresh
    state: str  # its holder judged from here (backends.holders): "alive", "dead" or "unknown"
    seen_at: float  # the reader's clock when it read the marker

    @property
    def nonce(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def age(self) -> float | None:
        """Seconds since the gc wrote it (None if it records no time)."""
        return None if self.created is None else self.seen_at - self.created

    @property
    def idle(self) -> float:
        """Seconds since its last sign of life: the later of its recorded time and its modification time."""
        return self.seen_at - max(self.refreshed, self.created if self.created is not None else -math.inf)

    @property
    def stale(self) -> bool:
        """Aged out: no sign of life for ``STALE_SECONDS``, so its gc stopped deleting long ago or died."""
        return self.idle >= STALE_SECONDS

    @property
    def blocks(self) -> bool:
        """Whether ref moves and pin changes wait for it: neither dead nor aged out."""
        return self.state != "dead" and not self.stale

    def describe(self) -> str:
        """One phrase for messages: whose marker, how old, what a writer makes of it."""
        if self.holder is None:
            who = "an older gc (no holder recorded)"
        else:
            judged = {"alive": "still running", "dead": "gone"}.get(self.state, "cannot be checked from here")
            who = f"gc process {self.holder['pid']} on host {self.holder['host']!r} ({judged})"
        age = "" if self.age is None else f", written {self.age:.0f} s ago"
        verdict = (
            "; a dead gc's: ignored"
            if self.state == "dead"
            else "; aged out: ignored"
            if self.stale
            else f"; ages out in {STALE_SECONDS - self.idle:.0f} s unless refreshed"
        )
        return f"{self.key}: {who}{age}, last refreshed {self.idle:.0f} s ago{verdict}"


def _marker_doc(raw: bytes) -> tuple[dict[str, Any] | None, float | None]:
    """(holder, creation time) a marker's bytes record: ``gc {"created": T, "holder": {...}}``
    (this version), ``gc {holder record}`` (no time), or neither (an older gc's ``gc <host> <pid>``,
    anything else)."""
    if not raw.startswith(b"gc ") or len(raw) > _MAX_MARKER:
        return None, None
    try:
        doc = json.loads(raw[3:])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, None
    if not (isinstance(doc, dict) and set(doc) == {"created", "holder"}):
        return check_holder(doc), None
    created = doc["created"]
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        return check_holder(doc["holder"]), None
    try:
        when = float(created)
    except OverflowError:
        return check_holder(doc["holder"]), None
    return check_holder(doc["holder"]), when if math.isfinite(when) else None


_MAX_MARKER = MAX_RECORD + 64  # a holder record and the creation time around it


def _read_marker(store: Store, key: str, raw: bytes | None = None) -> tuple[MarkerInfo | None, bytes | None]:
    """The marker at ``key`` (None if it is gone) and its bytes (a marker is written once: a
    caller that polls passes them back as ``raw``, and only its time is read again)."""
    if raw is None:
        try:
            raw = bytes(store.storage.read(key, limit=_MAX_MARKER))
        except ObjectNotFound:
            return None, None
        except ShardstoreError:
            raw = b""  # unreadable or too long: a marker of nobody known, left to its age
    mtime = store.storage.mtime(key)
    if mtime is None:
        return None, None  # gone: that gc finished
    holder, created = _marker_doc(raw)
    info = MarkerInfo(key, holder, created, mtime, holder_state(holder), time.time())
    return info, raw


def gc_markers(store: Store) -> list[MarkerInfo]:
    """The gc markers present (``verify`` and ``refs`` report them): each running gc's, and any
    a gc that died left behind."""
    found = []
    for key in sorted(store.storage.list(MARKERS)):
        info, _ = _read_marker(store, key)
        if info is not None:
            found.append(info)
    return found


def break_gc_marker(store: Store, nonce: str) -> MarkerInfo:
    """Remove marker ``gc/<nonce>`` (``shardstore gc STORE --break-marker NONCE``) unless its holder
    is alive on this host, the rule of ``refs --break-lock``; return it as it was.
    ``TargetNotFound`` if there is no such marker."""
    key = f"{MARKERS}/{nonce.removeprefix(MARKERS + '/')}"
    if key not in set(store.storage.list(MARKERS)):  # only a name the store lists becomes a key
        raise TargetNotFound(f"no gc marker {nonce!r} in {store.url} (`shardstore refs STORE` lists them)")
    info, _ = _read_marker(store, key)
    if info is None:
        raise TargetNotFound(f"gc marker {key} in {store.url} is gone: its gc finished")
    if info.state == "alive":
        raise GcRace(f"{info.describe()}; not removing a running gc's marker (SPEC.md §19.2)")
    store.storage.delete(key)
    return info


class GcWait(UserWarning):
    """A ref move or pin change waiting for running gcs (the gc fence, SPEC.md §19.2): ``markers``
    are what it waits for, ``waited`` the seconds so far. The library warns; the command lines
    print it on stderr."""

    def __init__(self, message: str, *, store: str, markers: tuple[MarkerInfo, ...], waited: float) -> None:
        super().__init__(message)
        self.store = store
        self.markers = markers
        self.waited = waited


def _notice(store: Store, live: list[MarkerInfo], waited: float) -> None:
    nonce = live[0].nonce
    warnings.warn(
        GcWait(
            f"waiting {waited:.0f} s for {len(live)} gc marker(s) in {store.url} before moving a ref or pin "
            f"(SPEC.md §19.2): " + "; ".join(m.describe() for m in live) + f". If that gc is gone, "
            f"`shardstore gc STORE --break-marker {nonce}` removes its marker",
            store=store.url,
            markers=tuple(live),
            waited=waited,
        ),
        stacklevel=2,
    )


def _wait_for_no_gc(store: Store) -> None:
    """Return once no gc marker blocks (``MarkerInfo.blocks``, and not seen unchanged for
    ``STALE_SECONDS`` here); say what it waits for (``GcWait``); GcRace after ``WAIT_SECONDS``."""
    seen: dict[str, tuple[float, float, bytes]] = {}  # marker -> (its mtime, when first seen so, its bytes)
    start = time.monotonic()
    notice = start + NOTICE_SECONDS
    while True:
        now = time.monotonic()
        live = []
        for key in store.storage.list(MARKERS):
            info, raw = _read_marker(store, key, seen[key][2] if key in seen else None)
            if info is None or raw is None or not info.blocks:
                continue  # gone (that gc finished), dead (its process on this host is no more), or aged out
            old = seen.get(key)
            if old is None or old[0] != info.refreshed:
                seen[key] = (info.refreshed, now, raw)
            if now - seen[key][1] < STALE_SECONDS:
                live.append(info)
        if not live:
            return
        if now - start > WAIT_SECONDS:
            raise GcRace(
                f"gc has held {store.url} for over {WAIT_SECONDS:.0f} s ({live[0].describe()}); "
                f"the ref or pin was not moved"
            )
        if now >= notice:
            _notice(store, live, now - start)
            notice = now + NOTICE_EVERY
        time.sleep(_POLL_SECONDS)


def _host_tag(host: str) -> str:
    """16 hex digits naming a host name in a key (a host name may hold any character)."""
    return hashlib.blake2b(host.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()


def _owner_suffix() -> str:
    """``-<pid>-<start>-<boot>-<ns>-<host>`` naming this process in an intent's key (SPEC.md
    §19.2: boot id as 32 hex digits, pid namespace as its number, a tag of the host name), or
    "" where it cannot be named so (no /proc): such an intent is never judged dead."""
    me = this_process()
    boot, ns = (me["boot"] or "").replace("-", ""), (me["pidns"] or "").removeprefix("pid:[").removesuffix("]")
    m = _OWNER.fullmatch(f"{me['pid']}-{me['start']}-{boot}-{ns}-{_host_tag(me['host'])}")
    return "-" + m.group(0) if m else ""


def _marker_text() -> bytes:
    """A gc marker's text: ``gc`` and one JSON line, this process's holder record
    (``backends.holders``) and the time it was written (seconds since the epoch; unhashed
    store metadata, read only to tell how old the marker is)."""
    doc = {"created": round(time.time(), 3), "holder": this_process()}
    return b"gc " + json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


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
                    f"have taken it for a dead gc's (SPEC.md §19.2); run gc again"
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
