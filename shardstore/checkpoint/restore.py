"""Restoring a commit into live training state, in place (SPEC.md §16, §16.1, §19.2).

::

    shardstore.restore(store, "main", model, optimizer, extra={"scheduler": sched})

A restore is three phases over one plan type (``state.plan``: a ``RestorePlan`` of
``ReadItem``\\ s, as torch.distributed.checkpoint's ``LoadPlan`` is DCP's):

1. **plan**: ``load_commit`` resolves the target and checks the commit and its shard
   manifests; then every part of the caller's state is matched against it and planned —
   the model's tensors (by name, whatever layout wrote them, ``restore_match``; dtype and
   shape), the config and RNG objects (read and checked), the optimizer (Adam's canonical
   form: ``optim.plan_adam_restore``; any other torch optimizer: ``torch_optim.plan_torch_restore``;
   a wrapper's optimizers each on their own), the extras (``extras.plan_extras_restore``).
   Each part's plan is a ``RestorePlan``; they add up to one. A mismatch is refused here,
   before anything of the caller's is written.
2. **read** (``read_plan``): every object's size is checked before the first byte lands, then
   each destination is filled from the blocks it overlaps (a DTensor: its local slices), every
   block verified as it lands. With ``group=`` (the ranks of a process group restoring
   together) each block is read once in the group and its pieces sent to the ranks that need
   them (``sharded.read_exchange``, SPEC.md §16.2).
3. **install**: the plan's installs, in order: the optimizer state, the RNG, the extras.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ..errors import StateMismatch, TensorMismatch
from ..format.grid import check_reads, read_parts, run_reads
from ..format.manifest import MAX_MANIFEST_BYTES, decode_config
from ..format.rng import MAX_RNG_BYTES, check_rng, restore_rng
from ..format.tensors import dtype_name
from ..sharded.placement import part_views
from ..sharded.read_exchange import grouped, read_group
from ..state.extras import plan_extras_restore
from ..state.module import named_state, unwrap_module
from ..state.optim import plan_adam_restore
from ..state.plan import ReadItem, RestorePlan
from ..state.restore_match import RestoreMatch, match_names
from ..state.torch_optim import plan_torch_restore, use_torch_form
from ..state.wrapped import inner_optimizers, split_group_names
from ..store import Store
from ..verification.commits import LoadedCommit, load_commit

__all__ = ["Restored", "restore", "read_plan"]


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
    """Tensor bytes read (and verified): whole blocks overlapping this process's slices (SPEC.md §5.1),
    an object several blocks or tensors name read once; with ``group=``, the blocks this rank read
    for the group (§16.2)."""
    skipped: list[str] = field(default_factory=list)  # strict=False: commit tensors the model does not hold
    missing: list[str] = field(
        default_factory=list
    )  # strict=False: model tensors the commit does not hold (left as they were)


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
    group: Any = None,
) -> Restored:
    """Restore commit ``target`` into an already-built model (and optimizer), in place, by name.

    Only tensors the model owns (non-meta parameters and persistent buffers) are read,
    whatever layout wrote them (a data-parallel wrapper: the module it wraps, ``unwrap_module``); every byte read is verified. DTensor parameters and moments
    (FSDP2, tensor parallelism, any mesh) are filled in their local slices, from the blocks
    those overlap (SPEC.md §5.1). ``strict`` (SPEC.md §16.1, ``restore_match``): every owned tensor
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

    ``group``: a process group whose ranks restore together, each calling this with its own
    model (collective): each block any of them needs is read and verified once in the group,
    by one rank that needs it, and its pieces sent to the others (SPEC.md §16.2), so a rank
    reads about its share instead of every block its slices overlap. A rank whose plan fails
    still takes part, and every rank raises (its type and message); a missing or wrong-sized
    object is refused on every rank before a byte lands on any; a corrupt one fails every rank
    part way, like a restore on its own (repeat it). ``Restored.bytes_read`` is then this
    rank's share of the reads. The commit's manifests are read once in the group too, ``target``
    resolved by group rank 0 (``load_commit``'s ``group``, SPEC.md §16.3). None, or a group of
    one process: the restore on its own, above.
    """
    # 1. plan: everything this restore needs besides tensor bytes is read and checked first, so
    # that a bad config, RNG object or optimizer is refused before a byte lands in the caller's
    # tensors (SPEC.md §16, §19.2)
    failure: Exception | None = None
    try:
        lc = load_commit(store, target, group=group)  # in a group: its manifests read once in it (SPEC.md §16.3)
        model = unwrap_module(model)  # a data-parallel wrapper: the module it wraps (``state.module``)
        matched = _match_tensors(lc, model, slot, strict)
        names = sorted(matched.targets)
        config = (
            None if lc.commit.config is None else decode_config(store.get(lc.commit.config, limit=MAX_MANIFEST_BYTES))
        )
        rng_states = _rng_states(store, lc, rng, slot)
        plan = RestorePlan.of(
            [
                _tensor_plan(lc, matched.targets, names),
                *(
                    []
                    if optimizer is None
                    else _optimizer_plans(store, lc, optimizer, matched.targets, names, group_names)
                ),
                plan_extras_restore(store, lc.commit.extras, extra, f"commit {lc.id}"),
                _slot_extras_plan(store, lc, slot, slot_extra),
                # last: an extra's load may draw random numbers (a restored loader makes its iterator, ``stateful``)
                RestorePlan(installs=(partial(restore_rng, rng_states),) if rng_states else ()),
            ]
        )
    except Exception as e:  # noqa: BLE001 - in a group: still take part, so every rank raises, none waits
        if not grouped(group):
            raise
        failure, plan = e, RestorePlan()
    # 2. read: straight into the destinations, every byte hashed
    nread = read_plan(store, plan, threads, group=group, failure=failure)
    plan.install()  # 3. install
    return Restored(
        lc.id,
        lc.commit.step,
        lc.commit.data_cursor,
        config,
        names,
        bool(rng_states),  # a slot saved with rng=False has none
        sorted(extra or {}),
        sorted(slot_extra or {}),
        nread,
        matched.skipped,
        matched.missing,
    )


def read_plan(
    store: Store,
    plan: RestorePlan,
    threads: int,
    *,
    sizes_checked: bool = False,
    group: Any = None,
    failure: BaseException | None = None,
) -> int:
    """Fill each read item's destination (its local slice, for a DTensor) from the blocks its
    payload has there (a single object: all of it); return the bytes read. Every block's size
    is checked before the first is read (a wrong-sized one is refused with nothing written),
    and every block is verified as it lands. ``sizes_checked``: the caller has already checked
    the size of every object the plan reads (``check_stored_all``, before allocating fresh
    destinations for them), so it is not asked again: one size query per object (a HEAD on S3).

    ``group`` (of more than one process): collective, a restore by exchange (SPEC.md §16.2,
    ``sharded.read_exchange``): each block read once in the group, its pieces sent to the ranks
    needing them; the bytes returned are those this rank read. ``failure``: this rank could not
    plan (its plan is then ignored); it still takes part, and every rank raises it."""
    if grouped(group):
        items = []
        try:
            if failure is not None:
                raise failure
            for item in plan.reads:
                dtype = dtype_name(item.dest.dtype, item.what)
                views = part_views(item.dest, item.what)
                items.append((item.payload, dtype, tuple(item.dest.shape), views, item.what))
        except Exception as e:  # noqa: BLE001 - still take part in the exchange, so every rank raises
            failure = e
        return read_group(store, items, threads, group, failure=failure)
    if failure is not None:
        raise failure
    jobs = []
    for item in plan.reads:  # a DTensor's local tensor may be several boxes (SPEC.md §Slices on the grid)
        shape = tuple(item.dest.shape)
        dtype = dtype_name(item.dest.dtype, item.what)
        jobs += read_parts(store, item.payload, dtype, shape, part_views(item.dest, item.what), item.what)
    if not sizes_checked:
        check_reads(store, jobs, threads=max(threads, 16))  # a size query each (a HEAD on S3), before any byte lands
    # each object once, however many blocks or tensors name it: a peer's copy is handed to one
    # read and let go (SPEC.md §19.3), so a second read of it would go to the store
    return run_reads(jobs, threads=threads, once_per_object=True)


def _match_tensors(lc: LoadedCommit, model: Any, slot: int | None, strict: bool) -> RestoreMatch:
    """The model's owned tensors matched to the commit's by name (``restore_match``), each of
    the commit's dtype and shape; raise on any mismatch."""
    entries = lc.entries()
    owned = named_state(model)[0]  # owned parameters and persistent buffers (SPEC.md §Buffers)
    if not isinstance(model, torch.nn.Module):
        covered = None  # a name -> tensor mapping is a declared share: it covers its own names
    else:
        covered = set(entries) if slot is None else {e.name for e in lc.shards[_slot(lc, slot, "tensors")].entries}
    matched = match_names(model, owned, entries, covered, strict=strict, commit_id=lc.id)
    for n, t in sorted(matched.targets.items()):  # under the commit's names (a compiled model's, an old commit's)
        e = entries[n]
        if dtype_name(t.dtype, n) != e.dtype or tuple(t.shape) != tuple(e.shape):
            raise TensorMismatch(
                f"tensor {n!r}: commit {lc.id} holds {e.dtype}{list(e.shape)}, the model has "
                f"{dtype_name(t.dtype, n)}{list(t.shape)}"
            )
    return matched


def _tensor_plan(lc: LoadedCommit, targets: Mapping[str, torch.Tensor], names: list[str]) -> RestorePlan:
    """The model's tensors: read in place, nothing to install."""
    entries = lc.entries()
    return RestorePlan(tuple(ReadItem(entries[n].param, targets[n], f"tensor {n!r}") for n in names))


def _rng_states(store: Store, lc: LoadedCommit, rng: bool | None, slot: int | None) -> dict[str, Any] | None:
    """The RNG states to restore, read and checked (None: leave the process's RNG alone)."""
    if not (rng or rng is None and (slot is not None or len(lc.shards) == 1)):  # None: when the slot is known (§16.1)
        return None
    states = {r.kind: store.get(r.object, limit=MAX_RNG_BYTES) for r in lc.shards[_slot(lc, slot, "RNG")].rng}
    check_rng(states)
    return states


def _slot_extras_plan(
    store: Store, lc: LoadedCommit, slot: int | None, slot_extra: Mapping[str, Any] | None
) -> RestorePlan:
    """The slot's own extras (``slot_extra``), from slot ``slot`` (or the only one)."""
    if not slot_extra:
        return RestorePlan()
    own = _slot(lc, slot, "slot_extra")
    return plan_extras_restore(store, lc.shards[own].extras, slot_extra, f"commit {lc.id}, slot {own}")


def _optimizer_plans(
    store: Store,
    lc: LoadedCommit,
    optimizer: Any,
    targets: dict[str, torch.Tensor],
    names: list[str],
    group_names: list[str] | None,
) -> list[RestorePlan]:
    """The optimizer's restore, checked before any read: a wrapper's optimizers each get
    their own groups (``g0``, ``g1``, ... counted across them) and parameters (SPEC.md §9.5)."""
    inner = inner_optimizers(optimizer)
    _check_state_held(lc, inner, targets, names)
    plans = []
    for o, gn in zip(inner, split_group_names(inner, group_names)):
        own = names
        if len(inner) > 1:  # each restores the parameters it holds
            held = {id(p) for g in o.param_groups for p in g["params"]}
            own = [n for n in names if id(targets[n]) in held]
        own_targets = {n: targets[n] for n in own}
        if use_torch_form(lc.id, lc.commit.optimizer, o):
            plans.append(plan_torch_restore(store, lc.commit.optimizer, lc.entries(), o, own_targets, gn, lc.id))
        else:
            plans.append(plan_adam_restore(lc, own, o, own_targets, gn))
    return plans


def _check_state_held(lc: LoadedCommit, inner: list[Any], targets: dict[str, torch.Tensor], names: list[str]) -> None:
    """StateMismatch if the commit holds optimizer state of a tensor this restore fills that none of
    the torch optimizers holds (a param group added after they were built, say): each plan covers
    the tensors its optimizer holds, so that state would be dropped, or (Adam's install, by name)
    put into ``optimizer.state`` for a tensor in none of its groups, which breaks its ``state_dict()``.
    torch's ``load_state_dict`` refuses this too. A tensor the commit holds no state of (a frozen
    one) is not refused; an optimizer with ``state_import`` takes what it holds by name."""
    if not all(isinstance(o, torch.optim.Optimizer) for o in inner):
        return
    held = {id(p) for o in inner for g in o.param_groups for p in g["params"]}
    entries = lc.entries()
    for n in names:
        e = entries[n]
        has = (e.optim is not None and (e.optim.exp_avg is not None or e.optim.age > 0)) or (
            e.state is not None and bool(e.state.tensors or e.state.scalars)
        )
        if has and id(targets[n]) not in held:
            group = e.optim.group if e.optim is not None else e.state.group  # type: ignore[union-attr]
            raise StateMismatch(
                f"commit {lc.id} holds optimizer state of tensor {n!r} (group {group!r}), which the optimizer does "
                "not hold in any param group: restoring would drop it; build the optimizer with the saving run's "
                "param groups (add_param_group), or restore with optimizer=None"
            )


def _slot(lc: LoadedCommit, slot: int | None, what: str) -> int:
    """The slot whose RNG or own extras to restore: ``slot``, or the only slot of a 1-slot commit."""
    if slot is None and len(lc.shards) != 1 or slot is not None and slot not in lc.shards:
        raise StateMismatch(f"commit {lc.id} has {len(lc.shards)} slots; pass slot= to restore {what}")
    return 0 if slot is None else slot
