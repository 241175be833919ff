"""A worker's memory tier and peer replicas: where they live, how its stores use them, and what
happens when a commit lands (SPEC.md §19.3).

Each slot's tier is a directory under its host's tier root (``--memory-tier DIR``, or
``SLOT=DIR`` for one slot; by default a directory on ``/dev/shm`` named for the store). A
worker reads its start through ``reader`` (memory, then what its buddies sent, then the
store, each object verified) and commits through ``writer`` (every object it writes also
kept in its tier); once a commit is durable, ``landed`` holds it in the tier (evicting the
objects of older commits) and sends the slot's new objects to its buddies
(``shardstore.checkpoint.replicas``). The durable store stays the record: nothing here is
needed for a commit to be committed, and a tier that fails leaves the run reading the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch.distributed as dist

from shardstore import LoadedCommit, Store, load_commit
from shardstore.backends.memory_tier import MemoryTier, default_tier_root
from shardstore.backends.tiers import PeerCopies, TieredStorage
from shardstore.checkpoint.replicas import PeerFetch, ReplicaReport, replicate, start_fetch
from shardstore.errors import ShardstoreError
from shardstore.format.closure import commit_closure

__all__ = ["AUTO_TIER", "TierSpec", "RestoreBytes", "SlotTiers"]

#: ``memory_tier``'s default: a directory under ``/dev/shm`` named for the store.
AUTO_TIER = "auto"


@dataclass(frozen=True)
class TierSpec:
    """Where a run's tiers live and what they hold (``RunSpec``'s tier options, gathered)."""

    store: str  # the run's store URL: the default root is named for it
    root: str | None = AUTO_TIER  # every host's tier root; None with no `slots`: no memory tier (nor replicas)
    slots: tuple[tuple[int, str], ...] = ()  # (slot, root): that slot's host has a root of its own
    replicas: int | None = None  # buddies per slot; None: 1 with two or more workers
    keep: int = 1  # commits each tier holds

    @property
    def enabled(self) -> bool:
        return self.root is not None or bool(self.slots)

    def root_of(self, slot: int) -> str | None:
        """The tier root of ``slot``'s host (None: tiers are off for the whole run)."""
        if not self.enabled:
            return None
        own = dict(self.slots).get(slot)
        if own is not None:
            return own
        return default_tier_root(self.store) if self.root in (AUTO_TIER, None) else self.root

    def buddies(self, world: int) -> int:
        n = (1 if world >= 2 else 0) if self.replicas is None else self.replicas
        return max(0, min(n, world - 1))


class RestoreBytes(msgspec.Struct, frozen=True):
    """Bytes of objects a worker's restore read from each tier (its start commit's objects)."""

    memory: int = 0
    peers: int = 0
    store: int = 0


@dataclass
class SlotTiers:
    """One worker's memory tier (``own``), its host's tiers of other slots (the replicas it
    keeps), and what its restore and its commits' replication did."""

    spec: TierSpec
    slot: int
    world: int
    own: MemoryTier | None = None
    peers: PeerCopies = field(default_factory=PeerCopies)
    rejected: list[str] = field(default_factory=list)  # copies refused: the object, where from, why
    replication: ReplicaReport = field(default_factory=ReplicaReport)
    errors: list[str] = field(default_factory=list)  # replication that failed (the commit is durable anyway)
    _reader: TieredStorage | None = None
    _fetching: PeerFetch | None = None  # the start's exchange with its buddies, in flight
    _fetch_group: Any = None  # the group of its own that exchange runs on

    @classmethod
    def open(cls, spec: TierSpec, slot: int, world: int) -> SlotTiers:
        """Open this slot's tier (TierError if its directory cannot be used), clearing writes a
        killed worker left half done."""
        root = spec.root_of(slot)
        own = None if root is None else MemoryTier(root, slot, keep=spec.keep)
        if own is not None:
            own.clear_partial()
        return cls(spec, slot, world, own)

    def tier_for(self, slot: int) -> MemoryTier:
        """This host's tier of ``slot`` (where the replica of a slot this worker is buddy of goes)."""
        assert self.own is not None
        return MemoryTier(self.own.root, slot, keep=self.spec.keep)

    @property
    def replicas(self) -> int:
        return 0 if self.own is None else self.spec.buddies(self.world)

    @property
    def kept_commits(self) -> int:
        """Commits this worker's tier keeps (0: it has none)."""
        return 0 if self.own is None else self.spec.keep

    # -- the start ------------------------------------------------------------------------

    def fetch(self, commit: str) -> None:
        """Collective at a start from ``commit``: a worker whose tier does not hold it gets its
        slot's objects from its buddies (each verified against its id as it lands, and written
        to its tier; a wrong one is named in ``rejected`` and read from the store). The exchange
        runs in the background on a group of its own (the start's gates use the default group
        meanwhile): a worker whose tier holds the commit restores from it while it sends its
        buddies' copies, one that lacks it reads each copy as soon as it has landed (``reader``),
        and ``restored`` waits for the exchange's end."""
        if self.replicas == 0:
            return
        self._fetch_group = dist.new_group(backend=dist.get_backend())
        self._fetching = start_fetch(
            self._fetch_group,
            slot=self.slot,
            commit=commit,
            own=self.own,
            tier_for=self.tier_for,
            replicas=self.replicas,
        )

    def _fetched(self) -> None:
        """Wait for the start's exchange (if any is in flight) and take its copies and report."""
        if self._fetching is None:
            return
        fetching, self._fetching = self._fetching, None
        try:
            self.peers, report = fetching.wait()
        finally:
            dist.destroy_process_group(self._fetch_group)
            self._fetch_group = None
        self.rejected += report.rejected  # copies refused as they arrived, each naming its peer

    def reader(self, durable: Store) -> Store:
        """``durable`` with this worker's tiers above it (memory, then peers), every object
        read from the store kept in its own tier (a copy its buddies sent is not: their tier
        holds it, and its next commit writes it through; SPEC.md §19.3); a read of a copy its
        buddies are still sending waits for that copy alone."""
        if self._fetching is not None:
            self.peers = self._fetching.copies
        tiers = [] if self.own is None else [self.own, self.peers]  # no tier: the store's bytes still counted
        self._reader = TieredStorage(durable.storage, tiers, fill=self.own)
        return Store(self._reader, create=False)

    def restored(self, lc: LoadedCommit | None, same_layout: bool) -> RestoreBytes:
        """After the restore of ``lc``: hold it in the tier if every object of its slot's
        closure is there (a restore from the tier, or from the store, which fills it; not one
        that read peers' copies, which no tier keeps: its first commit fills the tier), drop the
        peers' copies, and return the bytes read from each tier (after the start's exchange with
        its buddies is over)."""
        self._fetched()
        got = RestoreBytes() if self._reader is None else RestoreBytes(**self._reader.counts())
        if self._reader is not None:
            self.rejected += self._reader.rejected
            self._reader.tiers = [self.own] if self.own is not None else []
        self.peers.clear()
        if lc is not None and same_layout and self.own is not None:
            try:
                ids = commit_closure(lc, slot=self.slot).ids()
                own = self.own
                if all(own.has(o) for o in ids):  # held only whole: held.json names no commit the tier lacks
                    own.hold(lc.id, ids)
            except (ShardstoreError, OSError) as e:
                self.errors.append(f"holding commit {lc.id[:12]} in {self.own.dir}: {e}")
        return got

    # -- commits ----------------------------------------------------------------------------

    def writer(self, durable: Store) -> Store:
        """``durable`` with every object written kept in this worker's tier (write-through)."""
        if self.own is None:
            return durable
        return Store(TieredStorage(durable.storage, [self.own], fill=self.own), create=False)

    def landed(self, store: Store, commit: str, group: Any = None) -> None:
        """Once ``commit`` is durable: hold it in this slot's tier and send the slot's new objects
        to its buddies (collective over ``group``: every worker, the same commit). A failure is
        recorded, never raised: the commit is committed whatever happens to its copies."""
        if self.own is None:
            return
        try:
            ids = commit_closure(load_commit(store, commit), slot=self.slot).ids()
            self.own.hold(commit, ids)
        except (ShardstoreError, OSError) as e:
            ids = set()
            self.errors.append(f"holding commit {commit[:12]} in {self.own.dir}: {e}")
        if self.replicas == 0:
            return
        try:
            report = replicate(
                group,
                slot=self.slot,
                commit=commit,
                objects=ids,
                own=self.own,
                tier_for=self.tier_for,
                replicas=self.replicas,
            )
        except Exception as e:  # noqa: BLE001 - a lost peer: the next step's pipeline says so
            self.errors.append(f"replicating commit {commit[:12]}: {type(e).__name__}: {e}")
            return
        self.replication.sent += report.sent
        self.replication.received += report.received
        self.rejected += report.rejected

    def held_bytes(self) -> tuple[int, int]:
        """Bytes this host's tiers hold now of this worker's slot, and of the slots it keeps replicas of."""
        if self.own is None:
            return 0, 0
        kept = {(self.slot - d) % self.world for d in range(1, self.replicas + 1)} - {self.slot}
        own, replicas = self._nbytes(self.own), 0
        for slot in sorted(kept):
            replicas += self._nbytes(self.tier_for(slot))
        return own, replicas

    @staticmethod
    def _nbytes(tier: MemoryTier) -> int:
        try:
            return tier.nbytes()
        except (ShardstoreError, OSError):
            return 0
