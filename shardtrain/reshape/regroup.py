"""Regroup: a `repartition` commit that gives a commit's learned state a new layout.

A layout here is a `Partition` of the decoder layers over N slots (slot 0 also holding
the embedding, final norm and head). Regrouping commit C onto a new partition writes N
new shard manifests whose tensor entries are C's entries *as they are* (same payload and
moment object ids, groups, Adam births and ages), and a commit with parent C at C's step,
transition ``repartition``. No tensor byte is read or written: the only new objects are
the shard manifests, the commit manifest, and the RNG state objects of slots C did not
have. So the new commit's learned-state root is C's (SPEC.md §Transitions).

RNG states (SPEC.md §Transitions): slot k of the new layout carries the RNG objects of
C's slot k when C has a slot k; a slot beyond C's slot count gets the states a process
has after seeding Python's `random`, NumPy's legacy generator and torch's CPU generator
with `rng_seed(C, k)` (a BLAKE2b hash of C's id and k), captured without disturbing the
calling process's own generators. Under the dropout-free profile no update draws from
them; they are there so every slot of every commit can be restored the same way.

`layout_partition` reads a commit's layout back as a `Partition`, and `start_layout` is
what the lifecycle builds each worker's stage from; `write_layout` is the step `grow`
shares.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from shardstore import CommitInfo, LoadedCommit, Store, TensorEntry, load_commit, write_commit, write_shard_entries
from shardstore.format.manifest import banded, decode_config
from shardstore.format.rng import capture_rng, restore_rng
from shardtrain.engine.model import LlamaConfig
from shardtrain.engine.partition import Partition
from shardtrain.errors import PartitionError, ResumeError, TransitionError
from shardtrain.job.job import PreparedJob

__all__ = [
    "TransitionResult",
    "journal_transition",
    "regroup",
    "layout_partition",
    "commit_config",
    "rng_seed",
    "derived_rng",
    "write_layout",
    "move_ref",
    "parse_partition",
    "grown_from",
    "start_layout",
]


@dataclasses.dataclass(frozen=True)
class TransitionResult:
    """What a `repartition` or `grow` commit is: its id, parent, root, layout and new objects."""

    commit: str
    parent: str
    step: int
    learned_root: str
    parent_learned_root: str
    partition: Partition
    new_objects: tuple[str, ...]  # objects the transition added to the store (manifests, RNG, new tensors)


def commit_config(store: Store, lc: LoadedCommit) -> tuple[LlamaConfig, dict[str, Any]]:
    """The Llama config a commit binds, as a `LlamaConfig` and as the dict it was stored as."""
    if lc.commit.config is None:
        raise TransitionError(f"commit {lc.id[:12]} binds no model config; it cannot be regrouped or grown")
    raw = decode_config(store.get(lc.commit.config))
    return LlamaConfig.from_hf_dict(raw), raw


def layout_partition(config: LlamaConfig, lc: LoadedCommit) -> Partition:
    """The partition a commit's layout is; TransitionError if it is not one (e.g. split by hand)."""
    ranges: list[tuple[int, int]] = []
    for lay in lc.commit.layout:
        idx = sorted({int(n.split(".")[2]) for n in lay.tensors if n.startswith("model.layers.")})
        if idx and idx != list(range(idx[0], idx[-1] + 1)):
            raise TransitionError(f"commit {lc.id[:12]}: slot {lay.slot} holds layers {idx}, not a contiguous range")
        start = ranges[-1][1] if ranges else 0
        ranges.append((idx[0], idx[-1] + 1) if idx else (start, start))
    try:
        partition = Partition.from_ranges(ranges, config.num_hidden_layers)
        for lay in lc.commit.layout:
            if tuple(sorted(partition.owned_parameter_names(config, lay.slot))) != tuple(lay.tensors):
                raise TransitionError(
                    f"commit {lc.id[:12]}: slot {lay.slot}'s tensors are not those its layers own "
                    f"(slot 0 holds the embedding, final norm and head)"
                )
    except PartitionError as exc:
        raise TransitionError(f"commit {lc.id[:12]}: layout is not a layer partition: {exc}") from exc
    return partition


def grown_from(base: LlamaConfig, config: LlamaConfig | None) -> bool:
    """Whether `config` is `base` with more layers: a grown model (SPEC.md §15.1)."""
    return (
        config is not None
        and config.num_hidden_layers > base.num_hidden_layers
        and dataclasses.replace(config, num_hidden_layers=base.num_hidden_layers) == base
    )


def start_layout(job: PreparedJob, store: Store, cid: str | None, world: int) -> tuple[LlamaConfig, Partition]:
    """The model config and partition a worker builds its stage from: the start commit's
    (its layout, its config, grown or not), or the job's split evenly for a fresh or
    imported start. A group never resumes a commit laid out for another worker count."""
    lc = None if cid is None else load_commit(store, cid)
    if lc is None or lc.commit.transition == "import":
        return job.config, Partition.even(job.config.num_hidden_layers, world)
    if len(lc.shards) != world:
        raise ResumeError(
            f"commit {lc.id[:12]} is laid out for {len(lc.shards)} workers, this group has {world}; "
            f"write a repartition commit first (shardtrain regroup --commit {lc.id[:12]} --workers "
            f"{world}; shardtrain train without torchrun does this itself)"
        )
    config, _ = commit_config(store, lc)
    return config, layout_partition(config, lc)


def rng_seed(parent: str, slot: int) -> int:
    """The seed of a new slot's RNG states: BLAKE2b-64 of ``shardtrain-rng-v1:<parent id>:<slot>``, mod 2**32."""
    digest = hashlib.blake2b(f"shardtrain-rng-v1:{parent}:{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**32)


def derived_rng(parent: str, slot: int) -> dict[str, bytes]:
    """The python, numpy and torch RNG states of new slot `slot` (the caller's generators are left as they were)."""
    saved = capture_rng(cuda=False)
    try:
        seed = rng_seed(parent, slot)
        random.seed(seed)
        np.random.seed(seed)
        torch.random.default_generator.manual_seed(seed)
        return capture_rng(cuda=False)
    finally:
        restore_rng(dict(saved))


def write_layout(
    store: Store,
    lc: LoadedCommit,
    entries: Mapping[str, TensorEntry],
    config: LlamaConfig,
    raw_config: Mapping[str, Any],
    partition: Partition,
    *,
    transition: str,
) -> str:
    """Commit `entries` (all of them) on `partition` with parent `lc`, at its step; return the commit id."""
    c = lc.commit
    slot_names = [partition.owned_parameter_names(config, s) for s in range(partition.num_slots)]
    owned = {n for names in slot_names for n in names}
    if owned != set(entries):
        missing, extra = sorted(owned - set(entries)), sorted(set(entries) - owned)
        raise TransitionError(
            f"commit {lc.id[:12]}: the new layout does not cover exactly the commit's tensors: "
            f"no entry for {missing[:5]}, no owner for {extra[:5]}"
        )
    own_extras = {s: [x.key for x in sh.extras] for s, sh in lc.shards.items() if sh.extras}
    if own_extras:  # a slot's own extras describe the old layout: there is no slot of the new one to give them to
        raise TransitionError(
            f"commit {lc.id[:12]}: slots hold their own extras {own_extras}; a new layout cannot carry them"
        )
    info = CommitInfo(
        step=c.step,
        job=c.job,
        schedule=c.schedule,
        profile=c.profile,
        config=dict(raw_config),
        data_cursor=c.data_cursor,
        transition=transition,
    )
    groups = {g.name: g for g in c.optimizer.groups}
    shard_ids = []
    for slot, names in enumerate(slot_names):
        mine = [entries[n] for n in names]
        used = sorted({e.optim.group for e in mine if e.optim is not None})
        if slot < len(lc.shards):
            rng = {r.kind: r.object for r in lc.shards[slot].rng}
        else:
            rng = {kind: store.put(data) for kind, data in derived_rng(lc.id, slot).items()}
        shard_ids.append(
            write_shard_entries(
                store,
                mine,
                groups=[groups[g] for g in used],
                algorithm=c.optimizer.algorithm,
                rng=rng,
                info=info,
                parent=lc.id,
                slot=slot,
                slots=partition.num_slots,
                bands=banded(c.version),
            )
        )  # a version 2 or 3 commit keeps its grid
    return write_commit(
        store, shard_ids, info=info, parent=lc.id, extras=c.extras
    )  # commit-wide extras are layout-free


def move_ref(store: Store, ref: str | None, old: str, new: str) -> None:
    """Move `ref` from `old` (or from nothing) to `new`; refuse a ref that names another commit."""
    if ref is None:
        return
    current = store.ref(ref)
    if current not in (None, old):
        raise TransitionError(f"ref {ref!r} points at commit {current[:12]}, not at {old[:12]}; not moving it")
    store.set_ref(ref, new, expected=current)


def journal_transition(store: Store, cid: str, record: dict[str, Any], started: float) -> None:
    """Write transition commit ``cid``'s journal entry: ``record`` (what it did), with when it
    started, how long it took, the host and the process (the journal: never hashed, SPEC.md §8.3)."""
    store.write_journal(
        cid,
        {**record, "time": started, "seconds": time.time() - started, "host": socket.gethostname(), "pid": os.getpid()},
    )


def regroup(
    store: Store, commit: str, partition: Partition | None = None, *, workers: int | None = None, ref: str | None = None
) -> TransitionResult:
    """Write the `repartition` commit of `commit` on `partition` (default: `workers` even slots).

    ``ref``, if given, moves from `commit` (or from nothing) to the new commit.
    """
    started = time.time()
    before = set(store.objects())
    lc = load_commit(store, commit)
    config, raw = commit_config(store, lc)
    if partition is None:
        if workers is None:
            raise TransitionError("regroup needs a partition or a worker count")
        partition = Partition.even(config.num_hidden_layers, workers)
    cid = write_layout(store, lc, lc.entries(), config, raw, partition, transition="repartition")
    new = load_commit(store, cid)
    if new.commit.learned_root != lc.commit.learned_root:  # cannot happen: the entries are C's own
        raise TransitionError(
            f"repartition commit {cid[:12]} has learned-state root {new.commit.learned_root}, "
            f"its parent {lc.commit.learned_root}"
        )
    move_ref(store, ref, lc.id, cid)
    journal_transition(
        store, cid, {"transition": "repartition", "slots": [len(lc.shards), partition.num_slots]}, started
    )
    return TransitionResult(
        cid,
        lc.id,
        lc.commit.step,
        new.commit.learned_root,
        lc.commit.learned_root,
        partition,
        tuple(sorted(set(store.objects()) - before)),
    )


def parse_partition(text: str, num_layers: int) -> Partition:
    """``0:3,3:5,5:8`` -> the partition with those half-open layer ranges."""
    try:
        pairs: Sequence[tuple[int, int]] = [tuple(int(x) for x in part.split(":", 1)) for part in text.split(",")]  # type: ignore[misc]
    except ValueError:
        raise PartitionError(
            f"--partition {text!r}: expected START:STOP ranges separated by commas, e.g. 0:3,3:5,5:8"
        ) from None
    return Partition.from_ranges(pairs, num_layers)
