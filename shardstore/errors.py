"""The error hierarchy of shardstore: one base class, one subclass per failure mode.

Every error names what was wrong (object id, tensor name, ref, slot) and, where the rule
comes from the format, the SPEC.md section that states it. The CLI maps these classes to
exit codes (SPEC.md §Exit codes); library code only raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = [
    "ShardstoreError",
    "InvalidName",
    "StoreConfigError",
    "StorageError",
    "StorageOptionError",
    "TierError",
    "ObjectNotFound",
    "CorruptObject",
    "ManifestError",
    "ObjectTooLarge",
    "TensorMismatch",
    "GridError",
    "BindingError",
    "LayoutError",
    "CursorError",
    "RefNotFound",
    "RefConflict",
    "GcRace",
    "TargetNotFound",
    "StateMismatch",
    "UnsupportedOptimizer",
    "UnsupportedState",
    "CommitProtocolError",
]


class ShardstoreError(Exception):
    """Base class of every error shardstore raises on purpose."""


class InvalidName(ShardstoreError, ValueError):
    """A ref name, tensor name, object id or key that fails validation before touching a path."""


class StoreConfigError(ShardstoreError):
    """The store's config object is missing, malformed, or of a version this reader refuses."""


class StorageError(ShardstoreError):
    """The backend failed to read, write, list or delete (I/O error, permission, server error)."""


class StorageOptionError(StorageError):
    """A storage option is unknown, of the wrong type or value, or half of a credential (README "Storage options")."""


class TierError(StorageError):
    """A memory tier that cannot be used: not a private directory of this user, or not writable."""


class ObjectNotFound(ShardstoreError):
    """An object that something references is absent from the store."""


class CorruptObject(ShardstoreError):
    """An object's bytes do not hash to its id (flipped bytes, truncation, appended bytes)."""


class ManifestError(ShardstoreError):
    """A manifest (or ref, or config) does not decode strictly, is not canonical, or breaks a field rule."""


class ObjectTooLarge(ManifestError):
    """An object is larger than its reader's limit (manifest, config, RNG state); refused before it is read or written."""


class TensorMismatch(ShardstoreError):
    """A tensor's dtype, shape or byte size disagrees with its entry or with the target tensor."""


class GridError(ManifestError):
    """A chunked payload's blocks are not its tensor's canonical grid (gaps, overlaps, wrong blocks)."""


class BindingError(ShardstoreError):
    """A shard manifest belongs to another commit, job, step, slot or model version."""


class LayoutError(ShardstoreError):
    """A layout leaves a tensor unowned, owns it twice, or disagrees with its shard manifests."""


class CursorError(ShardstoreError):
    """An optimizer cursor is inconsistent: Adam age != step - birth, or birth outside [0, step]."""


class RefNotFound(ShardstoreError):
    """A ref name that does not exist in the store."""


class RefConflict(ShardstoreError):
    """A compare-and-swap on a ref lost: the ref did not hold the expected commit id."""


class GcRace(ShardstoreError):
    """A ref or pin was not moved because a concurrent gc removed objects it would name (or held the store too long), or a running gc's marker was not removed."""


class TargetNotFound(ShardstoreError):
    """A target (ref name, commit id or id prefix, with any ~N / ^ suffixes) that names no commit, or names several."""


class StateMismatch(ShardstoreError):
    """What a commit holds does not match what it is restored or exported into (missing names, groups, a model config)."""


class UnsupportedOptimizer(ShardstoreError):
    """An optimizer or optimizer option the canonical form cannot represent (e.g. amsgrad)."""


class UnsupportedState(ShardstoreError):
    """A value to save that the format cannot hold without pickle (a function, a custom object), named by its key path."""


class CommitProtocolError(ShardstoreError):
    """Slots disagree during the commit protocol (different commit ids, steps, or failed peers)."""


# An error crossing the ranks of a group (SPEC.md §16.2, §16.3): a rank that fails sends its
# error's type name and message; every other rank raises the same type with the same message,
# naming the rank, so that no rank of the group waits and each says what went wrong.

#: The most bytes of a failure report (its type name and message, the message cut to fit).
FAILURE_BYTES = 8192

_REPORT = msgspec.json.Decoder(tuple[str, str])


def failure_report(e: BaseException) -> bytes:
    """``e``'s type name and message as JSON, at most ``FAILURE_BYTES``."""
    msg = str(e).encode()[: FAILURE_BYTES - 256].decode(errors="ignore")
    out = msgspec.json.encode((type(e).__name__[:128], msg))
    while len(out) > FAILURE_BYTES:  # escapes lengthen a message: cut it until it fits
        msg = msg[: len(msg) // 2]
        out = msgspec.json.encode((type(e).__name__[:128], msg))
    return out


def raise_peer(reports: Sequence[bytes | None], where: str, section: str = "§16.3") -> None:
    """Raise the first failed rank's error (``reports[r]``: rank r's report, None if it did not
    fail), with its type where shardstore defines it, naming the rank, what the group was doing
    (``where``) and the SPEC.md section whose failure rule applies."""
    for r, raw in enumerate(reports):
        if raw is None:
            continue
        try:
            name, msg = _REPORT.decode(raw)
        except msgspec.MsgspecError:
            name, msg = "ShardstoreError", f"a failure whose report does not decode ({len(raw)} bytes)"
        cls = globals().get(name) if name in __all__ else None
        if not (isinstance(cls, type) and issubclass(cls, ShardstoreError)):
            cls = ShardstoreError
        raise cls(f"{msg} (on rank {r} of the group {where}; SPEC.md {section})")
