"""The commit protocol over a ``torch.distributed`` process group (SPEC.md §15).

Each rank is one slot. Phases, each closed by a collective so that every rank learns of
any failure instead of hanging:

1. the coordinator (rank 0) reads the ref's current commit, the parent, and broadcasts it;
   it also writes the model config object, once for the commit: every rank names it in its
   shard manifest by the id of the same bytes, without writing it (on S3, N ranks writing one
   present key would cost 3 N requests on that key);
2. every rank writes its objects and shard manifest and all ranks gather the shard ids; first
   the coordinator writes its RNG objects and broadcasts their ids, and a rank whose RNG object
   has one of them names it without writing it (torch's generator is seeded alike on every rank
   where DTensor is used, so its object is the same on every rank: one write, not N);
3. the coordinator writes the commit manifest and broadcasts its id;
4. every rank reads the commit manifest back (not every shard manifest: the coordinator
   checked those in phase 3), checks that its own slot names its own shard, and
   acknowledges the commit id; the coordinator checks that all acknowledgements agree;
5. only then does the coordinator move the ref (compare-and-swap), and says so.

Ids travel as 32-byte tensors (never pickled objects), with one status byte in front.
``agree_on_commit`` is the recovery counterpart: every rank resolves the target and all
must name the same commit, or every rank raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import CommitProtocolError
from ..format.manifest import ExtraEntry
from ..sharded.dtensor import write_dtensors
from ..state.extras import capture_extras, write_extras
from ..state.slot import SlotState, capture, wants_torch_form
from ..store import Store
from ..store.tensors import WRITE_THREADS
from .info import CommitInfo, check_info
from .slots import AUTO, put_config, write_commit, write_shard

__all__ = ["save_distributed", "commit_state", "acknowledge", "agree_on_commit"]

_OK, _FAIL, _NONE = 1, 2, 3
#: The most RNG object ids the coordinator shares (``_shared_rng``): python, numpy, torch and up to
#: 13 CUDA devices' states; a slot's other RNG objects are written by the slot, as without sharing.
_SHARED_RNG = 16
#: The phases of ``save_distributed``; before "move ref" completes nobody has moved the ref.
_COMMIT_PHASES = ("read parent", "write shard", "write commit", "acknowledge", "move ref")


def _device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pack(status: int, oid: str | None) -> torch.Tensor:
    raw = bytes([status]) + (bytes.fromhex(oid) if oid else bytes(32))
    # A tensor that owns its memory: one made with `torch.frombuffer` keeps a Python object
    # alive, and the backend's worker thread that drops the last reference after the
    # collective must then take the GIL, which aborts the process if that happens while the
    # interpreter is shutting down ("terminate called without an active exception").
    return torch.tensor(list(raw), dtype=torch.uint8)


def _unpack(t: torch.Tensor) -> tuple[int, str | None]:
    raw = bytes(t.cpu().numpy().tobytes())
    return raw[0], (raw[1:].hex() if raw[0] == _OK else None)


def _gather(group: Any, status: int, oid: str | None) -> list[tuple[int, str | None]]:
    dev = _device(group)
    mine = _pack(status, oid).to(dev)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [_unpack(t) for t in out]


def _broadcast(group: Any, status: int, oid: str | None) -> tuple[int, str | None]:
    dev = _device(group)
    t = _pack(status, oid).to(dev)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return _unpack(t)


def torch_form_anywhere(group: Any, optimizer: Any) -> bool:
    """Whether any rank's optimizer is an Adam with param group keys of its own (``wants_torch_form``),
    so that every rank holds its Adam in the torch form: a commit holds one optimizer form, and a
    stage whose Adam has such a key and one whose Adam has none would otherwise write slots of two
    forms, refused when the commit is written. One int each, every rank of ``group`` calls it."""
    t = torch.tensor([int(wants_torch_form(optimizer))], dtype=torch.int32).to(_device(group))
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    except Exception as e:  # a peer died or the group timed out: reported as the protocol's phases report it
        raise CommitProtocolError(
            f"commit protocol phase 'agree on the optimizer form' (before 'read parent'): lost the process group "
            f"({type(e).__name__}: {e}); nothing was written and the ref was not moved"
        ) from e
    return bool(t.item())


def _phase(
    group: Any, name: str, fn: Callable[[], str | None]
) -> tuple[list[tuple[int, str | None]], BaseException | None]:
    err: BaseException | None = None
    oid = None
    try:
        oid = fn()
        status = _OK if oid else _NONE
    except Exception as e:  # reported to every rank, then re-raised below
        err, status = e, _FAIL
    try:
        got = _gather(group, status, oid)
    except Exception as e:  # a peer died or the group timed out: the collective itself failed
        if name == "move ref" and status == _OK and oid is not None:
            where = f"; commit {oid} was complete (and the ref, if any, moved) before the group was lost"
        elif name == "move ref":
            where = "; the ref may or may not have moved: read it to know"
        elif name in _COMMIT_PHASES:
            where = "; the ref was not moved"
        else:
            where = ""
        raise CommitProtocolError(
            f"commit protocol phase '{name}': lost the process group ({type(e).__name__}: {e}){where}"
        ) from e
    failed = [r for r, (s, _) in enumerate(got) if s == _FAIL]
    if failed:
        msg = f"commit protocol phase '{name}' failed on rank(s) {failed}; the ref was not moved"
        raise CommitProtocolError(msg + (f": {err}" if err else "")) from err
    return got, err


def _shared_rng(group: Any, ids: list[str]) -> frozenset[str]:
    """Broadcast the coordinator's RNG object ids (at most ``_SHARED_RNG``; ``ids`` is read on the
    coordinator only) as one fixed-size tensor of raw digests, never a pickled object; every rank
    of ``group`` calls it, and every rank returns the coordinator's ids."""
    raw = bytes([min(len(ids), _SHARED_RNG)]) + b"".join(bytes.fromhex(i) for i in ids[:_SHARED_RNG])
    raw += bytes(1 + 32 * _SHARED_RNG - len(raw))
    t = torch.tensor(list(raw), dtype=torch.uint8).to(_device(group))
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    got = bytes(t.cpu().numpy().tobytes())
    return frozenset(got[1 + 32 * i : 33 + 32 * i].hex() for i in range(min(got[0], _SHARED_RNG)))


def save_distributed(
    store: Store,
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    optimizer: Any = None,
    *,
    info: CommitInfo,
    group: Any = None,
    ref: str | None = "main",
    parent: str | None = AUTO,
    rng: bool = True,
    group_names: list[str] | None = None,
    threads: int = WRITE_THREADS,
    extra: Mapping[str, Any] | None = None,
    slot_extra: Mapping[str, Any] | None = None,
) -> str:
    """Save this rank's slot and take part in one commit; every rank returns the same commit id.

    ``slot_extra``: this rank's own stateful objects (its data loader), in its shard manifest.
    ``extra``: commit-wide ones (a scheduler, a scaler): rank 0's are committed, and every
    rank that passes ``extra`` must pass the same state, checked when it acknowledges the
    commit (so a rank's extras are never dropped silently; SPEC.md §Extras).

    DTensor parameters and moments (FSDP2, tensor parallelism) are written as canonical
    blocks by the block exchange (``dtensor.write_dtensors``, SPEC.md §Block exchange):
    never gathered, each block hashed and written by one rank.
    """
    torch_form = torch_form_anywhere(group, optimizer)
    return commit_state(
        store,
        lambda: capture(model, optimizer, rng=rng, group_names=group_names, extra=slot_extra, torch_form=torch_form),
        info=info, group=group, ref=ref, parent=parent, threads=threads, extra=extra,
    )  # fmt: skip


def commit_state(
    store: Store,
    state_fn: Callable[[], SlotState],
    *,
    info: CommitInfo,
    group: Any = None,
    ref: str | None = "main",
    parent: str | None = AUTO,
    threads: int = WRITE_THREADS,
    extra: Mapping[str, Any] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> str:
    """``save_distributed`` of the slot state ``state_fn()`` returns (called inside the
    commit protocol; AsyncSaver passes its snapshot).

    ``on_phase(name)``, if given, is called on this rank as each phase begins (read parent,
    write shard, write commit, acknowledge, move ref; SPEC.md §15), for progress reports
    and fault injection; an exception it raises fails that phase on every rank.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    coordinator = rank == 0

    def read_parent() -> str | None:
        check_info(info)  # arguments before the first write (SPEC.md §19.2)
        if put_config(store, info) is not None:  # once, before any shard manifest names it (SPEC.md §15)
            store.sync()
        if parent is not AUTO:
            return parent
        return store.ref(ref) if ref is not None else None

    def begin(name: str, fn: Callable[[], str | None]) -> Callable[[], str | None]:
        def run() -> str | None:
            if on_phase is not None:
                on_phase(name)
            return fn()

        return run

    got, _ = _phase(group, "read parent", begin("read parent", read_parent if coordinator else (lambda: None)))
    chosen = got[0][1]
    expected_ref = store.ref(ref) if (coordinator and ref is not None) else None

    mine: list[tuple[ExtraEntry, ...]] = []

    def shard() -> str:  # capture inside the phase: a state one rank cannot store fails every rank, naming it
        try:
            if on_phase is not None:  # here, not in ``begin``: a rank it fails still joins the collectives below
                on_phase("write shard")
            state, failure = state_fn(), None
        except Exception as e:  # noqa: BLE001 - still joins the block exchange below, then re-raised
            state, failure = None, e
        ids: list[str] = []
        if coordinator and state is not None:
            try:  # the coordinator's RNG objects, durable before any rank learns their ids (SPEC.md §15)
                kinds = sorted(state.rng, key=lambda k: (k.startswith("cuda:"), k))  # CUDA devices' last
                ids = [store.put(state.rng[k]) for k in kinds][:_SHARED_RNG]
                store.sync()
            except Exception as e:  # noqa: BLE001 - still joins the collectives below, then re-raised
                state, failure, ids = None, e, []
        shared = _shared_rng(group, ids)  # a collective: every rank, whatever happened above
        state = write_dtensors(store, state, group=group, threads=threads, failure=failure)  # a collective
        mine.append(
            write_extras(store, capture_extras(extra), threads=threads)
        )  # made durable by write_shard's barrier
        return write_shard(
            store,
            state,
            info=info,
            parent=chosen,
            slot=rank,
            slots=world,
            threads=threads,
            write_config=False,
            written=shared,
        )

    got, _ = _phase(group, "write shard", shard)  # calls on_phase itself
    shard_ids = [oid for _, oid in got]
    my_shard = shard_ids[rank]

    got, _ = _phase(
        group,
        "write commit",
        begin(
            "write commit",
            (
                lambda: write_commit(
                    store, [s for s in shard_ids if s], info=info, parent=chosen, extras=mine[0], write_config=False
                )
            )
            if coordinator
            else (lambda: None),
        ),
    )
    cid = got[0][1]
    assert cid is not None

    def ack() -> str:
        return acknowledge(store, cid, slot=rank, shard=my_shard, extras=mine[0] if extra is not None else None)

    got, _ = _phase(group, "acknowledge", begin("acknowledge", ack))
    acks = {oid for _, oid in got}
    if acks != {cid}:
        raise CommitProtocolError(
            f"slots acknowledged different commits {sorted(a or '?' for a in acks)}; the ref was not moved"
        )

    def move_ref() -> str:
        if ref is not None:
            store.set_ref(ref, cid, expected=expected_ref)
        return cid

    _phase(group, "move ref", begin("move ref", move_ref if coordinator else (lambda: None)))
    return cid


def acknowledge(store: Store, cid: str, *, slot: int, shard: str, extras: tuple[ExtraEntry, ...] | None = None) -> str:
    """Phase 4 on one rank: read commit ``cid``'s manifest back (verified against its id), check
    that it names ``shard`` for ``slot`` and, if given, that its commit-wide extras are
    ``extras``; return ``cid``. CommitProtocolError otherwise.

    The commit manifest alone: the coordinator checked every rule on every shard manifest
    before naming the commit (phase 3), so a rank reads O(slots + tensors), not every slot's
    shard manifest (N ranks doing that would read N^2 of them; SPEC.md §15)."""
    commit = store.commit(cid)
    named = next((lay.shard for lay in commit.layout if lay.slot == slot), None)
    if named != shard:
        raise CommitProtocolError(f"commit {cid} does not name this rank's shard {shard} for slot {slot}")
    if extras is not None and commit.extras != extras:
        have, want = [x.key for x in extras], [x.key for x in commit.extras]
        raise CommitProtocolError(
            f"rank {slot}'s commit-wide extras {have} differ from rank 0's {want} in commit {cid}"
        )
    return cid


def agree_on_commit(store: Store, target: str, *, group: Any = None) -> str:
    """Resolve ``target`` on every rank; all must name the same commit, else every rank raises."""

    def resolve() -> str:
        return store.resolve(target)

    try:
        got, _ = _phase(group, "resolve restore target", resolve)
    except CommitProtocolError:
        raise
    ids = [oid for _, oid in got]
    if len(set(ids)) != 1:
        raise CommitProtocolError(f"workers name different commits for {target!r}: {ids}; refusing to restore")
    return ids[0]  # type: ignore[return-value]
