"""``torch``, imported on first use.

The store-only operations (log, show, refs, cat, diff, verify, gc, copy) read manifests and
hash bytes; they never make a tensor. Importing torch costs seconds, so the modules on their
path name torch through this stand-in, which imports the real module the first time an
attribute is asked for and keeps each attribute it hands out (so a hot loop pays once).
Annotations name torch freely: every module here has ``from __future__ import annotations``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["torch"]


class _Lazy:
    """A module imported when first used: ``_Lazy("torch").Tensor`` imports torch."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # copy, pickle and inspect probe dunders: never import for them
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        value = getattr(self._module, attr)
        setattr(self, attr, value)
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (imported)'}>"


torch: Any = _Lazy("torch")
