"""The narrow storage protocol the store needs (SPEC.md §Storage).

``Storage`` is the whole surface the store uses: read, size, exists, create-only write,
compare-and-swap, delete, list, modification time, and a durability barrier. Keys are
'/'-separated relative names built by the store from validated parts and checked again
here (``check_key``) before they become a path or URL.

Optional fast paths a backend may also offer; the store uses each one when present and
falls back to ``read`` plus hashing otherwise (the results are the same):
- ``read_into(key, out, consume) -> size``: fill ``out`` only if the object has exactly
  ``len(out)`` bytes, calling ``consume`` on each chunk in order as it lands;
- ``hash_object(key, hasher, *, threads) -> (hex digest, size)``: stream the object through
  ``hasher()`` (which runs ``threads`` threads of its own) without holding it whole;
- ``read_hashed(key, hasher, limit=None) -> (bytes, hex digest)``: read and hash in one pass,
  refusing (ObjectTooLarge) an object over ``limit`` bytes before allocating it;
- ``begin_write`` / ``end_writes``: batched create-only writes with one durability barrier.

Backends (each its own module of this package; ``location.open_storage`` picks one by URL):
- ``LocalStorage`` (``backends.local``): a directory, crash-safe; restores read straight into tensors.
- ``S3Storage`` (``backends.s3``): conditional writes through s3fs's client.
- ``FsspecStorage`` (``backends.fsspec``): any fsspec filesystem (``memory://`` here).
- ``TieredStorage`` (``backends.tiers``): any of these with a memory tier and peers' copies
  above it for object reads, each copy verified against its id (SPEC.md §19c).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

__all__ = ["Buffer", "Storage", "show_ref_value"]

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class Storage(Protocol):
    """Everything the store asks of a backend. Implementations must make ``write_once``
    create-only and ``swap`` a true compare-and-swap."""

    url: str

    def read(self, key: str) -> Buffer:
        """The bytes at ``key``; ObjectNotFound if absent. Backends may take ``limit=`` too:
        ObjectTooLarge past it, before allocating (the store passes it when accepted)."""
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
        writer had written it (SPEC.md §19a); ``write_once`` does the same when it finds
        ``key`` present."""
        ...

    def sync(self) -> None:
        """Make every completed ``write_once`` durable before anything references it."""
        ...


def show_ref_value(value: bytes | None) -> str:
    """How a ref's raw value reads in a RefConflict message."""
    return "no ref" if value is None else repr(value.decode("ascii", "replace").strip())
