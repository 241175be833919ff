"""Tiers above a durable backend: object reads served from memory, then peers, then the store
(SPEC.md §19.3).

``TieredStorage`` is a ``Storage`` like the others, chosen above them: everything but object
reads goes to the durable backend (the record: refs, pins, the config, every write), and an
object read asks each tier in order (``MemoryTier``: this host's copy; ``PeerCopies``:
copies a peer sent) before the durable backend. A tier's copy is used only if it hashes to
the object's id; one that does not is set aside, named (``rejected``), and the next tier
asked, so a corrupt copy costs a read from the store, never a wrong byte. Objects written,
and objects read from the durable store and verified, are also kept in the ``fill`` tier
(write-through, read-allocate), so that the first tier holds what this process last wrote or
read from the store; a copy a peer sent is never kept there (its buddy's tier holds it
already, and the slot's next commit writes its own bytes through: SPEC.md §19.3).
``read_bytes`` counts the bytes of objects read from each tier (``memory``, ``peers``,
``store``), each object once, under the tier that first served it: after a restore the three
add up to the bytes of the distinct objects it needed.

Every byte is hashed exactly once on its way into a caller's tensor: ``read_into_hashed``
(the ``HashedReadsInto`` fast path the store uses for restores) hashes a tier's copy before
handing it on and returns that digest, which the store compares with the id instead of hashing
again; a copy read from the durable backend is hashed as it lands, and that one digest both
verifies it and decides whether it is kept in the fill tier. A tier that can read a copy into
a buffer it is given (``StagedCopies``: the memory tier's files) reads it straight into the
caller's buffer, hashing each chunk while it is in cache (one copy, no memory of its own); a
copy that fails there is overwritten by the next tier's or the store's before the read
returns, so none of its bytes is handed on. A copy this process verified as it arrived from a
peer and has held in its own memory since (``VerifiedReads``) is read into the caller's buffer
unhashed; a read waiting for a peer's copy still on its way is handed it from the buffer it was
verified in (``PeerCopies.deliver``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from ..errors import InvalidName, ShardstoreError
from ..format.names import check_oid
from ..format.tensors import hash_bytes, new_hasher
from .base import BatchedWrites, Buffer, HashedReads, ReadsAhead, Storage, StreamedReads

__all__ = ["CopyTier", "PeerCopies", "StagedCopies", "TieredStorage", "TIER_NAMES", "VerifiedCopies", "VerifiedReads"]

#: The most bytes of peers' copies ``PeerCopies`` holds at once that no read has asked for yet
#: (they landed ahead of the restore's reads). The restore reads copies in the order they are
#: sent (``format.grid.run_reads``), so few land ahead: 48 MiB at most in
#: ``bench_peer_recovery`` (a 512 MiB slot). A restore that reads other objects first (its own
#: tier's, the store's) could otherwise find its whole slot held in memory; past this bound a
#: copy is not kept, and its read goes on to the store (counted there).
MAX_HELD_BYTES = 256 << 20

#: The tiers a read is counted under, in the order they are asked.
TIER_NAMES = ("memory", "peers", "store")


class CopyTier(Protocol):
    """A tier above the store: copies of some objects, each hashed to its id before it is used
    (by the reader, or as it arrived where the tier is ``VerifiedCopies``)."""

    name: str  # "memory" or "peers": what its reads are counted under

    def fetch(self, oid: str) -> Buffer | None:
        """The tier's bytes of ``oid``, or None if it holds none."""
        ...

    def where(self, oid: str) -> str:
        """Where this tier's copy of ``oid`` came from (a directory, a peer), for messages."""
        ...


@runtime_checkable
class VerifiedCopies(Protocol):
    """A tier's optional mark: copies this process hashed to their ids itself as they arrived,
    held in its own memory since (nothing else can have changed them), so the reader does not
    hash them again."""

    def verified(self, oid: str) -> bool:
        """Whether this tier's copy of ``oid`` was verified against ``oid`` when it was added."""
        ...


@runtime_checkable
class VerifiedReads(Protocol):
    """A tier's optional fast path: a copy this process verified against its id as it arrived
    and has kept unchanged since, read straight into the reader's buffer (no hashing again)."""

    def read_verified_into(self, oid: str, out: memoryview) -> int | None:
        """Read the verified copy of ``oid`` into ``out`` if it has exactly ``len(out)`` bytes;
        its size, or None if the tier holds no such copy now."""
        ...


@runtime_checkable
class StagedCopies(Protocol):
    """A tier's optional fast path: its copy of an object read into a buffer the reader gives."""

    def fetch_into(self, oid: str, out: memoryview, consume: Callable[[memoryview], None] | None = None) -> int | None:
        """Read this tier's copy of ``oid`` into ``out`` if it has exactly ``len(out)`` bytes,
        handing each chunk to ``consume`` right after it lands (hash it there); return its size
        (another size: nothing read), or None if the tier holds no readable copy."""
        ...


class PeerCopies:
    """Objects a peer sent (``checkpoint.replicas``), held in this process's memory until the
    restore that asked for them has read them (or is done); each remembers the slot that sent it,
    and whether it was verified against its id as it arrived (``fetch_replicas`` hashes each
    object while the next message travels, so the restore only copies it). None of them is
    written to a memory tier (SPEC.md §19.3: its buddy's tier holds it, and the slot's next commit
    writes its own bytes through).

    A restore may run while the copies arrive: the objects ``expect``ed are coming, and a read of
    one of them waits until it has landed (``add``), was ``refused``, or the exchange is over
    (``done``); it then reads whatever the tiers have, the store last. A read waiting for a copy
    (``read_verified_into``) leaves its buffer here, and the exchange copies the bytes it has just
    verified straight into it from its receive buffer (``deliver``) and keeps nothing of them. A
    verified copy no read was waiting for is held here until a read copies it into its buffer
    (``read_verified_into``), then let go: the memory held is what landed ahead of the restore's
    reads, not the slot. ``arrival`` says in which order the copies are coming, so that a restore
    can ask for them in that order (``format.grid.run_reads``) and be waiting for each as it
    lands. At most ``max_held`` bytes of verified copies are held ahead of their reads
    (``MAX_HELD_BYTES``): one past it is not kept (``add``), and its read goes to the store."""

    name = "peers"

    def __init__(self, *, pending: bool = False, max_held: int = MAX_HELD_BYTES) -> None:
        self._objects: dict[str, tuple[Buffer, int, bool]] = {}
        self._coming: set[str] = set()
        self._order: dict[str, int] = {}  # each expected object's place in the order they are sent
        self._waiting: dict[str, list[_Waiting]] = {}  # reads waiting for a copy, with their buffers
        self._handed: dict[str, int] = {}  # copies handed to reads (and let go), and from which peer
        self.held_peak = 0  # the most bytes of verified copies held here at once (landed before a read asked)
        self.max_held = max_held
        self.dropped = 0  # bytes of verified copies not kept: holding them would have passed ``max_held``
        self._held = 0
        self._arrival = threading.Condition()
        # pending: an exchange will say what is coming; every read waits until it has (or is over)
        self._told = threading.Event()
        if not pending:
            self._told.set()

    def expect(self, oids: Iterable[str]) -> None:
        """``oids`` are on their way, in this order: a read of one waits for it."""
        with self._arrival:
            for oid in oids:
                self._coming.add(oid)
                self._order.setdefault(oid, len(self._order))
        self._told.set()

    def arrival(self, oid: str) -> int | None:
        """``oid``'s place in the order the copies are sent (None: not expected); never waits."""
        return self._order.get(oid)

    def deliver(self, oid: str, data: memoryview, peer: int) -> int:
        """The exchange has just hashed ``data`` (from ``peer``) to ``oid``: copy it into the
        buffer of each read waiting for ``oid`` now (of ``len(data)`` bytes) and let those reads
        return; the number of reads served. Only verified bytes may be handed here. A copy handed
        over has landed: this tier keeps nothing of it (``data`` is the exchange's to reuse), and
        no tier keeps it either (``TieredStorage`` never keeps a peer's copy)."""
        with self._arrival:  # no read starts waiting for it meanwhile (one that comes later reads the tiers)
            return self._serve(oid, data, peer)

    def _serve(self, oid: str, data: Buffer, peer: int) -> int:
        """``deliver``'s work, with ``_arrival`` held by the caller."""
        served = 0
        for w in self._waiting.get(oid, ()):
            if len(w.out) == len(data):
                w.out[:] = data  # a waiting read's own buffer: nothing else writes it until it returns
                w.filled = True
                served += 1
        if served:
            self._handed[oid] = peer
            self._coming.discard(oid)
            self._arrival.notify_all()
        return served

    def _landed(self, oid: str) -> None:
        with self._arrival:
            self._coming.discard(oid)
            self._arrival.notify_all()

    def refused(self, oid: str) -> None:
        """``oid``'s copy arrived wrong and was not kept: a read waiting for it goes on."""
        self._landed(oid)

    def done(self) -> None:
        """The exchange is over (or failed): nothing more is coming."""
        with self._arrival:
            self._coming.clear()
            self._arrival.notify_all()
        self._told.set()

    def _wait(self, oid: str) -> None:
        self._told.wait()
        if oid in self._coming:  # most reads: not (or no longer) coming, no lock taken
            with self._arrival:
                while oid in self._coming:
                    self._arrival.wait()

    def __contains__(self, oid: str) -> bool:
        """Whether a copy of ``oid`` has landed (held, or handed to the reads it served; never waits)."""
        return oid in self._objects or oid in self._handed

    def holds_or_expects(self, oid: str) -> bool:
        """Whether a copy of ``oid`` has landed or is on its way (never waits)."""
        return oid in self or oid in self._coming

    def add(self, oid: str, data: Buffer, peer: int, *, verified: bool = False, copy: bool = False) -> bool:
        """Keep ``data`` as ``oid``'s copy from ``peer``; ``verified``: the caller hashed exactly
        these bytes to ``oid`` and hands over the only reference to them (held until a read
        copies it into its buffer); ``copy``: keep a copy of them instead (``data`` is the
        caller's to reuse). A verified copy a read is waiting for is handed to it (``deliver``)
        and not held. False, keeping nothing, when a verified copy no read waits for would take
        the bytes held past ``max_held``: the read of ``oid`` then goes on to the next tier."""
        check_oid(oid)
        with self._arrival:
            # a read may have begun waiting since the caller's ``deliver`` found none: it takes the
            # copy now, under the same lock, rather than find it dropped (past the bound) and go to
            # the store for bytes verified here, or wake to copy it out of a held copy
            if verified and self._serve(oid, data, peer):
                return True
            kept = not verified or self._held + len(data) <= self.max_held
            if kept:
                self._objects[oid] = (bytearray(data) if copy else data, peer, verified)
                self._held += len(data) if verified else 0
                self.held_peak = max(self.held_peak, self._held)
            else:
                self.dropped += len(data)
        self._landed(oid)
        return kept

    def verified(self, oid: str) -> bool:
        self._wait(oid)
        got = self._objects.get(oid)
        return got is not None and got[2]

    def read_verified_into(self, oid: str, out: memoryview) -> int | None:
        """``VerifiedReads``: a verified copy of ``oid`` put in ``out`` if it has ``len(out)``
        bytes, and then let go (a restore reads each object into its buffer once:
        ``format.grid.run_reads`` reads the blocks of one object once); None otherwise. A copy
        still on its way is waited for with ``out`` left here, which the exchange fills from the
        bytes it verified (``deliver``) as soon as they have landed."""
        self._told.wait()
        if oid in self._coming:
            w = _Waiting(out)
            with self._arrival:
                if oid in self._coming:
                    self._waiting.setdefault(oid, []).append(w)
                    try:
                        while oid in self._coming and not w.filled:
                            self._arrival.wait()
                    finally:
                        self._waiting[oid].remove(w)
                        if not self._waiting[oid]:
                            del self._waiting[oid]
            if w.filled:
                return len(out)
        got = self._objects.get(oid)
        if got is None or not got[2] or len(got[0]) != len(out):
            return None
        out[:] = memoryview(got[0]).cast("B")
        with self._arrival:
            if self._objects.pop(oid, None) is not None:
                self._held -= len(got[0])
                self._handed[oid] = got[1]
        return len(out)

    def fetch(self, oid: str) -> Buffer | None:
        """The copy of ``oid`` held in memory (kept: a manifest is read more than once), else None."""
        self._wait(oid)
        got = self._objects.get(oid)
        return None if got is None else got[0]

    def where(self, oid: str) -> str:
        if oid in self._objects:
            return f"peer slot {self._objects[oid][1]}"
        if oid in self._handed:
            return f"peer slot {self._handed[oid]}"
        return "a peer"

    def __len__(self) -> int:
        return len(self._objects)

    def nbytes(self) -> int:
        """Bytes of the copies held now."""
        return sum(len(d) for d, _, _ in self._objects.values())

    def clear(self) -> None:
        self.done()
        with self._arrival:
            self._objects.clear()
            self._held = 0
        self._handed.clear()
        self._order.clear()


class _Waiting:
    """A read waiting for a peer's copy: its buffer, and whether the exchange has filled it."""

    __slots__ = ("out", "filled")

    def __init__(self, out: memoryview) -> None:
        self.out = out
        self.filled = False


def _serves(tier: CopyTier, oid: str) -> bool:
    """Whether ``tier`` holds a copy of ``oid`` or has one on its way (never waits, never reads)."""
    if isinstance(tier, PeerCopies):
        return tier.holds_or_expects(oid)
    has = getattr(tier, "has", None)
    return bool(has is not None and has(oid))


def _object_id(key: str) -> str | None:
    """The object id ``key`` names (``objects/<id[:2]>/<id>``), or None for any other key."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "objects":
        return None
    try:
        return check_oid(parts[2])
    except InvalidName:
        return None


class _Fill(Protocol):
    def put(self, oid: str, data: Buffer) -> None: ...


class TieredStorage:
    """The durable backend ``durable`` with ``tiers`` above it for object reads (module docstring)."""

    def __init__(self, durable: Storage, tiers: Sequence[CopyTier] = (), *, fill: _Fill | None = None) -> None:
        self.durable = durable
        self.url = durable.url
        self.tiers = list(tiers)
        self.fill = fill
        self.read_bytes = dict.fromkeys(TIER_NAMES, 0)
        self.rejected: list[str] = []  # copies set aside: what, where, and why
        self._counted: set[str] = set()  # objects already counted (a manifest is read several times)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TieredStorage({self.durable!r}, {[t.name for t in self.tiers]})"

    # -- accounting ---------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Bytes of objects read from each tier so far (a copy)."""
        with self._lock:
            return dict(self.read_bytes)

    def _count(self, tier: str, oid: str, n: int) -> None:
        with self._lock:
            if oid not in self._counted:
                self._counted.add(oid)
                self.read_bytes[tier] = self.read_bytes.get(tier, 0) + n

    def _reject(self, tier: CopyTier, oid: str, why: str) -> None:
        """Set a copy aside, naming where it came from; a tier that can drop it does (so that the
        verified copy read next takes its place)."""
        with self._lock:
            self.rejected.append(f"object {oid}: the copy from {tier.where(oid)} {why}; not used")
        discard = getattr(tier, "discard", None)
        if discard is not None:
            discard(oid)

    def _keep_from(self, tier: CopyTier, oid: str, data: Buffer) -> None:
        """``_keep`` a copy ``tier`` served, unless it is the fill tier's own or a peer's: a memory
        tier on another host (its buddy's replica) holds a peer's copy already, and the slot's next
        commit writes every object of its closure through from its own bytes (SPEC.md §19.3), so a
        copy kept here would be written to fresh memory on the restore's path only to be replaced
        by that commit."""
        if tier is self.fill or isinstance(tier, PeerCopies):
            return
        self._keep(oid, data)

    def _keep(self, oid: str, data: Buffer) -> None:
        """Keep a verified copy in the fill tier; a cache that cannot take it is no error."""
        if self.fill is not None:
            try:
                self.fill.put(oid, data)
            except (ShardstoreError, OSError):
                pass

    # -- object reads, tier by tier -----------------------------------------------------

    def _verified(self, tier: CopyTier, oid: str, data: Buffer, size: int | None, limit: int | None) -> bool:
        """Whether ``data``, ``tier``'s copy of ``oid``, may be used: it has ``size`` bytes (if
        given), at most ``limit``, and hashes to ``oid``; a copy that fails is rejected, named."""
        if size is not None and len(data) != size:
            self._reject(tier, oid, f"has {len(data)} bytes, not the {size} its reader expects")
            return False
        if limit is not None and len(data) > limit:
            self._reject(tier, oid, f"has {len(data)} bytes, over its reader's limit of {limit}")
            return False
        if isinstance(tier, VerifiedCopies) and tier.verified(oid):
            return True  # hashed to its id as it arrived, in this process's memory since
        got = hash_bytes(data)
        if got != oid:
            self._reject(tier, oid, f"does not hash to its id (its bytes hash to {got})")
            return False
        return True

    def _copy(self, oid: str, size: int | None, limit: int | None) -> tuple[CopyTier, Buffer] | None:
        """The first tier's copy of ``oid`` that hashes to it (and, if given, has ``size`` bytes,
        at most ``limit``), in memory of its own; copies that do not are rejected, naming where
        they came from."""
        for tier in self._ordered(oid):
            data = tier.fetch(oid)
            if data is None or not self._verified(tier, oid, data, size, limit):
                continue
            self._keep_from(tier, oid, data)
            return tier, data
        return None

    def _ordered(self, oid: str) -> list[CopyTier]:
        """The tiers to ask for ``oid``: one holding a copy this process verified as it arrived, or
        a peer tier with a copy on its way, first (the object's bytes, already checked, so the
        cheapest), then the rest in their order."""
        first = [
            t
            for t in self.tiers
            if (isinstance(t, PeerCopies) and t.arrival(oid) is not None)  # coming or come: never waits
            or (isinstance(t, VerifiedCopies) and t.verified(oid))
        ]
        return first + [t for t in self.tiers if t not in first] if first else self.tiers

    def _copy_into(self, oid: str, out: memoryview) -> CopyTier | None:
        """Fill ``out`` from the first tier whose copy of ``oid`` has ``len(out)`` bytes and hashes
        to it, verified before a byte of it is copied into ``out``; None if no tier has one. A copy
        verified as it arrived is taken first (``_ordered``), read straight into ``out``."""
        for tier in self._ordered(oid):
            if isinstance(tier, VerifiedReads) and tier.read_verified_into(oid, out) == len(out):
                self._keep_from(tier, oid, out)
                return tier
            if isinstance(tier, StagedCopies):
                # read straight into the reader's buffer and hashed there, chunk by chunk while in
                # cache: one copy; a copy that fails is overwritten by the next tier's (or the
                # store's) before this read returns, so no byte of it is handed on
                h = new_hasher()
                n = tier.fetch_into(oid, out, h.update)
                if n is None:
                    continue
                if n != len(out):
                    self._reject(tier, oid, f"has {n} bytes, not the {len(out)} its reader expects")
                    continue
                got_id = h.hexdigest()
                if got_id != oid:
                    self._reject(tier, oid, f"does not hash to its id (its bytes hash to {got_id})")
                    continue
            else:
                got = tier.fetch(oid)
                if got is None or not self._verified(tier, oid, got, len(out), None):
                    continue
                out[:] = memoryview(got).cast("B")
            self._keep_from(tier, oid, out)
            return tier
        return None

    def read(self, key: str, limit: int | None = None) -> Buffer:
        oid = _object_id(key)
        if oid is not None:
            got = self._copy(oid, None, limit)
            if got is not None:
                self._count(got[0].name, oid, len(got[1]))
                return got[1]
        data = self.durable.read(key, limit=limit)
        if oid is not None:
            self._count("store", oid, len(data))
        return data

    def read_hashed(self, key: str, hasher: Callable[[], Any], limit: int | None = None) -> tuple[Buffer, str]:
        oid = _object_id(key)
        if oid is not None:
            got = self._copy(oid, None, limit)
            if got is not None:
                self._count(got[0].name, oid, len(got[1]))
                return got[1], oid
        if isinstance(self.durable, HashedReads):
            data, digest = self.durable.read_hashed(key, hasher, limit)
        else:
            data = self.durable.read(key, limit=limit)
            h = hasher()
            h.update(data)
            digest = h.hexdigest()
        if oid is not None:
            self._count("store", oid, len(data))
            if digest == oid:
                self._keep(oid, data)
        return data, str(digest)

    def read_into_hashed(self, key: str, out: memoryview) -> tuple[int, str]:
        """Fill ``out`` when the object has exactly ``len(out)`` bytes (the ``HashedReadsInto``
        fast path), from the first tier with a verified copy, else from the durable backend;
        return its size and the digest of the bytes now in ``out``, each byte hashed once."""
        oid = _object_id(key)
        if oid is not None:
            tier = self._copy_into(oid, out)
            if tier is not None:
                self._count(tier.name, oid, len(out))
                return len(out), oid  # the digest _copy_into just compared with the id
        if isinstance(self.durable, StreamedReads):
            h = new_hasher()
            n = self.durable.read_into(key, out, h.update)
            if n != len(out):
                return n, ""
            digest = h.hexdigest()
        else:
            data = self.durable.read(key)
            n = len(data)
            if n != len(out):
                return n, ""
            out[:] = memoryview(data).cast("B")
            digest = hash_bytes(out)
        if oid is not None:
            self._count("store", oid, n)
            if digest == oid:
                self._keep(oid, out)
        return n, digest

    def read_into(self, key: str, out: memoryview, consume: Callable[[memoryview], None] | None = None) -> int:
        """Fill ``out`` when the object has exactly ``len(out)`` bytes (the ``StreamedReads`` fast
        path), as ``read_into_hashed`` does, and hand ``out`` to ``consume`` once filled. The
        store uses ``read_into_hashed``, which spares it this second pass."""
        n, _ = self.read_into_hashed(key, out)
        if n == len(out) and consume is not None:
            consume(out)
        return n

    def arrival(self, key: str) -> int | None:
        """The object's place in the order a peer tier's copies are coming (``PeerCopies.arrival``);
        None for any other key or object. Never waits."""
        oid = _object_id(key)
        if oid is None:
            return None
        places = [p for t in self.tiers if isinstance(t, PeerCopies) and (p := t.arrival(oid)) is not None]
        return min(places) if places else None

    def read_ahead(self, key: str) -> None:
        """The durable backend's ``ReadsAhead`` for an object no tier can serve; nothing for one a
        tier holds or a peer is sending (the store's copy will not be read: asking the disk for it
        only cost the restore CPU and I/O). Advisory, as ever: a read still asks every tier in order."""
        oid = _object_id(key)
        if oid is not None and any(_serves(t, oid) for t in self.tiers):
            return
        if isinstance(self.durable, ReadsAhead):
            self.durable.read_ahead(key)

    # -- everything else is the durable backend's -----------------------------------------

    def size(self, key: str) -> int | None:
        return self.durable.size(key)

    def exists(self, key: str) -> bool:
        return self.durable.exists(key)

    def write_once(self, key: str, data: Buffer) -> bool:
        wrote = self.durable.write_once(key, data)
        oid = _object_id(key)
        if oid is not None:
            self._keep(oid, data)  # the store hashed it to name it: write-through
        return wrote

    def keep_named(self, key: str, data: Buffer) -> None:
        """An object another writer of the commit wrote, named by this one without writing it
        (``base.CachesWrites``): kept in the fill tier as ``write_once`` keeps a write
        (write-through); nothing reaches the durable backend."""
        oid = _object_id(key)
        if oid is not None:
            self._keep(oid, data)

    def begin_write(self, key: str, data: Buffer) -> str | None:
        """The durable backend's batched write when it has one (a plain ``write_once`` otherwise),
        with the object kept in the fill tier now: ``data`` may be reused once this returns."""
        oid = _object_id(key)
        if oid is not None:
            self._keep(oid, data)
        if not isinstance(self.durable, BatchedWrites):
            self.durable.write_once(key, data)
            return None
        return self.durable.begin_write(key, data)

    def end_writes(self, pending: list[tuple[str, str]], *, threads: int = 2) -> list[bool]:
        if not isinstance(self.durable, BatchedWrites):
            return []
        return self.durable.end_writes(pending, threads=threads)

    def discard_writes(self, pending: list[tuple[str, str]]) -> None:
        if isinstance(self.durable, BatchedWrites):
            self.durable.discard_writes(pending)

    def swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        self.durable.swap(key, expected, new)

    def delete(self, key: str) -> None:
        self.durable.delete(key)

    def delete_if(self, key: str, expected: bytes) -> None:
        self.durable.delete_if(key, expected)

    def list(self, prefix: str) -> Iterator[str]:
        return self.durable.list(prefix)

    def mtime(self, key: str) -> float | None:
        return self.durable.mtime(key)

    def touch(self, key: str) -> int | None:
        return self.durable.touch(key)

    def sync(self) -> None:
        self.durable.sync()

    def __getattr__(self, name: str) -> Any:
        # Optional fast paths and backend specifics (hash_object, delete_stale, root, ...) are the
        # durable backend's: verify and gc judge the record, never a cache.
        if name.startswith("__") or name in ("durable", "tiers", "fill"):
            raise AttributeError(name)
        return getattr(self.durable, name)
