"""A storage stand-in that counts the bytes of objects read through it (the storage layer's
view of what a restore or a copy costs): ``tests/shardstore/sharded/test_dtensor_mesh.py`` bounds each rank's
reads by its share with it."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from shardstore.backends.base import Buffer

__all__ = ["ReadCounter"]


class ReadCounter:
    """Stands in for a Storage and counts the bytes of objects read through it: what a restore
    or copy costs at the storage layer, whatever path (``read``, ``read_hashed``,
    ``read_into``) the store takes; everything else passes through. ``keys``: how many times
    each object was read (``tests/shardstore/sharded/test_read_exchange.py``: once in a group)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.bytes, self._lock = inner, 0, threading.Lock()
        self.keys: Counter[str] = Counter()

    def _count(self, key: str, n: int) -> None:
        if key.startswith("objects/"):
            with self._lock:
                self.bytes += n
                self.keys[key] += 1

    def read(self, key: str, *args: Any, **kwargs: Any) -> Buffer:
        data = self.inner.read(key, *args, **kwargs)
        self._count(key, len(data))
        return data

    def read_hashed(self, key: str, hasher: Any, limit: int | None = None) -> Any:
        data, digest = self.inner.read_hashed(key, hasher, limit)
        self._count(key, len(data))
        return data, digest

    def read_into(self, key: str, out: Any, consume: Any = None) -> int:
        n = self.inner.read_into(key, out, consume)
        self._count(key, n if n == len(out) else 0)  # a size mismatch reads nothing
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
