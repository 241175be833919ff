"""Garbage collection: delete objects no ref can reach, never one a save may still need (SPEC.md §Store layout).

*Reachable* objects: every commit a ref or a pin names, its parents that are present
(recursively; an absent parent ends the walk, as a copy brings no history), and each of
those commits' closures (shard manifests, model config, tensor, moment and RNG objects),
plus every other object a pin names (the object only; SPEC.md §14.1). Anything
else is garbage, with two exceptions that protect saves in progress,
whose objects are written before any ref names them:

- an object younger than the grace period (its ``Storage.mtime``) is never deleted;
- an object that a young commit or shard manifest names is never deleted, however old:
  a save that found the object already present (content addressing deduplicates) has
  not rewritten it, so its age says nothing about whether the save needs it.

The order is: write the gc marker, drop the intents of writers of this host that no longer
run (``gc_fence.dead_intents``: they can never move a ref), take the time every age is
measured against, list the objects, then mark from the pins, intents and refs — twice, the second pass walking only
what moved — then sweep, then delete the marker (SPEC.md §19.1). Objects written after the
listing are not candidates. gc is conservative: a ref that names a missing commit, a pin
or intent that does not parse, a pinned commit whose closure does not read, or a present
commit or shard manifest that does not decode, stops it before anything is deleted, because its reachability cannot be known.
A save that finds an old unreachable object already present (content addressing skips
the write) refreshes its mtime, so gc sees it as young; gc also re-reads each object's
mtime as it deletes it (locally: after renaming it away, so no refresh falls between).

Whatever the grace period, a ref or pin never names an object gc deleted: every ref move
and pin change goes through the gc fence (``gc_fence``: an intent, a wait while a gc
marker is live, a presence check, then the compare-and-swap), so a writer either is seen
by gc's marking or finds what gc took and refuses (GcRace). What the grace period still
decides is a save *in progress* — objects written that no commit a ref, pin or intent
names yet: at grace 0 such a save can fail, never corrupt a ref.

Stale ``tmp/`` files (a local store's interrupted writes, an S3 store's probe keys) older
than the grace period and than ``TMP_MIN_AGE`` are removed too. Running gc twice in a row deletes nothing the
second time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import ObjectNotFound, ShardstoreError
from ..format.grid import payload_blocks
from ..format.manifest import MAX_MANIFEST_BYTES, CommitManifest, ShardManifest, decode, tensor_payloads
from ..state.extras import extra_objects
from ..state.torch_optim import state_objects
from ..store import Store, object_key
from ..store.gc_fence import GcMarker, dead_intents, intent_objects
from ..verification.commits import load_commit, pinned_commits
from .transfer import commit_closure, pool_map

__all__ = ["GcResult", "reachable", "pinned_objects", "gc", "TMP_MIN_AGE"]

#: A file under ``tmp/`` is a write in flight until it is this old, whatever the grace period:
#: deleting it would only fail that write (it is never part of a commit).
TMP_MIN_AGE = 900.0


@dataclass
class GcResult:
    """What ``gc`` deleted (or, in a dry run, would delete), and what it kept and why."""

    dry_run: bool
    grace_seconds: float
    commits: list[str] = field(default_factory=list)
    reachable_objects: int = 0
    pinned_objects: int = 0
    deleted: dict[str, int] = field(default_factory=dict)
    kept_young: list[str] = field(default_factory=list)
    kept_named_by_young: list[str] = field(default_factory=list)
    tmp_deleted: list[str] = field(default_factory=list)
    intents_dropped: list[str] = field(default_factory=list)  # dead writers' intents (gc_fence.dead_intents)

    @property
    def bytes_freed(self) -> int:
        return sum(self.deleted.values())


def _pins(store: Store) -> dict[str, tuple[str, ...]]:
    """Every pin and its ids; refuses (typed) if a pin does not parse."""
    try:
        return store.pins()
    except ShardstoreError as e:
        raise type(e)(f"gc refused: a pin is unreadable, so what it keeps is unknown: {e}") from None


def pinned_objects(store: Store) -> set[str]:
    """Every object id a pin names; refuses (typed) if a pin does not parse."""
    return {oid for ids in _pins(store).values() for oid in ids}


def reachable(
    store: Store,
    pinned: set[str] | None = None,
    *,
    also: Sequence[str] = (),
    known: tuple[set[str], list[str]] | None = None,
    held: Mapping[str, Sequence[str]] | None = None,
) -> tuple[set[str], list[str]]:
    """(every object id reachable from a ref or pin, the reachable commit ids in walk order).

    A commit a ref or pin names is walked with its closure and its present parents (SPEC.md
    §14.1, §19.1); any other pinned object is kept itself. ``pinned``: the pinned ids if
    already read, with ``held``, the commits among them and the pins naming each
    (``pinned_commits``); else the pins are read here. ``also``: more commits to walk
    (intents' commits; one that no longer loads is skipped: its writer will refuse).
    ``known``: a walk already done (objects, commits); only commits it has not seen are walked."""
    if pinned is None:
        pins = _pins(store)
        pinned = {oid for ids in pins.values() for oid in ids}
        held = pinned_commits(store, pins)
    held = held or {}
    objects: set[str] = set(known[0]) if known else set()
    commits: list[str] = list(known[1]) if known else []
    seen = set(commits)
    try:
        heads = store.refs()
    except ShardstoreError as e:
        raise type(e)(
            f"gc refused, nothing deleted: {e}; what it keeps is unknown (refs in {store.url}: {store.ref_names()})"
        ) from None
    named = set(heads.values()) | set(held)
    todo = sorted(set(heads.values())) + sorted(set(held) - set(heads.values())) + sorted(set(also) - named)
    intended = set(also) - named
    while todo:
        cid = todo.pop(0)
        if cid in seen:
            continue
        try:
            if not store.has(cid):
                raise ObjectNotFound(f"commit {cid} is missing from {store.url}")
            lc = load_commit(store, cid)
        except ShardstoreError as e:
            if cid in intended:
                continue  # an intent's commit that lost objects already: its writer will refuse (GcRace)
            by = f" (pinned by {', '.join(map(repr, held[cid]))})" if cid in held else ""
            raise type(e)(
                f"gc refused: commit {cid}{by} is reachable but unreadable, so its closure is unknown: {e}"
                + ("; copy it again (shardstore copy ... --with-deps) or remove the pin" if by else "")
            ) from None
        seen.add(cid)
        commits.append(cid)
        objects |= commit_closure(lc).ids()
        parent = lc.commit.parent
        if parent is not None and parent not in seen and store.has(parent):
            todo.append(parent)  # an absent parent ends the walk: a copy brings no history (SPEC.md §19.1)
    return objects | pinned, commits


def _marked(
    store: Store,
    known: tuple[set[str], list[str]] | None = None,
    dropped: frozenset[str] = frozenset(),
    kinds: dict[str, bool] | None = None,
) -> tuple[set[str], list[str], int]:
    """One marking pass: pins, then refs, then intents (SPEC.md §19.2), leaving out the
    ``dropped`` intents of dead writers; (kept ids, commits, pinned count). A commit a pin
    or a pin's intent names is walked like a ref's; ``kinds`` caches which pinned objects
    are commits across passes."""
    pins = _pins(store)
    pinned = {oid for ids in pins.values() for oid in ids}
    commits, objects = intent_objects(store, dropped)
    held = pinned_commits(store, pins, kinds)
    intended = list(pinned_commits(store, {"an intent": objects}, kinds))  # a pin being set to a commit
    keep, walked = reachable(store, pinned | objects, also=commits + intended, known=known, held=held)
    return keep, walked, len(pinned)


def _named_by_manifest(store: Store, oid: str) -> set[str]:
    """Ids a young object names if it is a commit or shard manifest; empty for anything else."""
    size = store.object_size(oid)
    if size is None or size > MAX_MANIFEST_BYTES:
        return set()
    try:
        manifest = decode(store.get(oid, limit=MAX_MANIFEST_BYTES), what=f"object {oid}")
    except ShardstoreError:
        return set()  # tensor bytes, or not a manifest: names nothing
    names: set[str] = set()
    if isinstance(manifest, CommitManifest):
        names |= {lay.shard for lay in manifest.layout}
        for sid in list(names):
            if store.has(sid):
                names |= _named_by_manifest(store, sid)
    if isinstance(manifest, (CommitManifest, ShardManifest)) and manifest.config is not None:
        names.add(manifest.config)
    if isinstance(manifest, (CommitManifest, ShardManifest)):
        names |= {x[0] for x in extra_objects(manifest.extras, "")}
    if isinstance(manifest, ShardManifest):
        names |= {r.object for r in manifest.rng}
        for e in manifest.entries:
            for _role, payload, dtype in tensor_payloads(e):
                names |= {oid for oid, _box, _n in payload_blocks(payload, dtype, e.shape)}
            names |= {oid for oid, _, _ in state_objects(e)}
    return names


def gc(
    store: Store,
    *,
    grace_seconds: float,
    dry_run: bool,
    threads: int = 8,
    progress: Callable[[int], None] | None = None,
) -> GcResult:
    """Delete (or with ``dry_run`` only report) unreachable objects older than ``grace_seconds``.

    Behind the gc fence (``gc_fence``; SPEC.md §19.2): the marker is written before anything
    is read and deleted after the last delete; a dry run writes nothing (it deletes nothing).
    ``progress(n)``: called as unreachable objects are examined, and again as they are deleted."""
    tick = progress or (lambda n: None)
    if not grace_seconds >= 0:  # NaN too: it compares as no grace at all
        raise ValueError(f"grace_seconds must be >= 0, not {grace_seconds}")
    marker = None if dry_run else GcMarker(store)
    try:
        return _gc(store, grace_seconds, dry_run, threads, marker, tick)
    finally:
        if marker is not None:
            marker.close()


def _gc(
    store: Store,
    grace_seconds: float,
    dry_run: bool,
    threads: int,
    marker: GcMarker | None,
    tick: Callable[[int], None],
) -> GcResult:
    # A dead writer's intent keeps nothing: that writer can never move the ref it announced
    # (gc_fence.dead_intents; a dry run only reports them).
    dropped = dead_intents(store)
    if not dry_run:
        for key in dropped:
            store.storage.delete(key)
    skip = frozenset(dropped)
    now = time.time()  # taken before the first listing or ref read: ages are measured against it
    cutoff = now - grace_seconds
    listed = sorted(store.objects())
    kinds: dict[str, bool] = {}  # which pinned objects are commits (an id's bytes never change)
    keep, commits, npinned = _marked(store, dropped=skip, kinds=kinds)
    # Look again (refs, pins and intents that moved while the first pass walked): a writer
    # behind the fence is kept by either pass; this one narrows what the sweep even tries.
    keep, commits, npinned = _marked(store, (keep, commits), skip, kinds)
    if marker is not None and marker.renew_before_sweep():  # marking took a while: look once more
        keep, commits, npinned = _marked(store, (keep, commits), skip, kinds)
    result = GcResult(dry_run, grace_seconds, commits, len(keep), npinned, intents_dropped=dropped)
    garbage = [oid for oid in listed if oid not in keep]

    def age(oid: str) -> tuple[str, float | None, int | None]:
        key = object_key(oid)
        mtime = store.storage.mtime(key)
        tick(1)
        return oid, None if mtime is None else now - mtime, store.storage.size(key)

    old: dict[str, int] = {}
    for oid, seconds, size in pool_map(age, garbage, threads):
        if seconds is None or size is None:
            continue  # gone since the listing
        if seconds < grace_seconds:
            result.kept_young.append(oid)
        else:
            old[oid] = size
    if grace_seconds > 0:
        named: set[str] = set()
        for oid in result.kept_young:
            named |= _named_by_manifest(store, oid)
        result.kept_named_by_young = sorted(named & set(old))
        for oid in result.kept_named_by_young:
            del old[oid]
    result.deleted = old
    if not dry_run:
        assert marker is not None
        stale = getattr(store.storage, "delete_stale", None)

        def delete(oid: str) -> bool:
            # Look again as it is deleted: a writer that found this object present since gc
            # began has refreshed its mtime (Store.ensure / write_once) past the cutoff.
            marker.check()
            key = object_key(oid)
            if stale is not None:  # local: rename away, then look (no window)
                return bool(stale(key, cutoff))
            mtime = store.storage.mtime(key)
            if mtime is None or mtime > cutoff:
                return False
            store.storage.delete(key)
            return True

        def deleted(oid: str) -> bool:
            gone = delete(oid)
            tick(1)
            return gone

        done = pool_map(deleted, sorted(old), threads)
        result.deleted = {oid: old[oid] for oid, gone in zip(sorted(old), done) if gone}
        result.kept_young += [oid for oid, gone in zip(sorted(old), done) if not gone]
    result.tmp_deleted = _clean_tmp(store, now, max(grace_seconds, TMP_MIN_AGE), dry_run)
    return result


def _clean_tmp(store: Store, now: float, grace_seconds: float, dry_run: bool) -> list[str]:
    stale = []
    for key in store.storage.list("tmp"):
        try:
            mtime = store.storage.mtime(key)
        except ShardstoreError:
            continue  # a name the store would never write; not ours to delete
        if mtime is not None and now - mtime >= grace_seconds:
            stale.append(key)
            if not dry_run:
                store.storage.delete(key)
    return stale
