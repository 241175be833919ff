"""The narrow storage protocol the store needs, and its backends (SPEC.md §Storage).

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

Backends:
- ``LocalStorage`` (``shardstore.local``): a directory, crash-safe; restores read straight into tensors.
- ``S3Storage`` (``shardstore.s3``): conditional writes through s3fs's client.
- ``FsspecStorage``: any fsspec filesystem (``memory://`` here; S3 builds on it). Create-only
  and compare-and-swap are serialised by a process-local lock, which is exact for
  ``memory://`` (a process-local filesystem) and nothing more.
"""
from __future__ import annotations

import threading
from datetime import datetime, timezone
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import fsspec

from .errors import ObjectNotFound, ObjectTooLarge, RefConflict, StorageError
from .names import check_key

__all__ = ["Buffer", "Storage", "FsspecStorage", "open_storage", "show_ref_value"]

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


#: Bytes per write(2) on the batched path; also how often writeback is started.
def show_ref_value(value: bytes | None) -> str:
    """How a ref's raw value reads in a RefConflict message."""
    return "no ref" if value is None else repr(value.decode("ascii", "replace").strip())


class FsspecStorage:
    """A store on any fsspec filesystem (see module docstring for the atomicity caveat)."""

    _locks: dict[str, threading.Lock] = {}

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self._lock = FsspecStorage._locks.setdefault(url, threading.Lock())

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def read(self, key: str, limit: int | None = None) -> Buffer:
        if limit is not None:
            n = self.size(key)
            if n is not None and n > limit:
                raise ObjectTooLarge(f"{key} in store {self.url} is {n} bytes, over this reader's limit of {limit} (SPEC.md §Limits)")
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise ObjectNotFound(f"{key} is missing from store {self.url}") from None
        except OSError as e:
            raise StorageError(f"read {key!r} in store {self.url}: {e}") from None

    def size(self, key: str) -> int | None:
        try:
            return int(self.fs.size(self._path(key)))
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(key)))

    def mtime(self, key: str) -> float | None:
        try:
            return self.fs.modified(self._path(key)).timestamp()
        except FileNotFoundError:
            return None

    def touch(self, key: str) -> int | None:
        path = self._path(key)
        with self._lock:
            entry = getattr(self.fs, "store", {}).get(path)  # memory://: its file records carry the time
            if entry is not None and hasattr(entry, "modified"):
                entry.modified = datetime.now(tz=timezone.utc)
            try:
                return int(self.fs.size(path))
            except FileNotFoundError:
                return None

    def write_once(self, key: str, data: Buffer) -> bool:
        path = self._path(key)
        if self.touch(key) is not None:
            return False
        with self._lock:
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, bytes(data))
            return True

    def _check_current(self, key: str, path: str, expected: bytes | None) -> None:
        """RefConflict unless ``key`` holds ``expected`` (None: absent); the caller holds the lock."""
        try:
            current: bytes | None = self.fs.cat_file(path)
        except FileNotFoundError:
            current = None
        if current != expected:
            raise RefConflict(f"{key}: expected {show_ref_value(expected)}, found {show_ref_value(current)}")

    def swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        path = self._path(key)
        with self._lock:
            self._check_current(key, path, expected)
            self.fs.pipe_file(path, new)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def delete_if(self, key: str, expected: bytes) -> None:
        path = self._path(key)
        with self._lock:
            self._check_current(key, path, expected)
            self.fs.rm_file(path)

    def list(self, prefix: str) -> Iterator[str]:
        base = self._path(prefix)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return
        skip = len(self.root) + 1
        for path in sorted(found):
            path = path if path.startswith("/") == self.root.startswith("/") else "/" + path
            yield path[skip:]

    def sync(self) -> None:
        return None


def open_storage(url: str, **storage_options: object) -> Storage:
    """A backend for a store URL: a plain path or ``file://`` is local, ``s3://`` is S3Storage, anything else fsspec.

    An S3 store's options also come from ``SHARDSTORE_STORAGE_OPTIONS`` and the URL's query
    (``shardstore.storage_options``); a local store takes none."""
    from .local import LocalStorage  # imports this module for the protocol's types

    if "://" not in url:
        return LocalStorage(url)
    if url.startswith("file://"):
        return LocalStorage(url[len("file://"):])
    if url.startswith(("s3://", "s3a://")):
        from .storage_options import check_s3_options, resolve  # the environment, the URL's query, the caller

        try:
            from .s3 import S3Storage  # conditional writes need the raw client, not fsspec's surface
        except ImportError as e:
            raise StorageError(f"cannot open store {url!r}: S3 support needs s3fs ({e})") from None
        url, options = resolve(url, dict(storage_options))
        check_s3_options(url, options)
        return S3Storage(url, **options)
    try:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
    except (ValueError, ImportError, TypeError, OSError) as e:  # unknown protocol, its package not installed, bad options
        raise StorageError(f"cannot open store {url!r}: {e}") from None
    if url.startswith("memory://"):
        root = "/" + root.lstrip("/")
    return FsspecStorage(fs, root, url)
