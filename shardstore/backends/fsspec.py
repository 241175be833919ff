"""A store on any fsspec filesystem (``memory://`` in the tests and the tour).

Create-only writes and compare-and-swap are serialised by a process-local lock, which is
exact for ``memory://`` (a process-local filesystem) and nothing more: other filesystems
get ``LocalStorage`` or ``S3Storage`` from ``location.open_storage``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timezone

import fsspec

from ..errors import ObjectNotFound, ObjectTooLarge, RefConflict, StorageError
from ..format.names import check_key
from .base import Buffer, show_ref_value

__all__ = ["FsspecStorage"]


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
                raise ObjectTooLarge(
                    f"{key} in store {self.url} is {n} bytes, over this reader's limit of {limit} (SPEC.md §Limits)"
                )
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
