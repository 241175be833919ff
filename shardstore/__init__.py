"""shardstore: a content-addressed store for sharded training state.

Objects are named by the BLAKE3 hash of their bytes; shard manifests name one slot's
tensors, Adam moments and cursors, and RNG; a commit binds the shards, the job and the
learned-state root, and its id is the full root. Only refs move, by compare-and-swap.
SPEC.md at the repository root is the normative description.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import errors as _errors
from .errors import *  # noqa: F401,F403 (the error classes, torch-free)

__version__ = "0.1.0"

if TYPE_CHECKING:
    # The one list of the public names besides the error classes. Type checkers and IDEs import
    # them from here; at run time `__getattr__` loads each on first use (PEP 562), from the module
    # this block names, so ``import shardstore`` (and the command line's store-only commands) does
    # not import torch until something needs it. `_exports` reads this block (as lazy_loader's
    # ``attach_stub`` reads a stub): a name added here is public, lazily loaded and in `__all__`.
    from .backends.base import Storage
    from .backends.fsspec import FsspecStorage
    from .backends.local import LocalStorage
    from .backends.location import open_storage
    from .backends.memory_tier import MemoryTier
    from .backends.s3.storage import S3Storage
    from .backends.tiers import PeerCopies, TieredStorage
    from .checkpoint.async_save import AsyncSaver
    from .checkpoint.distributed import agree_on_commit, save_distributed
    from .checkpoint.info import CommitInfo
    from .checkpoint.replicas import fetch_replicas, replicate
    from .checkpoint.restore import Restored, restore
    from .checkpoint.slots import AUTO, save, save_slots, write_commit, write_shard, write_shard_entries
    from .checkpoint.state_dict import (
        StoredStateDict,
        load_state_dict_into,
        open_state_dict,
        read_state_dict,
        save_state_dict,
    )
    from .format.manifest import CommitManifest, LearnedState, ShardManifest, StoreConfig, TensorEntry, decode, encode
    from .format.roots import learned_root
    from .ops.gc import GcResult, gc
    from .ops.transfer import CopyResult, copy_commit
    from .state.slot import SlotState, capture
    from .store import Store, open_store
    from .verification.checker import Report, verify
    from .verification.commits import LoadedCommit, Problem, load_commit


def _exports() -> dict[str, str]:
    """Public name -> the module it is loaded from: the imports of the ``if TYPE_CHECKING:`` block above."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {
        alias.asname or alias.name: f"{__name__}.{node.module}"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


#: Where each public name lives (read from the block above, the one list).
_EXPORTS: dict[str, str] = _exports()

__all__ = sorted([*_EXPORTS, *_errors.__all__])  # noqa: PLE0605 (built from the list above)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    else:
        try:  # a submodule by attribute (``shardstore.manifest``), as after ``import shardstore.manifest``
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
