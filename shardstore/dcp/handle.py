"""A store named so that it can cross into another process (DCP's ``async_save`` in process mode
pickles the storage writer and sends it to a checkpoint process of its own).

A ``StoreHandle`` keeps a store's URL and storage options and opens the store on first use, in
whichever process that is; the open ``Store`` itself never crosses. A handle made from an open
``Store`` crosses only if the store is local (a path): any other URL may depend on options the
``Store`` was opened with and that it does not keep, so the other process would open another
store (or a ``memory://`` store of its own) and the save would land where nobody looks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import UnsupportedState
from ..store import Store, open_store

__all__ = ["StoreHandle"]


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


class StoreHandle:
    """A store by URL (and storage options), opened lazily; picklable as its URL and options."""

    def __init__(self, store_or_url: Store | str | os.PathLike[str], storage_options: Mapping[str, Any] | None) -> None:
        self._store: Store | None = None
        self.options: dict[str, Any] = dict(storage_options or {})
        if isinstance(store_or_url, Store):
            if self.options:
                raise TypeError("storage_options apply to a store URL, not to an open Store")
            self._store = store_or_url
            self.url = store_or_url.url
            self.portable = _is_local(self.url)
        else:
            self.url = os.fspath(store_or_url)
            self.portable = True

    def open(self, *, create: bool) -> Store:
        """The store, opened (``create``: made if absent) the first time this process asks."""
        if self._store is None:
            self._store = open_store(self.url, create=create, **self.options)
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        if not self.portable:
            raise UnsupportedState(
                f"the open store {self.url} cannot cross to another process (its options stay behind, and a "
                "memory:// store is per process): pass its URL, and storage_options=, for async_save in process mode"
            )
        return {"url": self.url, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url, self.options, self.portable, self._store = state["url"], state["options"], True, None

    def __repr__(self) -> str:
        return f"StoreHandle({self.url!r})"
