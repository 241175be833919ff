"""Saving training state as commits (SPEC.md §Write ordering).

The common case is one call (``restore``, its other half, is ``checkpoint.restore``)::

    commit_id = shardstore.save(store, model, optimizer, step=step, extra={"scheduler": sched})

Parameters and persistent buffers (``module_state``), Adam/AdamW (``optim``) or any torch
optimizer (``torch_optim``), and extras: objects with ``state_dict()`` (``extras``).

Underneath, a save is: ``capture`` what one slot owns (no copy), ``write_shard`` (objects,
then a durability barrier, then the shard manifest), ``write_commit`` (the commit manifest,
whose id is the full root), then the ref moves by compare-and-swap.
"""

from __future__ import annotations

import inspect
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CursorError, LayoutError, ObjectNotFound, StateMismatch, TensorMismatch
from ..format.closure import commit_closure
from ..format.grid import on_bands, payload_blocks, put_payloads
from ..format.manifest import (
    CommitManifest,
    ExtraEntry,
    GroupSpec,
    OptimEntry,
    OptimizerSpec,
    RngEntry,
    ShardManifest,
    SlotLayout,
    TensorEntry,
    banded,
    encode,
    encode_config,
    shard_version,
    tensor_payloads,
)
from ..format.names import check_ref_name
from ..format.roots import learned_root
from ..format.tensors import dtype_name, hash_bytes
from ..state.extras import capture_extras, write_extras
from ..state.module import tensor_profile
from ..state.optim import ParamOpt, group_spec
from ..state.slot import SlotState, capture, slot_tensors
from ..state.torch_optim import param_state, state_objects, torch_spec, torch_union
from ..store import Store
from ..store.tensors import WRITE_THREADS
from ..verification.commits import LoadedCommit, read_commit, shard_problems
from .info import CommitInfo, check_info, check_parent

__all__ = [
    "CommitInfo",
    "check_info",
    "check_parent",
    "write_shard",
    "write_shard_entries",
    "shard_entries_manifest",
    "write_commit",
    "write_loaded_commit",
    "put_config",
    "save_slots",
    "save",
    "SaveCall",
    "AUTO",
]

AUTO: Any = "auto"
"""Sentinel: take the parent from the ref being moved."""


def _config_id(store: Store, config: Mapping[str, Any] | None, *, write: bool = True) -> str | None:
    """The id of the model config object of ``config``, written (create-only) unless ``write`` is
    False: a commit writes it once, before any manifest names it, and its other writers name it
    by the id of the same canonical bytes (SPEC.md §15: on S3 each write of a present object is
    a PUT answered 412, a HEAD and a CopyObject, all on one key)."""
    if config is None:
        return None
    data = encode_config(dict(config))
    return store.put(data) if write else store.name_written(hash_bytes(data), data)


def put_config(store: Store, info: CommitInfo) -> str | None:
    """Write the model config object of ``info`` (create-only; refreshed if present) and return its
    id (None: no config): a commit's writers then name it with ``write_config=False`` (SPEC.md §15)."""
    return _config_id(store, info.config)


def write_shard(
    store: Store,
    state: SlotState,
    *,
    info: CommitInfo,
    parent: str | None,
    slot: int,
    slots: int,
    threads: int = WRITE_THREADS,
    write_config: bool = True,
    written: frozenset[str] = frozenset(),
) -> str:
    """Write one slot's objects, then (after a durability barrier) its shard manifest; return its id.

    ``write_config=False``: the model config object is named, not written: the caller wrote it
    (``put_config``) before this shard manifest, once for the whole commit (SPEC.md §15).
    ``written``: ids of objects another writer of this commit made durable before this call (the
    coordinator's RNG objects): an RNG object of this slot with one of those ids is named, not written."""
    check_info(info)
    names = sorted(state.tensors)
    flat = slot_tensors(state)  # payloads in manifest order (torch-form state like parameters', format 3)
    ids = iter(put_payloads(store, flat, threads=threads))  # canonical blocks, hashed once, written once, batched fsync
    entries = []
    for n in names:
        t = state.tensors[n]
        param_id = next(ids)
        po: ParamOpt | None = state.optim.params.get(n)
        optim = None
        torch_state = param_state(po.torch_state, ids) if po is not None and po.torch_state is not None else None
        if po is not None and torch_state is None:
            has_moments = po.exp_avg is not None and po.exp_avg_sq is not None
            m1 = next(ids) if has_moments else None
            m2 = next(ids) if has_moments else None
            if has_moments and (
                tuple(po.exp_avg.shape) != tuple(t.shape) or tuple(po.exp_avg_sq.shape) != tuple(t.shape)
            ):
                raise TensorMismatch(
                    f"tensor {n!r}: Adam moments have shapes {tuple(po.exp_avg.shape)}, {tuple(po.exp_avg_sq.shape)} but the parameter has {tuple(t.shape)}"
                )
            if has_moments and po.exp_avg.dtype != po.exp_avg_sq.dtype:
                raise TensorMismatch(f"tensor {n!r}: Adam moments have different dtypes")
            birth = _birth(n, po, state, info)
            optim = OptimEntry(
                group=po.group,
                birth=birth,
                age=po.age,
                exp_avg=m1,
                exp_avg_sq=m2,
                moment_dtype=dtype_name(po.exp_avg.dtype, n) if has_moments else None,
            )
        kind = "buffer" if n in state.buffers else "param"
        entries.append(
            TensorEntry(
                name=n,
                dtype=dtype_name(t.dtype, n),
                shape=tuple(t.shape),
                param=param_id,
                optim=optim,
                kind=kind,
                state=torch_state,
            )
        )
    rng = tuple(RngEntry(kind=k, object=_rng_object(store, v, written)) for k, v in sorted(state.rng.items()))
    extras = write_extras(store, state.extra, threads=threads)
    config_id = _config_id(store, info.config, write=write_config)
    store.sync()  # objects are durable before any manifest names them
    groups = tuple(group_spec(g, h) for g, h in sorted(state.optim.groups.items()))
    torch_opt = torch_spec(state.optim)
    shard = ShardManifest(
        version=shard_version(entries, state.slices),
        job=info.job,
        step=info.step,
        parent=parent,
        config=config_id,
        slot=slot,
        slots=slots,
        algorithm=state.optim.algorithm if groups or torch_opt else "none",
        groups=groups,
        entries=tuple(entries),
        rng=rng,
        torch_optimizer=torch_opt,
        extras=extras,
        slices=state.slices,
    )
    sid = store.put_manifest(shard)
    store.sync()
    return sid


def _rng_object(store: Store, data: bytes | memoryview, written: frozenset[str]) -> str:
    """The id of an RNG object, written (create-only) unless it is one of ``written``."""
    if written:
        oid = hash_bytes(data)
        if oid in written:
            return store.name_written(oid, data)  # kept by a write-through tier as if written here
    return store.put(data)


def _birth(name: str, po: ParamOpt, state: SlotState, info: CommitInfo) -> int:
    """The step at which a parameter's Adam clock started: ``step - age`` unless the slot records
    births; CursorError if that is not a step the commit's global step can follow (SPEC.md §9)."""
    recorded = state.births is not None and name in state.births
    birth = state.births[name] if recorded else info.step - po.age  # type: ignore[index]
    if birth < 0 or birth + po.age != info.step:
        hint = (
            f"births[{name!r}] + age must equal step"
            if recorded
            else f"step= is the global step, at least every parameter's Adam age (the optimizer's step count): pass "
            f"the number of optimizer steps taken, here at least {po.age}"
        )
        raise CursorError(
            f"tensor {name!r}: Adam age {po.age} with birth {birth} does not reach global step {info.step}; {hint} "
            "(SPEC.md §9)"
        )
    return birth


def check_cursors(state: SlotState, info: CommitInfo) -> None:
    """Every Adam-form parameter's cursor against the commit's step, before anything is written."""
    for name, po in sorted(state.optim.params.items()):
        if po.torch_state is None and name in state.tensors:
            _birth(name, po, state, info)


def write_shard_entries(
    store: Store,
    entries: list[TensorEntry],
    *,
    groups: list[GroupSpec],
    algorithm: str,
    rng: Mapping[str, str],
    info: CommitInfo,
    parent: str | None,
    slot: int,
    slots: int,
    bands: bool | None = None,
) -> str:
    """Write a shard manifest naming objects already in the store; return its id.

    For transitions that move or keep tensors without touching their bytes (a new layout
    naming the same objects, SPEC.md §15.1): ``entries`` are taken as they are
    (sorted by name here), ``rng`` maps an RNG kind to an existing object id. Every named
    object must already be present (checked by existence; no payload byte is read), and
    the manifest must pass the shard rules before it is written. ``bands``: whether the
    entries' chunked payloads are on the row-band grid of versions 2-3 (pass
    ``banded(parent.version)`` for a transition of a stored commit, so every slot keeps its
    grid and version; None: judged from the payloads, which a payload valid on both grids
    leaves on the tile grid).
    """
    shard = shard_entries_manifest(
        store,
        entries,
        groups=groups,
        algorithm=algorithm,
        rng=rng,
        info=info,
        parent=parent,
        slot=slot,
        slots=slots,
        bands=bands,
    )
    sid = store.put_manifest(shard)
    store.sync()
    return sid


def shard_entries_manifest(
    store: Store,
    entries: list[TensorEntry],
    *,
    groups: list[GroupSpec],
    algorithm: str,
    rng: Mapping[str, str],
    info: CommitInfo,
    parent: str | None,
    slot: int,
    slots: int,
    bands: bool | None = None,
) -> ShardManifest:
    """The shard manifest ``write_shard_entries`` writes, checked (its named objects present, the
    shard rules) but not written: for a writer that makes several durable at one barrier."""
    check_info(info)
    # every object a payload names: one id, or each block of a chunked payload (SPEC.md §5.1)
    named = [oid for e in entries for _, p, d in tensor_payloads(e) for oid, _box, _n in payload_blocks(p, d, e.shape)]
    named += [oid for e in entries for oid, _, _ in state_objects(e)]
    named += list(rng.values())
    missing = sorted({oid for oid in named if not store.has(oid)})
    if missing:
        raise ObjectNotFound(
            f"slot {slot}: {len(missing)} object(s) named by the new shard manifest are not in the store, "
            f"first {missing[0]}"
        )
    shard = ShardManifest(
        version=shard_version(
            entries, bands=on_bands(entries) if bands is None else bands
        ),  # a version 2 or 3 commit's keep their grid
        job=info.job,
        step=info.step,
        parent=parent,
        config=_config_id(store, info.config),
        slot=slot,
        slots=slots,
        algorithm=algorithm if groups else "none",  # type: ignore[arg-type]
        groups=tuple(sorted(groups, key=lambda g: g.name)),
        entries=tuple(sorted(entries, key=lambda e: e.name)),
        rng=tuple(RngEntry(kind=k, object=v) for k, v in sorted(rng.items())),
    )
    for problem in shard_problems(shard, hash_bytes(encode(shard))):  # a reader's rules, before it is written
        raise problem.error
    return shard


def _check_some_slots(n: int) -> None:
    """LayoutError for a commit of no slots (its layout holds at least one, SPEC.md §13), before any write."""
    if n == 0:
        raise LayoutError("a commit needs at least one slot; no slots were given (SPEC.md §13)")


def write_commit(
    store: Store,
    shard_ids: list[str],
    *,
    info: CommitInfo,
    parent: str | None,
    extras: tuple[ExtraEntry, ...] = (),
    write_config: bool = True,
) -> str:
    """Write the commit manifest binding ``shard_ids`` (slot i = shard_ids[i]) and ``extras`` (written, durable); return its id.
    ``write_config=False``: the model config object was written before the shard manifests (``put_config``)."""
    return write_loaded_commit(store, shard_ids, info=info, parent=parent, extras=extras, write_config=write_config).id


def write_loaded_commit(
    store: Store,
    shard_ids: list[str],
    *,
    info: CommitInfo,
    parent: str | None,
    extras: tuple[ExtraEntry, ...] = (),
    write_config: bool = True,
) -> LoadedCommit:
    """``write_commit``, returning the commit as read back and checked (its closure is known
    without reading its manifests again: the ref move's gc fence checks it as it stands)."""
    _check_some_slots(len(shard_ids))
    check_parent(store, parent)
    shards = [store.shard(s) for s in shard_ids]
    groups: dict[str, Any] = {}
    entries: list[TensorEntry] = []
    algorithms = {s.algorithm for s in shards if s.groups or s.torch_optimizer is not None}
    for s in shards:
        for g in s.groups:
            if groups.setdefault(g.name, g) != g:
                raise StateMismatch(f"slots disagree on the hyperparameters of optimizer group {g.name!r}")
        entries.extend(s.entries)
    if len(algorithms) > 1:
        raise StateMismatch(f"slots use different optimizer algorithms: {sorted(algorithms)}")
    algorithm = algorithms.pop() if algorithms else "none"
    optimizer = OptimizerSpec(
        algorithm=algorithm, groups=tuple(groups[k] for k in sorted(groups)), torch_optimizer=torch_union(shards)
    )
    config_id = _config_id(store, info.config, write=write_config)
    layout = tuple(
        SlotLayout(slot=i, shard=sid, tensors=tuple(e.name for e in s.entries))
        for i, (sid, s) in enumerate(zip(shard_ids, shards))
    )
    extras = tuple(sorted(extras, key=lambda x: x.key))
    version = max(s.version for s in shards)
    root = learned_root(
        step=info.step,
        data_cursor=info.data_cursor,
        config=config_id,
        optimizer=optimizer,
        entries=entries,
        extras=extras,
        bands=banded(version),
    )
    commit = CommitManifest(
        version=version,
        job=info.job,
        schedule=info.schedule,
        profile=info.profile,
        config=config_id,
        optimizer=optimizer,
        step=info.step,
        data_cursor=info.data_cursor,
        layout=layout,
        learned_root=root,
        parent=parent,
        transition=info.transition,  # type: ignore[arg-type]
        extras=extras,
    )
    cid = store.put_manifest(commit)
    store.sync()
    # every rule holds before anyone is told the id: the commit read back, with the shard
    # manifests read back above (by id: a full id is never taken for a ref name)
    lc = read_commit(store, cid, None, shards_read=dict(zip(shard_ids, shards)))
    assert lc is not None  # with found=None every problem raises
    return lc


def save_slots(
    store: Store,
    states: list[SlotState],
    *,
    info: CommitInfo,
    ref: str | None = "main",
    parent: str | None = AUTO,
    threads: int = WRITE_THREADS,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Commit several slots' states (and commit-wide ``extra``) from one process and move ``ref`` (None: leave refs alone)."""
    started = time.time()
    _check_some_slots(len(states))
    if ref is not None:
        check_ref_name(ref)
    check_info(info)
    current = store.ref(ref) if ref is not None else None
    if parent is AUTO:
        parent = current
    check_parent(store, parent)  # before any object is written
    n = len(states)
    for s in states:  # a step below an Adam age is refused before the first object (SPEC.md §9, §19.2)
        check_cursors(s, info)
    extras = write_extras(store, capture_extras(extra), threads=threads)  # made durable by write_shard's barrier
    put_config(store, info)  # once for the commit (SPEC.md §15), made durable by write_shard's barrier
    shard_ids = [
        write_shard(store, s, info=info, parent=parent, slot=i, slots=n, threads=threads, write_config=False)
        for i, s in enumerate(states)
    ]
    lc = write_loaded_commit(store, shard_ids, info=info, parent=parent, extras=extras, write_config=False)
    cid = lc.id
    if ref is not None:  # the fence checks the closure just written and read back (no manifest read again)
        store.set_ref(ref, cid, expected=current, needs=commit_closure(lc).ids())
    store.write_journal(
        cid, {"time": started, "seconds": time.time() - started, "host": socket.gethostname(), "pid": os.getpid()}
    )
    return cid


def save(
    store: Store,
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    optimizer: Any = None,
    *,
    step: int,
    ref: str | None = "main",
    job: str = "default",
    config: Mapping[str, Any] | None = None,
    data_cursor: int | None = None,
    rng: bool = True,
    parent: str | None = AUTO,
    transition: str = "train",
    group_names: list[str] | None = None,
    threads: int = WRITE_THREADS,
    extra: Mapping[str, Any] | None = None,
    slot_extra: Mapping[str, Any] | None = None,
    profile: str | None = None,
) -> str:
    """Save a model's parameters and buffers (and optimizer, RNG, data cursor) as a one-slot commit; return its id.

    ``extra``: commit-wide objects with ``state_dict()`` (schedulers, scalers); ``slot_extra``: the slot's own.
    ``profile``: the numerical profile to record (a trainer's); default: the floating dtypes the tensors hold.
    """
    call = SaveCall.of(locals())
    return save_slots(
        store, [call.state], info=call.info, ref=call.ref, parent=call.parent, threads=call.threads, extra=call.extra
    )


@dataclass(frozen=True)
class SaveCall:
    """One call of ``save`` taken apart: the slot it captures now and how to commit it.

    ``save``'s signature is the one list of its keywords: ``AsyncSaver.save`` binds its
    arguments against it (``bind``), so the two cannot drift apart.
    """

    info: CommitInfo
    state: SlotState
    ref: str | None
    parent: str | None
    threads: int
    extra: Mapping[str, Any] | None

    @classmethod
    def of(cls, a: Mapping[str, Any]) -> SaveCall:
        """From ``save``'s bound arguments (every keyword present)."""
        state = capture(a["model"], a["optimizer"], rng=a["rng"], group_names=a["group_names"], extra=a["slot_extra"])
        profile = a["profile"]
        if profile is None:  # no trainer named one: the floating dtypes the tensors hold
            profile = tensor_profile(dtype_name(t.dtype, n) for n, t in state.tensors.items())
        info = CommitInfo(
            step=a["step"],
            job=a["job"],
            profile=profile,
            config=a["config"],
            data_cursor=a["data_cursor"],
            transition=a["transition"],
        )
        return cls(info, state, a["ref"], a["parent"], a["threads"], a["extra"])

    @classmethod
    def bind(cls, store: Store, model: Any, optimizer: Any = None, **options: Any) -> SaveCall:
        """Check ``options`` against ``save``'s keywords (TypeError naming an unknown or missing
        one, as a call of ``save`` would), fill in its defaults, and capture."""
        bound = inspect.signature(save).bind(store, model, optimizer, **options)
        bound.apply_defaults()
        return cls.of(bound.arguments)
