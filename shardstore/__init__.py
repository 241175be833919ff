"""shardstore: a content-addressed store for sharded training state.

Objects are named by the BLAKE3 hash of their bytes; shard manifests name one slot's
tensors, Adam moments and cursors, and RNG; a commit binds the shards, the job and the
learned-state root, and its id is the full root. Only refs move, by compare-and-swap.
SPEC.md at the repository root is the normative description.
"""
from .async_save import AsyncSaver
from .checkpoint import AUTO, CommitInfo, Restored, SlotState, capture, restore, save, save_slots, write_commit, write_shard, write_shard_entries
from .distributed import agree_on_commit, save_distributed
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .manifest import CommitManifest, LearnedState, ShardManifest, StoreConfig, TensorEntry, decode, encode
from .roots import learned_root
from .store import Store, open_store
from .local import LocalStorage
from .storage import FsspecStorage, Storage, open_storage
from .verify import LoadedCommit, Problem, Report, load_commit, verify
from .gc import GcResult, gc
from .s3 import S3Storage
from .transfer import CopyResult, copy_commit

__version__ = "0.1.0"

__all__ = [
    "AUTO",
    "AsyncSaver",
    "CommitInfo",
    "CommitManifest",
    "FsspecStorage",
    "LearnedState",
    "LoadedCommit",
    "LocalStorage",
    "Problem",
    "Report",
    "Restored",
    "ShardManifest",
    "SlotState",
    "Storage",
    "Store",
    "StoreConfig",
    "TensorEntry",
    "capture",
    "decode",
    "encode",
    "learned_root",
    "load_commit",
    "open_storage",
    "open_store",
    "restore",
    "save",
    "save_slots",
    "verify",
    "save_distributed",
    "agree_on_commit",
    "write_commit",
    "write_shard",
    "write_shard_entries",
    "CopyResult",
    "GcResult",
    "S3Storage",
    "copy_commit",
    "gc",
    *_errors_all,
]
