"""A storage stand-in that counts the bytes of objects written through it (the storage layer's
view of what a save costs): ``tests/shardstore/dcp/test_dcp.py`` measures a second save with half the state
frozen with it."""

from __future__ import annotations

import threading
from typing import Any

from shardstore.backends.base import Buffer

__all__ = ["WriteCounter"]


class WriteCounter:
    """Stands in for a Storage and counts the bytes of objects it really writes: ``write_once``
    that created the object, ``begin_write`` that started a new file (one already present is
    not written again); everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.bytes, self.objects, self._lock = inner, 0, 0, threading.Lock()

    def _count(self, key: str, data: Buffer) -> None:
        if key.startswith("objects/"):
            with self._lock:
                self.bytes += memoryview(data).nbytes
                self.objects += 1

    def write_once(self, key: str, data: Buffer) -> bool:
        written = self.inner.write_once(key, data)
        if written:
            self._count(key, data)
        return written

    def begin_write(self, key: str, data: Buffer) -> str | None:
        tmp = self.inner.begin_write(key, data)
        if tmp is not None:
            self._count(key, data)
        return tmp

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
