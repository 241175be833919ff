"""What a commit names (SPEC.md §19.1): every object a reader of the commit needs, or only
what one slot needs (the slot-K selection, SPEC.md §Slices held). Copy, gc and the gc fence
all take a commit's closure from here, from its manifests alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from .manifest import CommitManifest, ShardManifest, extra_objects
from .slices import entry_objects, slot_needs

__all__ = ["Closure", "CommitShards", "commit_closure"]


class CommitShards(Protocol):
    """A commit with its shard manifests (``verification.LoadedCommit`` is one)."""

    id: str
    commit: CommitManifest
    shards: Mapping[int, ShardManifest]
    shard_ids: Mapping[int, str]


@dataclass
class Closure:
    """What a commit needs: data objects (id → byte size, None where the format fixes none),
    its shard manifests (by slot order) and the commit manifest itself. ``labels``: what a
    data object is (tensor, role and block, as verify names them), for errors."""

    commit: str
    shards: list[str]
    data: dict[str, int | None] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def ids(self) -> set[str]:
        return {self.commit, *self.shards, *self.data}


def commit_closure(lc: CommitShards, slot: int | None = None) -> Closure:
    """The closure of a loaded commit: every slot's data objects, or only ``slot``'s.

    Shard manifests and the model config are always included: they are small, and a
    reader verifies the whole commit structure before it restores any slot.
    """
    out = Closure(lc.id, [lc.shard_ids[s] for s in sorted(lc.shard_ids)])
    if lc.commit.config is not None:
        out.data[lc.commit.config] = None
        out.labels[lc.commit.config] = "model config"
    for oid, size, what, _rule in extra_objects(lc.commit.extras, ""):  # commit-wide extras: every slot restores them
        out.data[oid] = size
        out.labels.setdefault(oid, what)
    needs = slot_needs(lc.shards, slot) if slot is not None else None  # the slot-K selection (SPEC.md §Slices held)
    for s, shard in sorted(lc.shards.items()):
        if shard.config is not None:
            out.data.setdefault(shard.config, None)
            out.labels.setdefault(shard.config, "model config")
        if slot is None or s == slot:
            for r in shard.rng:
                out.data.setdefault(r.object, None)
                out.labels.setdefault(r.object, f"RNG state {r.kind} of slot {s}")
            for oid, size, what, _rule in extra_objects(shard.extras, f" of slot {s}"):
                out.data[oid] = size
                out.labels.setdefault(oid, what)
        for e in shard.entries:
            if needs is not None and e.name not in needs:
                continue
            for oid, n, what in entry_objects(e, needs[e.name] if needs is not None else None):
                out.data[oid] = n
                out.labels.setdefault(oid, f"tensor {e.name!r}, {what}")  # "tensor 'w', parameter block 1"
    return out
