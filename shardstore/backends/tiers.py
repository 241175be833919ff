"""Tiers above a durable backend: object reads served from memory, then peers, then the store
(SPEC.md §19.3).

``TieredStorage`` is a ``Storage`` like the others, chosen above them: everything but object
reads goes to the durable backend (the record: refs, pins, the config, every write), and an
object read asks each tier in order (``MemoryTier``: this host's copy; ``PeerCopies``:
copies a peer sent) before the durable backend. A tier's copy is used only if it hashes to
the object's id; one that does not is set aside, named (``rejected``), and the next tier
asked, so a corrupt copy costs a read from the store, never a wrong byte. Objects written,
and objects read from below the first tier and verified, are also kept in the ``fill`` tier
(write-through, read-allocate), so that the first tier holds what this process last wrote
or read. ``read_bytes`` counts the bytes of objects read from each tier (``memory``,
``peers``, ``store``), each object once, under the tier that first served it: after a restore
the three add up to the bytes of the distinct objects it needed.

Verification costs one hash of a tier's copy before it is handed on, and the store hashes
what it receives again (the ``Storage`` protocol gives it no way to know the bytes were
checked); a copy read from the durable backend is hashed once more only to decide whether to
keep it in the fill tier.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from ..errors import InvalidName, ShardstoreError
from ..format.names import check_oid
from ..format.tensors import hash_bytes, new_hasher
from .base import BatchedWrites, Buffer, HashedReads, Storage, StreamedReads

__all__ = ["CopyTier", "PeerCopies", "TieredStorage", "TIER_NAMES"]

#: The tiers a read is counted under, in the order they are asked.
TIER_NAMES = ("memory", "peers", "store")


class CopyTier(Protocol):
    """A tier above the store: copies of some objects, unverified until a reader hashes them."""

    name: str  # "memory" or "peers": what its reads are counted under

    def fetch(self, oid: str) -> Buffer | None:
        """The tier's bytes of ``oid``, or None if it holds none."""
        ...

    def where(self, oid: str) -> str:
        """Where this tier's copy of ``oid`` came from (a directory, a peer), for messages."""
        ...


class PeerCopies:
    """Objects a peer sent (``checkpoint.replicas``), held in this process's memory until the
    restore that asked for them is done; each remembers the slot that sent it."""

    name = "peers"

    def __init__(self) -> None:
        self._objects: dict[str, tuple[Buffer, int]] = {}

    def add(self, oid: str, data: Buffer, peer: int) -> None:
        self._objects[check_oid(oid)] = (data, peer)

    def fetch(self, oid: str) -> Buffer | None:
        got = self._objects.get(oid)
        return None if got is None else got[0]

    def where(self, oid: str) -> str:
        got = self._objects.get(oid)
        return "a peer" if got is None else f"peer slot {got[1]}"

    def __len__(self) -> int:
        return len(self._objects)

    def nbytes(self) -> int:
        return sum(len(d) for d, _ in self._objects.values())

    def clear(self) -> None:
        self._objects.clear()


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

    def _keep(self, oid: str, data: Buffer) -> None:
        """Keep a verified copy in the fill tier; a cache that cannot take it is no error."""
        if self.fill is not None:
            try:
                self.fill.put(oid, data)
            except (ShardstoreError, OSError):
                pass

    # -- object reads, tier by tier -----------------------------------------------------

    def _copy(self, oid: str, size: int | None, limit: int | None) -> tuple[CopyTier, Buffer] | None:
        """The first tier's copy of ``oid`` that hashes to it (and, if given, has ``size`` bytes,
        at most ``limit``); copies that do not are rejected, naming where they came from."""
        for tier in self.tiers:
            data = tier.fetch(oid)
            if data is None:
                continue
            if size is not None and len(data) != size:
                self._reject(tier, oid, f"has {len(data)} bytes, not the {size} its reader expects")
                continue
            if limit is not None and len(data) > limit:
                self._reject(tier, oid, f"has {len(data)} bytes, over its reader's limit of {limit}")
                continue
            got = hash_bytes(data)
            if got != oid:
                self._reject(tier, oid, f"does not hash to its id (its bytes hash to {got})")
                continue
            if tier is not self.fill:
                self._keep(oid, data)
            return tier, data
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

    def read_into(self, key: str, out: memoryview, consume: Callable[[memoryview], None] | None = None) -> int:
        """Fill ``out`` when the object has exactly ``len(out)`` bytes (the ``Storage`` fast path),
        from the first tier with a verified copy, else from the durable backend."""
        oid = _object_id(key)
        if oid is not None:
            got = self._copy(oid, len(out), None)
            if got is not None:
                view = memoryview(got[1]).cast("B")
                out[:] = view
                if consume is not None:
                    consume(out)
                self._count(got[0].name, oid, len(out))
                return len(out)
        if not isinstance(self.durable, StreamedReads):
            data = self.durable.read(key)
            if oid is not None:
                self._count("store", oid, len(data))
            if len(data) != len(out):
                return len(data)
            out[:] = memoryview(data).cast("B")
            if consume is not None:
                consume(out)
            return len(out)
        h = new_hasher() if oid is not None and self.fill is not None else None

        def both(chunk: memoryview) -> None:
            if consume is not None:
                consume(chunk)
            if h is not None:
                h.update(chunk)

        n = self.durable.read_into(key, out, both)
        if oid is not None and n == len(out):
            self._count("store", oid, n)
            if h is not None and h.hexdigest() == oid:
                self._keep(oid, out)
        return n

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
