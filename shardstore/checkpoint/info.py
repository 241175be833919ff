"""What a commit is about besides its tensors (``CommitInfo``), and the checks a writer or a
restore runs before its first write (SPEC.md §19.2, "arguments before
writes" and "validate before write").

- ``check_info``: a commit's non-tensor fields (job id, step, cursor, labels, transition,
  model config) against the manifest rules, so that a save or import that could never be
  committed is refused before it writes an object (not after, naming an internal shard
  manifest id);
- ``check_parent``: the parent a commit will name is a commit of the store.

(A restore's checks of the caller's model, optimizer and extras against the commit, before
any read, are its plan phase: ``checkpoint.restore``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import ManifestError, ObjectNotFound, TargetNotFound
from ..format.manifest import Count, JobId, Label, Transition, encode_config
from ..format.names import check_oid
from ..store import Store

__all__ = ["CommitInfo", "check_info", "check_parent"]


@dataclass
class CommitInfo:
    """Everything about a commit that is not a tensor: what job, which step, what model."""

    step: int
    job: str = "default"
    schedule: str | None = None
    profile: str = "fp32"
    config: Mapping[str, Any] | None = None
    data_cursor: int | None = None
    transition: str = "train"


class _InfoRules(msgspec.Struct, forbid_unknown_fields=True):
    """The manifest field rules (SPEC.md §8.3) of CommitInfo's fields, to check them before any write."""

    job: JobId
    step: Count
    data_cursor: Count | None
    schedule: Label | None
    profile: Label
    transition: Transition


def check_info(info: CommitInfo) -> None:
    """ManifestError naming the field if ``info`` could never be written as a commit (a job id
    that is not a name, a negative or huge step, an unrepresentable config...). Every writer
    calls this before its first object, so a refused save or import leaves nothing behind."""
    doc = {k: getattr(info, k) for k in ("job", "step", "data_cursor", "schedule", "profile", "transition")}
    try:
        msgspec.convert(doc, _InfoRules, strict=True)
    except msgspec.ValidationError as e:
        raise ManifestError(f"commit info: {e} (SPEC.md §Commit manifest)") from None
    if info.config is not None:
        encode_config(dict(info.config))


def check_parent(store: Store, parent: str | None) -> None:
    """Refuse a parent that is not a commit of ``store`` (TargetNotFound if absent, ManifestError
    if the object is something else): ``log`` and gc follow parents, so a commit must never
    name a tensor, a shard manifest or nothing as its parent."""
    if parent is None:
        return
    check_oid(parent, what="parent commit id")
    try:
        store.commit(parent)
    except ObjectNotFound:
        raise TargetNotFound(f"parent commit {parent} is not in {store.url}") from None
    except ManifestError as e:
        raise ManifestError(f"parent {parent} is not a commit: {e}") from None
