"""Saving and restoring training state as commits (SPEC.md §Write ordering, §Read ordering).

The common case is two calls::

    commit_id = shardstore.save(store, model, optimizer, step=step, extra={"scheduler": sched})
    shardstore.restore(store, "main", model, optimizer, extra={"scheduler": sched})

Parameters and persistent buffers (``module_state``), Adam/AdamW (``optim``) or any torch
optimizer (``torch_optim``), and extras: objects with ``state_dict()`` (``extras``).

Underneath, a save is: ``capture`` what one slot owns (no copy), ``write_shard`` (objects,
then a durability barrier, then the shard manifest), ``write_commit`` (the commit manifest,
whose id is the full root), then the ref moves by compare-and-swap. ``restore`` resolves
a target, verifies the commit and its shard manifests, and copies only the tensors the
given model owns (by name, whatever layout wrote them) out of verified objects.
"""

from __future__ import annotations

import inspect
import os
import socket
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import CursorError, ObjectNotFound, StateMismatch, TensorMismatch
from ..format.grid import check_reads, on_bands, payload_blocks, put_payloads, read_parts
from ..format.manifest import (
    MAX_MANIFEST_BYTES,
    CommitManifest,
    ExtraEntry,
    GroupSpec,
    OptimEntry,
    OptimizerSpec,
    Payload,
    RngEntry,
    ShardManifest,
    SlotLayout,
    TensorEntry,
    banded,
    decode_config,
    encode,
    encode_config,
    shard_version,
    tensor_payloads,
)
from ..format.names import check_ref_name
from ..format.rng import MAX_RNG_BYTES, check_rng, restore_rng
from ..format.roots import learned_root
from ..format.tensors import dtype_name, hash_bytes
from ..sharded.placement import part_views
from ..state.extras import capture_extras, plan_extras_restore, write_extras
from ..state.module import named_state, tensor_profile, unwrap_module
from ..state.optim import (
    ParamOpt,
    _install_torch,
    _plan_optim,
    _probe_torch,
    group_spec,
    into_export,
)
from ..state.restore_match import match_names
from ..state.slot import SlotState, capture, slot_tensors
from ..state.torch_optim import (
    param_state,
    plan_torch_restore,
    state_objects,
    torch_spec,
    torch_union,
    use_torch_form,
)
from ..state.wrapped import inner_optimizers, split_group_names
from ..store import Store
from ..verification.commits import LoadedCommit, load_commit, shard_problems
from .info import CommitInfo, check_info, check_parent

__all__ = [
    "CommitInfo",
    "check_info",
    "check_parent",
    "Restored",
    "write_shard",
    "write_shard_entries",
    "write_commit",
    "save_slots",
    "save",
    "SaveCall",
    "restore",
    "read_into",
    "AUTO",
]

AUTO: Any = "auto"
"""Sentinel: take the parent from the ref being moved."""


@dataclass
class Restored:
    """What ``restore`` did."""

    commit: str
    step: int
    data_cursor: int | None
    config: dict[str, Any] | None
    tensors: list[str]
    rng_restored: bool
    extras: list[str] = field(default_factory=list)  # commit-wide extras loaded
    slot_extras: list[str] = field(default_factory=list)  # the slot's own extras loaded
    bytes_read: int = 0
    """Tensor bytes read (and verified): whole blocks overlapping this process's slices (SPEC.md §5a)."""
    skipped: list[str] = field(default_factory=list)  # strict=False: commit tensors the model does not hold
    missing: list[str] = field(
        default_factory=list
    )  # strict=False: model tensors the commit does not hold (left as they were)


def _config_id(store: Store, config: Mapping[str, Any] | None) -> str | None:
    return None if config is None else store.put(encode_config(dict(config)))


def write_shard(
    store: Store, state: SlotState, *, info: CommitInfo, parent: str | None, slot: int, slots: int, threads: int = 2
) -> str:
    """Write one slot's objects, then (after a durability barrier) its shard manifest; return its id."""
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
    rng = tuple(RngEntry(kind=k, object=store.put(v)) for k, v in sorted(state.rng.items()))
    extras = write_extras(store, state.extra, threads=threads)
    config_id = _config_id(store, info.config)
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
    naming the same objects, SPEC.md §15a): ``entries`` are taken as they are
    (sorted by name here), ``rng`` maps an RNG kind to an existing object id. Every named
    object must already be present (checked by existence; no payload byte is read), and
    the manifest must pass the shard rules before it is written. ``bands``: whether the
    entries' chunked payloads are on the row-band grid of versions 2-3 (pass
    ``banded(parent.version)`` for a transition of a stored commit, so every slot keeps its
    grid and version; None: judged from the payloads, which a payload valid on both grids
    leaves on the tile grid).
    """
    check_info(info)
    # every object a payload names: one id, or each block of a chunked payload (SPEC.md §5a)
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
    sid = store.put_manifest(shard)
    store.sync()
    return sid


def write_commit(
    store: Store, shard_ids: list[str], *, info: CommitInfo, parent: str | None, extras: tuple[ExtraEntry, ...] = ()
) -> str:
    """Write the commit manifest binding ``shard_ids`` (slot i = shard_ids[i]) and ``extras`` (written, durable); return its id."""
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
    config_id = _config_id(store, info.config)
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
    load_commit(store, cid)  # every rule holds before anyone is told the id
    return cid


def save_slots(
    store: Store,
    states: list[SlotState],
    *,
    info: CommitInfo,
    ref: str | None = "main",
    parent: str | None = AUTO,
    threads: int = 2,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Commit several slots' states (and commit-wide ``extra``) from one process and move ``ref`` (None: leave refs alone)."""
    started = time.time()
    if ref is not None:
        check_ref_name(ref)
    check_info(info)
    current = store.ref(ref) if ref is not None else None
    if parent is AUTO:
        parent = current
    check_parent(store, parent)  # before any object is written
    n = len(states)
    for s in states:  # a step below an Adam age is refused before the first object (SPEC.md §9, §19b)
        check_cursors(s, info)
    extras = write_extras(store, capture_extras(extra), threads=threads)  # made durable by write_shard's barrier
    shard_ids = [
        write_shard(store, s, info=info, parent=parent, slot=i, slots=n, threads=threads) for i, s in enumerate(states)
    ]
    cid = write_commit(store, shard_ids, info=info, parent=parent, extras=extras)
    if ref is not None:
        store.set_ref(ref, cid, expected=current)
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
    threads: int = 2,
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


def read_into(store: Store, reads: list[tuple[Payload, torch.Tensor, str]], threads: int) -> int:
    """Fill each destination (its local slice, for a DTensor) from the blocks its payload has
    there (a single object: all of it); return the bytes read. Every block's size is checked
    before the first is read (a wrong-sized one is refused with nothing written), and every
    block is verified as it lands."""
    jobs = []
    for payload, dest, what in reads:  # a DTensor's local tensor may be several boxes (SPEC.md §Slices on the grid)
        jobs += read_parts(
            store, payload, dtype_name(dest.dtype, what), tuple(dest.shape), part_views(dest, what), what
        )
    check_reads(store, jobs, threads=max(threads, 16))  # a size query each (a HEAD on S3), before any byte lands
    if threads <= 1 or len(jobs) <= 1:
        return sum(job() for job in jobs)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(lambda job: job(), jobs))


def restore(
    store: Store,
    target: str,
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    optimizer: Any = None,
    *,
    rng: bool | None = None,
    slot: int | None = None,
    strict: bool = True,
    group_names: list[str] | None = None,
    threads: int = 8,
    extra: Mapping[str, Any] | None = None,
    slot_extra: Mapping[str, Any] | None = None,
) -> Restored:
    """Restore commit ``target`` into an already-built model (and optimizer), in place, by name.

    Only tensors the model owns (non-meta parameters and persistent buffers) are read,
    whatever layout wrote them (a data-parallel wrapper: the module it wraps, ``unwrap_module``); every byte read is verified. DTensor parameters and moments
    (FSDP2, tensor parallelism, any mesh) are filled in their local slices, from the blocks
    those overlap (SPEC.md §5a). ``strict`` (SPEC.md §16a, ``restore_match``): every owned tensor
    is in the commit and every commit tensor the restore covers (all of them for a module, slot
    ``slot``'s with ``slot=``, a mapping's own names) is in the model, tied weights alike; False:
    restore what both hold, naming the rest in ``skipped`` / ``missing``. ``extra`` / ``slot_extra``:
    objects to load the commit-wide / the slot's own extras into, by key, each checked (like the
    optimizer) before any write. ``rng``: restore the RNG states of ``slot`` (default: the only
    slot of a 1-slot commit); None (the default) restores them when the slot is known and has
    any, True requires the slot to be known (StateMismatch for a multi-slot commit without
    ``slot=``), False leaves the process's RNG alone (``Restored.rng_restored`` says which); it is set
    last, after the extras are loaded (a restored loader makes its iterator, which may draw a seed).
    Bytes are read straight into the parameters and into the optimizer's existing moment
    tensors (``threads`` objects at a time: reads wait on the disk, so more than the cores;
    benchmarks/RESULTS.md, "design measurements", has the queue depth's figures) and hashed
    as they land. Every object's size is checked first: a missing or wrong-sized one is refused
    before any byte is written. Only a hash can tell an object of the right size is corrupt: if
    one raises, tensors read before it hold restored values and it may hold unverified bytes,
    so a failed restore must be repeated or abandoned, never trained from.
    """
    lc = load_commit(store, target)
    entries = lc.entries()
    model = unwrap_module(model)  # a data-parallel wrapper: the module it wraps (SPEC.md §Buffers)
    owned = named_state(model)[0]  # owned parameters and persistent buffers (SPEC.md §Buffers)
    if not isinstance(model, torch.nn.Module):
        covered = None  # a name -> tensor mapping is a declared share: it covers its own names
    else:
        covered = set(entries) if slot is None else {e.name for e in lc.shards[_slot(lc, slot, "tensors")].entries}
    matched = match_names(model, owned, entries, covered, strict=strict, commit_id=lc.id)
    targets = matched.targets  # under the commit's names (a compiled model's, an old commit's _orig_mod names)
    names = sorted(targets)
    for n in names:
        e, t = entries[n], targets[n]
        if dtype_name(t.dtype, n) != e.dtype or tuple(t.shape) != tuple(e.shape):
            raise TensorMismatch(
                f"tensor {n!r}: commit {lc.id} holds {e.dtype}{list(e.shape)}, the model has {dtype_name(t.dtype, n)}{list(t.shape)}"
            )
    # Everything this restore needs besides tensor bytes is read and validated first, so that
    # a bad config or RNG object is refused before a byte lands in the caller's tensors (§16).
    config = None if lc.commit.config is None else decode_config(store.get(lc.commit.config, limit=MAX_MANIFEST_BYTES))
    rng_states = None
    if rng or rng is None and (slot is not None or len(lc.shards) == 1):  # None: when the slot is known (SPEC.md §16a)
        s = _slot(lc, slot, "RNG")
        rng_states = {r.kind: store.get(r.object, limit=MAX_RNG_BYTES) for r in lc.shards[s].rng}
        check_rng(rng_states)
    reads = [(entries[n].param, targets[n], f"tensor {n!r}") for n in names]
    optim_plans = [] if optimizer is None else _plan_optimizers(store, lc, optimizer, targets, names, group_names)
    reads += [r for plan in optim_plans for r in plan.reads]
    extras_plan = plan_extras_restore(store, lc.commit.extras, extra, f"commit {lc.id}")
    own = _slot(lc, slot, "slot_extra") if slot_extra else 0
    slot_plan = plan_extras_restore(
        store, lc.shards[own].extras if slot_extra else (), slot_extra, f"commit {lc.id}, slot {own}"
    )
    reads += extras_plan.reads + slot_plan.reads
    nread = read_into(store, reads, threads)  # straight into the destinations, every byte hashed
    for plan in optim_plans:
        plan.install()
    loaded, slot_loaded = extras_plan.install(), slot_plan.install()
    if rng_states is not None:  # last: an extra's load may draw random numbers (a loader's new iterator, ``stateful``)
        restore_rng(rng_states)
    restored_rng = bool(rng_states)  # a slot saved with rng=False has none
    return Restored(
        lc.id,
        lc.commit.step,
        lc.commit.data_cursor,
        config,
        names,
        restored_rng,
        loaded,
        slot_loaded,
        nread,
        matched.skipped,
        matched.missing,
    )


@dataclass
class _OptimPlan:
    """One (inner) optimizer's checked restore: the reads that fill its state, then ``install``."""

    reads: list[tuple[Payload, torch.Tensor, str]]
    install: Callable[[], None]


def _plan_optimizers(
    store: Store,
    lc: LoadedCommit,
    optimizer: Any,
    targets: dict[str, torch.Tensor],
    names: list[str],
    group_names: list[str] | None,
) -> list[_OptimPlan]:
    """Plan the optimizer's restore, checked before any read: a wrapper's optimizers each get
    their own groups (``g0``, ``g1``, ... counted across them) and parameters (SPEC.md §9e)."""
    inner = inner_optimizers(optimizer)
    plans = []
    for o, gn in zip(inner, split_group_names(inner, group_names)):
        own = names
        if len(inner) > 1:  # each restores the parameters it holds
            held = {id(p) for g in o.param_groups for p in g["params"]}
            own = [n for n in names if id(targets[n]) in held]
        plans.append(_plan_optimizer(store, lc, o, {n: targets[n] for n in own}, own, gn))
    return plans


def _plan_optimizer(
    store: Store,
    lc: LoadedCommit,
    optimizer: Any,
    targets: dict[str, torch.Tensor],
    names: list[str],
    group_names: list[str] | None,
) -> _OptimPlan:
    if use_torch_form(lc.id, lc.commit.optimizer, optimizer):
        torch_plan = plan_torch_restore(
            store, lc.commit.optimizer, lc.entries(), optimizer, targets, group_names, lc.id
        )
        return _OptimPlan(torch_plan.reads, torch_plan.install)
    state, moment_reads = _plan_optim(lc, names, optimizer, targets)
    if hasattr(optimizer, "state_import"):
        return _OptimPlan(moment_reads, lambda: into_export(optimizer, state, [n for n in names if n in state.params]))
    _probe_torch(optimizer, targets, state, group_names)
    return _OptimPlan(moment_reads, lambda: _install_torch(optimizer, targets, state, group_names))


def _slot(lc: LoadedCommit, slot: int | None, what: str) -> int:
    """The slot whose RNG or own extras to restore: ``slot``, or the only slot of a 1-slot commit."""
    if slot is None and len(lc.shards) != 1 or slot is not None and slot not in lc.shards:
        raise StateMismatch(f"commit {lc.id} has {len(lc.shards)} slots; pass slot= to restore {what}")
    return 0 if slot is None else slot
