"""shardstore: a content-addressed store for sharded training state.

Objects are named by the BLAKE3 hash of their bytes; shard manifests name one slot's
tensors, Adam moments and cursors, and RNG; a commit binds the shards, the job and the
learned-state root, and its id is the full root. Only refs move, by compare-and-swap.
SPEC.md at the repository root is the normative description.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors as _errors
from .errors import *  # noqa: F401,F403 (the error classes, torch-free)

__version__ = "0.1.0"

#: Where each public name lives. Names load on first use (PEP 562), so ``import shardstore``
#: (and the command line's store-only commands) does not import torch until something needs it.
_EXPORTS: dict[str, str] = {
    "Storage": "shardstore.backends.base",
    "FsspecStorage": "shardstore.backends.fsspec",
    "LocalStorage": "shardstore.backends.local",
    "open_storage": "shardstore.backends.location",
    "S3Storage": "shardstore.backends.s3.storage",
    "AsyncSaver": "shardstore.checkpoint.async_save",
    "agree_on_commit": "shardstore.checkpoint.distributed",
    "save_distributed": "shardstore.checkpoint.distributed",
    "CommitInfo": "shardstore.checkpoint.info",
    "AUTO": "shardstore.checkpoint.slots",
    "Restored": "shardstore.checkpoint.slots",
    "SlotState": "shardstore.state.slot",
    "capture": "shardstore.state.slot",
    "restore": "shardstore.checkpoint.slots",
    "save": "shardstore.checkpoint.slots",
    "save_slots": "shardstore.checkpoint.slots",
    "save_state_dict": "shardstore.checkpoint.state_dict",
    "read_state_dict": "shardstore.checkpoint.state_dict",
    "load_state_dict_into": "shardstore.checkpoint.state_dict",
    "write_commit": "shardstore.checkpoint.slots",
    "write_shard": "shardstore.checkpoint.slots",
    "write_shard_entries": "shardstore.checkpoint.slots",
    "CommitManifest": "shardstore.format.manifest",
    "LearnedState": "shardstore.format.manifest",
    "ShardManifest": "shardstore.format.manifest",
    "StoreConfig": "shardstore.format.manifest",
    "TensorEntry": "shardstore.format.manifest",
    "decode": "shardstore.format.manifest",
    "encode": "shardstore.format.manifest",
    "learned_root": "shardstore.format.roots",
    "GcResult": "shardstore.ops.gc",
    "gc": "shardstore.ops.gc",
    "CopyResult": "shardstore.ops.transfer",
    "copy_commit": "shardstore.ops.transfer",
    "Store": "shardstore.store",
    "open_store": "shardstore.store",
    "LoadedCommit": "shardstore.verification.commits",
    "Problem": "shardstore.verification.commits",
    "Report": "shardstore.verification.checker",
    "load_commit": "shardstore.verification.commits",
    "verify": "shardstore.verification.checker",
}

__all__ = sorted([*_EXPORTS, *_errors.__all__])  # noqa: PLE0605 (built from the table above)


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


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from .backends.base import Storage  # noqa: F401
    from .backends.fsspec import FsspecStorage  # noqa: F401
    from .backends.local import LocalStorage  # noqa: F401
    from .backends.location import open_storage  # noqa: F401
    from .backends.s3.storage import S3Storage  # noqa: F401
    from .checkpoint.async_save import AsyncSaver  # noqa: F401
    from .checkpoint.distributed import agree_on_commit, save_distributed  # noqa: F401
    from .checkpoint.info import CommitInfo  # noqa: F401
    from .checkpoint.slots import (
        AUTO,
        Restored,
        restore,
        save,
        save_slots,
        write_commit,
        write_shard,
        write_shard_entries,
    )  # noqa: F401
    from .checkpoint.state_dict import load_state_dict_into, read_state_dict, save_state_dict  # noqa: F401
    from .format.manifest import CommitManifest, LearnedState, ShardManifest, StoreConfig, TensorEntry, decode, encode  # noqa: F401
    from .format.roots import learned_root  # noqa: F401
    from .ops.gc import GcResult, gc  # noqa: F401
    from .ops.transfer import CopyResult, copy_commit  # noqa: F401
    from .state.slot import SlotState, capture  # noqa: F401
    from .store import Store, open_store  # noqa: F401
    from .verification.checker import Report, verify  # noqa: F401
    from .verification.commits import LoadedCommit, Problem, load_commit  # noqa: F401
