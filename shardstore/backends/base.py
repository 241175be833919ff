"""The narrow storage protocol the store needs (SPEC.md §Storage).

``Storage`` is the whole surface the store uses: read, size, exists, create-only write,
compare-and-swap, delete, list, modification time, and a durability barrier. Keys are
'/'-separated relative names built by the store from validated parts and checked again
here (``check_key``) before they become a path or URL.

Optional fast paths a backend may also offer, each a Protocol of its own that the store
tests with ``isinstance``; it uses each one when present and falls back to ``read`` plus
hashing otherwise (the results are the same):
- ``StreamedReads.read_into(key, out, consume) -> size``: fill ``out`` only if the object has
  exactly ``len(out)`` bytes, calling ``consume`` on each chunk in order as it lands;
- ``HashedReads.hash_object(key, hasher, *, threads) -> (hex digest, size)``: stream the
  object through ``hasher()`` (which runs ``threads`` threads of its own) without holding it
  whole; ``HashedReads.read_hashed(key, hasher, limit=None) -> (bytes, hex digest)``: read
  and hash in one pass, refusing (ObjectTooLarge) an object over ``limit`` bytes before
  allocating it;
- ``HashedReadsInto.read_into_hashed(key, out) -> (size, hex digest)``: ``read_into`` that
  hashes what it put in ``out`` itself and returns the digest, for a backend that must know it
  (``TieredStorage`` verifies a tier's copy before handing it on): the store then compares that
  digest with the id instead of hashing the bytes a second time;
- ``ReadsAhead.read_ahead(key)``: start fetching an object that is about to be read, without
  waiting for it (local files: the kernel's readahead), so that a reader hashing one object has
  the next ones' bytes on their way; advisory only, it never fails;
- ``BatchedWrites.begin_write`` / ``end_writes``: batched create-only writes with one
  durability barrier;
- ``PipedReads.read_piped(key, start) -> size``: hand an object's bytes to a consumer piece by
  piece as they arrive, never holding it whole (S3: each response body as it streams in);
- ``StreamedWrites.open_write(key) -> PendingWrite | None``: a ``BatchedWrites`` object written
  piece by piece into its temporary file (a copy from a ``PipedReads`` source, hashed on the
  way), then handed to ``end_writes`` like ``begin_write``'s;
- ``ListedSizes.sizes(keys) -> {key: size}``: which of many keys are present, and their
  sizes, in fewer requests than a ``size`` each (S3: listings instead of a HEAD per key), and
  ``refresh(key, size)``: ``touch`` of a key found so, without asking its size again;
- ``CachesWrites.keep_named(key, data)``: a backend with a write-through cache above it (a
  memory tier, ``TieredStorage``) keeps an object its writer names without writing (another
  writer of the same commit wrote it, SPEC.md §15) as if it had written it; nothing is sent
  to the store.

Backends (each its own module of this package; ``location.open_storage`` picks one by URL):
- ``LocalStorage`` (``backends.local``): a directory, crash-safe; restores read straight into tensors.
- ``S3Storage`` (``backends.s3``): conditional writes through s3fs's client.
- ``FsspecStorage`` (``backends.fsspec``): any fsspec filesystem (``memory://`` here).
- ``TieredStorage`` (``backends.tiers``): any of these with a memory tier and peers' copies
  above it for object reads, each copy verified against its id (SPEC.md §19.3).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "BatchedWrites",
    "Buffer",
    "CachesWrites",
    "HashedReads",
    "HashedReadsInto",
    "ListedSizes",
    "PendingWrite",
    "PipedReads",
    "ReadsAhead",
    "Storage",
    "StreamedReads",
    "StreamedWrites",
    "show_ref_value",
]

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class Storage(Protocol):
    """Everything the store asks of a backend. Implementations must make ``write_once``
    create-only and ``swap`` a true compare-and-swap."""

    url: str

    def read(self, key: str, limit: int | None = None) -> Buffer:
        """The bytes at ``key``; ObjectNotFound if absent; ObjectTooLarge if they are more than
        ``limit`` bytes, refused before allocating them (SPEC.md §Limits)."""
        ...

    def size(self, key: str) -> int | None:
        """The byte size at ``key``, or None if absent."""
        ...

    def exists(self, key: str) -> bool: ...

    def write_once(self, key: str, data: Buffer) -> bool:
        """Create ``key`` holding ``data`` unless it exists. True if this call wrote it."""
        ...

    def swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        """Set ``key`` to ``new`` if it currently holds ``expected`` (None: absent); else RefConflict."""
        ...

    def delete(self, key: str) -> None: ...

    def delete_if(self, key: str, expected: bytes) -> None:
        """Delete ``key`` if it currently holds exactly ``expected``; else RefConflict (absent
        included). The delete of a ref or pin: a plain look-then-delete would remove a value
        another writer swapped in between (SPEC.md §Refs)."""
        ...

    def list(self, prefix: str) -> Iterator[str]:
        """Keys under the directory ``prefix`` (recursive), relative to the store root."""
        ...

    def mtime(self, key: str) -> float | None:
        """Modification time (seconds since the epoch), or None if absent."""
        ...

    def touch(self, key: str) -> int | None:
        """Make the object at ``key`` young again (its ``mtime`` becomes now) and return its
        byte size, or None if it is absent. Every writer that relies on an object already
        present calls this first, so that gc's grace period protects it exactly as if the
        writer had written it (SPEC.md §19.1); ``write_once`` does the same when it finds
        ``key`` present."""
        ...

    def sync(self) -> None:
        """Make every completed ``write_once`` durable before anything references it."""
        ...


@runtime_checkable
class HashedReads(Protocol):
    """A backend's optional fast path for reads that verify: it hashes while the bytes stream
    in, so the store never reads an object twice (local files, S3)."""

    def read_hashed(self, key: str, hasher: Callable[[], Any], limit: int | None = None) -> tuple[Buffer, str]:
        """The bytes at ``key`` (into memory of their own) and the hex digest of ``hasher()``
        fed with them; ObjectTooLarge past ``limit``, before allocating."""
        ...

    def hash_object(self, key: str, hasher: Callable[[], Any], *, threads: int = 1) -> tuple[str, int]:
        """(hex digest of ``hasher()`` fed with the bytes at ``key``, their size), streamed
        without holding the object in memory (verify)."""
        ...


@runtime_checkable
class StreamedReads(Protocol):
    """A backend's optional fast path for restores: it reads an object straight into the
    caller's buffer (a tensor's own memory), handing each piece to ``consume`` (the hasher)."""

    def read_into(self, key: str, out: memoryview, consume: Callable[[memoryview], None] | None = None) -> int:
        """Read the bytes at ``key`` into ``out``; return the object's size (a size other than
        ``len(out)`` is returned without reading, for the caller to refuse)."""
        ...


@runtime_checkable
class HashedReadsInto(Protocol):
    """A backend's optional fast path for restores that verify: it fills the caller's buffer and
    hashes the bytes it put there, once, so that every byte is hashed exactly once on its way in."""

    def read_into_hashed(self, key: str, out: memoryview) -> tuple[int, str]:
        """Read the bytes at ``key`` into ``out`` and return (their size, the BLAKE3 hex digest of
        the bytes now in ``out``); a size other than ``len(out)`` is returned with an empty digest,
        without reading, for the caller to refuse."""
        ...


@runtime_checkable
class ReadsAhead(Protocol):
    """A backend's optional fast path for restores of many objects: a reader names the objects it
    will read next, and the backend starts fetching them while the reader hashes the current one
    (one reading thread then keeps the device busy, as a long sequential read does)."""

    def read_ahead(self, key: str) -> None:
        """Start fetching the bytes at ``key`` and return at once; nothing if it cannot (a missing
        object: the read that follows says so). Never raises, never changes what a read returns."""
        ...


@runtime_checkable
class BatchedWrites(Protocol):
    """A backend's optional fast path for saves of many objects (local files): each object is
    written to a temporary file with writeback started, and the batch is made durable with one
    barrier and then linked into place, the crash ordering of ``write_once`` + ``sync``."""

    def begin_write(self, key: str, data: Buffer) -> str | None:
        """Write ``data`` for ``key`` to a temporary file; its path (or a token standing for an
        unnamed one, held open until ``end_writes`` or ``discard_writes``), or None if ``key`` exists."""
        ...

    def end_writes(self, pending: list[tuple[str, str]], *, threads: int = 2) -> list[bool]:
        """Make the (key, temporary path) files durable, then link each into place, and make
        the links durable too (``threads`` waits at a time); per key, True if this batch created
        it. Every temporary file of ``pending`` is gone when this returns or raises."""
        ...

    def discard_writes(self, pending: list[tuple[str, str]]) -> None:
        """Remove the temporary files of ``pending`` unlinked (a failed batch): nothing of them
        is ever visible, and an unnamed one's descriptor is closed."""
        ...


@runtime_checkable
class PipedReads(Protocol):
    """A backend's optional fast path for copies: an object's bytes go to a consumer piece by
    piece as they arrive, never held whole (S3: each response body as it streams in, so that a
    copy hashes and writes each piece while it is still in the core's cache)."""

    def read_piped(self, key: str, start: Callable[[int], Callable[[Buffer], None]]) -> int:
        """Hand the bytes at ``key`` to a consumer, in order; return their size. ``start(size)`` is
        called once the object's size is known and returns the consumer; it is called again if a
        failed attempt is retried from the beginning (the caller then starts over: what the last
        consumer was given is void). The consumer may run on the backend's event loop: it must
        be short (hash, write to a local file) and never wait on that loop."""
        ...


class PendingWrite(Protocol):
    """An object being written piece by piece to a temporary file (``StreamedWrites.open_write``),
    not visible under its key until the batch it joins is made durable and linked."""

    def write(self, piece: Buffer) -> None:
        """Append ``piece`` (StorageError if the file system refuses it)."""
        ...

    def restart(self) -> None:
        """Drop everything written so far (a retried read starts again from its first byte)."""
        ...

    def close(self) -> str:
        """Finish the file (writeback started, not waited for) and return its temporary path
        (or token), for ``BatchedWrites.end_writes``."""
        ...

    def discard(self) -> None:
        """Close and remove the temporary file; nothing of it is ever visible."""
        ...


@runtime_checkable
class StreamedWrites(Protocol):
    """A ``BatchedWrites`` backend that also takes an object piece by piece (local files): a copy
    from a ``PipedReads`` source writes each piece as it arrives instead of the whole object
    once it has arrived in memory."""

    def open_write(self, key: str) -> PendingWrite | None:
        """A new temporary file for ``key``'s bytes; None if ``key`` exists (refreshed, as by
        ``begin_write``)."""
        ...


@runtime_checkable
class ListedSizes(Protocol):
    """A backend's optional fast path for presence checks of many objects at once (the gc
    fence's check of a commit's closure, copy's look at the destination): on S3 a HEAD per
    object is a round trip each, a listing page answers for up to a thousand keys."""

    def sizes(self, keys: list[str]) -> dict[str, int]:
        """The byte sizes of those of ``keys`` that are present; an absent key is left out. As
        current as ``size`` of each key would be."""
        ...

    def refresh(self, key: str, size: int) -> bool:
        """``touch`` of a key ``sizes`` just found present with ``size`` bytes, without asking its
        size again; False if it is gone."""
        ...


@runtime_checkable
class CachesWrites(Protocol):
    """A backend with a cache of what its writer writes (write-through: ``TieredStorage``'s memory
    tier), which must also hold the objects the writer names without writing them: those another
    writer of the same commit wrote and made durable (SPEC.md §15, §19.3: the model config, RNG
    objects alike on every slot), so that the cache holds its slot's closure whole."""

    def keep_named(self, key: str, data: Buffer) -> None:
        """Keep ``data`` (the bytes of the object at ``key``, hashed to its name by the caller) in
        the cache as if written; no request to the store; a cache that cannot take it is no error."""
        ...


def show_ref_value(value: bytes | None) -> str:
    """How a ref's raw value reads in a RefConflict message."""
    return "no ref" if value is None else repr(value.decode("ascii", "replace").strip())
