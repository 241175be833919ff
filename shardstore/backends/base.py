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
- ``BatchedWrites.begin_write`` / ``end_writes``: batched create-only writes with one
  durability barrier.

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

__all__ = ["BatchedWrites", "Buffer", "HashedReads", "Storage", "StreamedReads", "show_ref_value"]

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
class BatchedWrites(Protocol):
    """A backend's optional fast path for saves of many objects (local files): each object is
    written to a temporary file with writeback started, and the batch is made durable with one
    barrier and then linked into place, the crash ordering of ``write_once`` + ``sync``."""

    def begin_write(self, key: str, data: Buffer) -> str | None:
        """Write ``data`` for ``key`` to a temporary file; its path, or None if ``key`` exists."""
        ...

    def end_writes(self, pending: list[tuple[str, str]], *, threads: int = 2) -> list[bool]:
        """Make the (key, temporary path) files durable, then link each into place, and make
        the links durable too (``threads`` waits at a time); per key, True if this batch created it."""
        ...


def show_ref_value(value: bytes | None) -> str:
    """How a ref's raw value reads in a RefConflict message."""
    return "no ref" if value is None else repr(value.decode("ascii", "replace").strip())
