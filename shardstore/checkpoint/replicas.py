"""Peer replicas: each slot's committed objects held in a buddy's memory tier, and sent back
to a worker whose own tier lacks them (SPEC.md §19.3).

Slot ``i``'s buddies are slots ``i+1 .. i+N`` (mod the group's size; ``N`` replicas). Both
directions are one exchange, ``shift``: every rank of the group sends one offer to the rank
``d`` after it and receives one from the rank ``d`` before it (or the reverse), over
``torch.distributed`` point-to-point messages on the group given (Gloo on CPU):

1. a header: the commit, the slot whose objects are offered, how many objects;
2. the offered objects' ids and byte sizes (content addressing: ids, not bytes, first);
3. the receiver's answer: which of them it lacks;
4. only those objects' bytes, packed into messages of at most 16 MiB (``MESSAGE_BYTES``).

The bytes phase keeps the transport busy and the memory still: the sender reads each object
from its tier straight into one of two message buffers it reuses (while one travels, the other
is packed), never into memory of its own first; a receiver that copies out what lands (a buddy
keeping a replica in its tier, or a restarting worker with a tier of its own) reuses two receive
buffers the same way. Only a restarting worker without a tier receives into fresh buffers, since
its restore reads the copies from them. A message travels as parts of at most ``PART_BYTES``,
all in flight at once.

``replicate`` runs it once a commit is durable (``shardtrain``'s committer calls it in its
background thread, on the commit protocol's group): first ``complete`` fills each slot's own tier
with the objects of its closure another rank wrote (a DTensor block straddling its slices and
another's, written by the block's owner; a tensor several ranks hold whole, recorded by one),
sent from that rank's tier, so that every slot's tier holds its commit; then slot ``i`` offers its
closure of the commit and the buddy keeps what it lacks in its host's tier for slot ``i``,
verified against each id (an object its host's own tier already holds is copied from there,
hashed, and not sent), and holds the commit there when every object is present. ``fetch_replicas`` runs
it at a restart, after the group agreed on the commit: a worker whose own tier does not hold
the commit gets its slot's objects from its buddies into a ``PeerCopies`` tier, which the
restore reads through ``TieredStorage``. Each object is verified against its id as it lands
(hashed on the helper thread while the next message travels, and not again by the restore).
A restore read already waiting for it gets it from the receive buffer there and then, copied
into its tensor (``PeerCopies.deliver``); any other is copied out of the receive buffer and held
in memory until the restore copies it into its tensor (it asks for the copies in the order they
are sent, so it is waiting for most of them). No copy is written to the worker's own tier: its
buddy's tier holds it, and the slot's next commit writes its closure through from its own bytes
(SPEC.md §19.3). A wrong one is refused, named with the peer that sent it, and the restore reads
it from the store instead.
``start_fetch`` runs the same exchange on a thread of its own, so that a worker whose tier
holds the commit restores from it while it sends its buddy's copies, and one that lacks it
restores while they arrive: the sender offers the smallest objects first (the manifests a
restore reads before any tensor), and a read of a copy still on its way waits for that copy
alone (``PeerCopies``).

Everything travels as tensors (never pickled objects). Every rank of the group must call
the same function with the same ``commit``; a rank with nothing to offer sends an empty
offer.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..backends.memory_tier import MemoryTier
from ..backends.tiers import PeerCopies
from ..errors import ShardstoreError
from ..format.names import check_oid
from ..format.tensors import hash_bytes

__all__ = [
    "Offer",
    "PeerFetch",
    "ReplicaReport",
    "buddies",
    "shift",
    "complete",
    "replicate",
    "fetch_replicas",
    "start_fetch",
]

#: Bytes of object payload per point-to-point message (a larger object is a message of its own).
#: Small, because each end's two message buffers are memory the exchange touches for the first
#: time: on the 2-core VM of benchmarks/RESULTS.md, first-touch page faults on 2 x 64 MiB took
#: about 0.085 s of CPU at each end of a 553 MB transfer, against 0.009 s with 2 x 8.4 MB
#: (``perf``), and the first message leaves, and the last one lands, sooner.
MESSAGE_BYTES = 16 << 20
#: A message travels as parts of at most this many bytes, all in flight at once: on loopback
#: Gloo, 16 concurrent 4 MiB messages moved about twice the bytes per second of one of 64 MiB.
PART_BYTES = 4 << 20
#: The most objects one offer may name, and the largest object size it may give.
_MAX_OBJECTS = 1 << 22
_MAX_OBJECT_BYTES = 1 << 40
_HEADER = struct.Struct("<32sqq")  # commit id, slot, object count


@dataclass
class Offer:
    """What one rank offers another: the objects of ``slot``'s closure of ``commit`` (id,
    byte size; size -1 for an object the sender does not have)."""

    slot: int = -1
    commit: str | None = None
    objects: list[tuple[str, int]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether the sender has every object of the commit it offers."""
        return self.commit is not None and all(n >= 0 for _, n in self.objects)


@dataclass
class ReplicaReport:
    """What one exchange moved for this rank, and the copies it refused (naming the peer)."""

    sent: int = 0  # bytes of objects this rank sent (to complete other slots' tiers included)
    received: int = 0  # bytes of objects it received (``filled`` included)
    held: bool = False  # whether the received commit is now held whole by this host's tier
    rejected: list[str] = field(default_factory=list)
    filled: int = 0  # bytes of objects of its own slot's closure it received from other slots' tiers (``complete``)
    local: int = 0  # bytes of a replica kept from this host's own tier, not sent (``replicate``)


def buddies(slot: int, world: int, replicas: int) -> list[int]:
    """The slots holding ``slot``'s replicas: the next ``replicas`` slots round the ring, never itself."""
    return [(slot + d) % world for d in range(1, min(replicas, world - 1) + 1)]


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _owned(raw: bytes | memoryview, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A tensor that owns its memory holding ``raw`` (see ``distributed._pack`` for why not frombuffer)."""
    src = np.frombuffer(raw, dtype=np.uint8)
    t = torch.empty(len(src), dtype=torch.uint8)
    t.numpy()[:] = src
    return t if dtype == torch.uint8 else t.view(dtype)


def _exchange(group: Any, send: torch.Tensor | None, to: int, recv: torch.Tensor | None, frm: int) -> None:
    """Send ``send`` to group rank ``to`` and receive ``recv`` from ``frm`` at once (either may be None)."""
    dev = _device(group)
    ops = []
    out = None if send is None else send.to(dev)
    into = None if recv is None else (recv if dev.type == "cpu" else torch.empty_like(recv, device=dev))
    if out is not None and out.numel():
        peer = dist.get_global_rank(group, to) if group else to
        ops += [dist.P2POp(dist.isend, part, peer, group=group) for part in out.split(PART_BYTES)]
    if into is not None and into.numel():
        peer = dist.get_global_rank(group, frm) if group else frm
        ops += [dist.P2POp(dist.irecv, part, peer, group=group) for part in into.split(PART_BYTES)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if recv is not None and into is not None and into is not recv:
        recv.copy_(into.cpu())


def _messages(sizes: list[int]) -> list[list[int]]:
    """Indexes of ``sizes`` packed in order into messages of at most ``MESSAGE_BYTES`` (one object
    larger than that is a message of its own); both ends compute the same packing."""
    out: list[list[int]] = []
    total = MESSAGE_BYTES
    for i, n in enumerate(sizes):
        if not out or total + n > MESSAGE_BYTES:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def shift(
    group: Any,
    offer: Offer,
    *,
    to: int,
    frm: int,
    fetch_into: Callable[[str, memoryview], int | None],
    lacks: Callable[[Offer, str], bool],
    land: Callable[[Offer, str, memoryview], None],
    limit: int = _MAX_OBJECT_BYTES,
    copies_out: bool = False,
    coming: Callable[[list[str]], None] | None = None,
) -> tuple[Offer, int, int]:
    """Send ``offer`` to rank ``to`` and receive rank ``frm``'s (module docstring: header, ids,
    answer, bytes). Objects of the incoming offer that the receiver ``lacks`` (at most ``limit``
    bytes in all) come in and are handed to ``land`` unverified; the sender reads each with
    ``fetch_into`` straight into the message (its size back; an object gone meanwhile, or of
    another size, is sent as zeros, which its receiver rejects). ``copies_out``: ``land`` keeps
    nothing it is handed past its return, so the receive buffers are reused. Returns the offer
    received and the bytes sent and received. Collective over ``group``: every rank calls it,
    with ``to`` and ``frm`` matching its peers'."""
    # 1. headers
    mine = _owned(_HEADER.pack(bytes.fromhex(offer.commit or "0" * 64), offer.slot, len(offer.objects)))
    theirs = torch.empty(_HEADER.size, dtype=torch.uint8)
    _exchange(group, mine, to, theirs, frm)
    raw_commit, slot, count = _HEADER.unpack(theirs.numpy().tobytes())
    if not 0 <= count <= _MAX_OBJECTS:
        raise ShardstoreError(f"peer rank {frm} offered {count} objects, over the limit of {_MAX_OBJECTS}")
    commit = raw_commit.hex() if any(raw_commit) else None
    # 2. ids and sizes
    ids_out = _owned(b"".join(bytes.fromhex(o) for o, _ in offer.objects))
    sizes_out = torch.tensor([n for _, n in offer.objects], dtype=torch.int64)
    ids_in, sizes_in = torch.empty(32 * count, dtype=torch.uint8), torch.empty(count, dtype=torch.int64)
    _exchange(group, ids_out, to, ids_in, frm)
    _exchange(group, sizes_out, to, sizes_in, frm)
    raw_ids = ids_in.numpy().tobytes()
    got = Offer(slot, commit, [])
    for i, n in enumerate(sizes_in.tolist()):
        if not -1 <= n <= _MAX_OBJECT_BYTES:
            raise ShardstoreError(f"peer rank {frm} offered an object of {n} bytes")
        got.objects.append((check_oid(raw_ids[32 * i : 32 * i + 32].hex(), what=f"object id from rank {frm}"), n))
    # 3. answers: which offered objects the receiver lacks
    want_in, budget = [], limit
    for oid, n in got.objects:
        take = 0 <= n <= budget and lacks(got, oid)
        budget -= n if take else 0
        want_in.append(take)
    answer_in = torch.empty(len(offer.objects), dtype=torch.uint8)
    _exchange(group, torch.tensor(want_in, dtype=torch.uint8), frm, answer_in, to)
    asked = [i for i, w in enumerate(answer_in.tolist()) if w]
    if any(offer.objects[i][1] < 0 for i in asked):
        raise ShardstoreError(f"rank {to} asked for objects this rank does not have")
    wanted_in = [i for i, w in enumerate(want_in) if w]
    if coming is not None:
        coming([got.objects[i][0] for i in wanted_in])
    # 4. bytes, message by message: while message k travels, a helper thread packs message k+1
    # (reading the objects from the sender's tier) and lands message k-1 (the receiver's
    # hashing and tier writes), in order, so the transport is never idle waiting for either.
    msgs_out = [[asked[j] for j in m] for m in _messages([offer.objects[i][1] for i in asked])]
    msgs_in = [[wanted_in[j] for j in m] for m in _messages([got.objects[i][1] for i in wanted_in])]
    sent = received = 0
    outboxes: list[torch.Tensor | None] = [None, None]  # message k is packed into outboxes[k % 2]
    inboxes: list[torch.Tensor | None] = [None, None]  # and received into inboxes[k % 2] (copies_out)

    def pack(k: int) -> torch.Tensor | None:
        if k >= len(msgs_out):
            return None
        n = sum(offer.objects[i][1] for i in msgs_out[k])
        outboxes[k % 2] = _box(outboxes[k % 2], n)
        return _pack(offer, msgs_out[k], fetch_into, outboxes[k % 2][:n])  # type: ignore[index]

    def unpack(k: int, into: torch.Tensor) -> int:
        view, off = memoryview(into.numpy()), 0
        for i in msgs_in[k]:
            oid, n = got.objects[i]
            land(got, oid, view[off : off + n])
            off += n
        return off

    rounds = max(len(msgs_out), len(msgs_in))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardstore-replicas") as helper:
        packed = helper.submit(pack, 0)
        landed: Future[int] | None = None
        for k in range(rounds):
            out = packed.result()
            packed = helper.submit(pack, k + 1) if k + 1 < rounds else packed
            into = None
            if k < len(msgs_in):
                n = sum(got.objects[i][1] for i in msgs_in[k])
                if copies_out:  # free again: message k-2's landing was waited for last round
                    inboxes[k % 2] = _box(inboxes[k % 2], n)
                    into = inboxes[k % 2][:n]  # type: ignore[index]
                else:
                    into = torch.empty(n, dtype=torch.uint8)
            _exchange(group, out, to, into, frm)
            sent += 0 if out is None else out.numel()
            if landed is not None:
                received += landed.result()
                landed = None
            if into is not None:
                landed = helper.submit(unpack, k, into)
        if landed is not None:
            received += landed.result()
    return got, sent, received


def _shift_tiers(
    group: Any,
    report: ReplicaReport,
    offer: Offer,
    *,
    to: int,
    frm: int,
    own: MemoryTier,
    lacks: Callable[[Offer, str], bool],
    land: Callable[[Offer, str, memoryview], None],
) -> Offer:
    """``shift`` between two ranks' tiers (``complete``, ``replicate``): this rank's objects read from
    ``own``, each one received handed to ``land`` (which hashes it and writes it to a tier: buffers
    reused); the bytes moved added to ``report``; returns the offer received."""
    got, sent, received = shift(
        group, offer, to=to, frm=frm, fetch_into=own.fetch_into, lacks=lacks, land=land, copies_out=True
    )
    report.sent += sent
    report.received += received
    return got


def _box(box: torch.Tensor | None, n: int) -> torch.Tensor:
    """``box`` if it holds ``n`` bytes, else a buffer that does (a message is at most
    ``MESSAGE_BYTES`` unless one object is larger, so a box is allocated about once)."""
    return box if box is not None and box.numel() >= n else torch.empty(max(n, 1), dtype=torch.uint8)


def _pack(
    offer: Offer, message: list[int], fetch_into: Callable[[str, memoryview], int | None], out: torch.Tensor
) -> torch.Tensor:
    """One message's objects read back to back into ``out`` (zeros for one that cannot be read now)."""
    flat, off = memoryview(out.numpy()), 0
    for i in message:
        oid, n = offer.objects[i]
        if _try_value(lambda: fetch_into(oid, flat[off : off + n])) != n:
            out[off : off + n].zero_()
        off += n
    return out


def _gather_ids(group: Any, ids: list[str]) -> list[list[str]]:
    """Every rank's ``ids`` (32 raw bytes each), in group rank order: the counts all-gathered,
    then the ids padded to the longest list (uint8 tensors on the group's device; nothing
    pickled). A count over ``_MAX_OBJECTS`` is refused before anything is allocated for it."""
    world, dev = dist.get_world_size(group), _device(group)
    counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([len(ids)], dtype=torch.int64, device=dev), group=group)
    ns = [int(c.item()) for c in counts]
    for r, n in enumerate(ns):
        if not 0 <= n <= _MAX_OBJECTS:
            raise ShardstoreError(f"rank {r} lacks {n} objects, over the limit of {_MAX_OBJECTS}")
    top = max(ns)
    if top == 0:
        return [[] for _ in range(world)]
    mine = torch.zeros(32 * top, dtype=torch.uint8)
    if ids:
        mine[: 32 * len(ids)] = _owned(b"".join(bytes.fromhex(o) for o in ids))
    out = [torch.empty(32 * top, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(out, mine.to(dev), group=group)
    got = []
    for r, (t, n) in enumerate(zip(out, ns)):
        raw = t.cpu().numpy().tobytes()
        got.append([check_oid(raw[32 * i : 32 * i + 32].hex(), what=f"object id from rank {r}") for i in range(n)])
    return got


def complete(group: Any, *, slot: int, commit: str, objects: Iterable[str], own: MemoryTier) -> ReplicaReport:
    """After ``commit`` is durable: fill this slot's tier ``own`` with the objects of its closure
    ``objects`` it lacks from the tiers of the group's other ranks, which wrote them (SPEC.md
    §19.3: a DTensor block that straddles this slot's slices and another's, written by its
    owner; a tensor several slots hold whole, recorded by one; anything else of the closure
    another rank wrote). Every rank says which objects it lacks (ids only, all-gathered); then,
    at each distance ``d`` at which some rank's tier has what the rank ``d`` after it lacks, one
    ``shift``: the holder offers those objects (ids and sizes), the lacking rank answers which
    it still lacks, and only those bytes move, each hashed to its id by the receiver before it is
    kept (one that does not is refused, naming the slot that sent it). A rank lacking nothing,
    in a group where no rank lacks anything, costs one all-gather of counts. Collective over
    ``group`` (every rank, the same ``commit``)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    report = ReplicaReport()
    if world < 2:
        return report
    mine = sorted(o for o in set(objects) if not _has(own, o))
    lacking = _gather_ids(group, mine)
    if not any(lacking):
        return report
    wanted = set(mine)
    offers: dict[int, Offer] = {}
    flags = torch.zeros(world, dtype=torch.int64)
    for d in range(1, world):
        there = (rank + d) % world
        have = [(o, n) for o in lacking[there] if (n := _size(own, o)) >= 0]
        if have:
            offers[d] = Offer(slot, commit, have)
            flags[d] = 1
    dev = _device(group)
    flags = flags.to(dev)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)  # the distances at which anything moves
    for d in [d for d in range(1, world) if int(flags[d].item())]:
        frm = (rank - d) % world

        def lacks(got: Offer, oid: str) -> bool:
            return got.commit == commit and oid in wanted and not _has(own, oid)

        def land(got: Offer, oid: str, data: memoryview, _frm: int = frm) -> None:
            digest = hash_bytes(data)
            if digest != oid:
                report.rejected.append(
                    f"object {oid}: the copy from slot {got.slot} (rank {_frm}) does not hash to its id "
                    f"(its bytes hash to {digest}); not kept"
                )
                return
            if _try(lambda: own.put(oid, data)):
                report.filled += len(data)  # only what the tier now holds

        _shift_tiers(
            group,
            report,
            offers.get(d, Offer(slot, commit, [])),
            to=(rank + d) % world,
            frm=frm,
            own=own,
            lacks=lacks,
            land=land,
        )
    return report


def replicate(
    group: Any,
    *,
    slot: int,
    commit: str,
    objects: Iterable[str],
    own: MemoryTier,
    tier_for: Callable[[int], MemoryTier],
    replicas: int = 1,
) -> ReplicaReport:
    """After ``commit`` is durable: offer this slot's closure ``objects`` (from its own tier
    ``own``) to its buddies, and keep what the slots before it offer in ``tier_for(their slot)``
    (this host's tier of that slot), each object verified; hold the commit there when whole.
    First ``complete``: this slot's tier gets what of ``objects`` it lacks from the tiers of the
    ranks that wrote them, so that its offer is whole. Collective over ``group`` (every rank,
    the same ``commit``)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    objects = sorted(set(objects))
    report = complete(group, slot=slot, commit=commit, objects=objects, own=own)
    offer = Offer(slot, commit, [(o, _size(own, o)) for o in objects])
    for d in range(1, min(replicas, world - 1) + 1):
        peer = (rank - d) % world  # the slot whose replica this rank keeps at distance d
        tiers: dict[int, MemoryTier | None] = {}

        def tier(got: Offer, _peer: int = peer) -> MemoryTier | None:
            if got.slot != _peer or got.commit != commit:
                return None  # only the slot the ring says, of this commit
            if _peer not in tiers:
                tiers[_peer] = _try_value(lambda: tier_for(_peer))
            return tiers[_peer]

        sizes: dict[str, int] = {}  # the offer's sizes, by id

        def lacks(got: Offer, oid: str, _sizes: dict[str, int] = sizes) -> bool:
            t = tier(got)  # an incomplete offer is never held, so never evicted: none of it is taken
            if t is None or not got.complete or _has(t, oid):
                return False
            if not _sizes:
                _sizes.update(got.objects)
            # one this host's own tier holds (a block this rank wrote) is copied here, not sent
            if _copy_local(own, t, oid, _sizes.get(oid, -1)):
                report.local += _sizes[oid]
                return False
            return True

        def land(got: Offer, oid: str, data: memoryview, _peer: int = peer) -> None:
            t = tier(got)
            if hash_bytes(data) != oid:
                report.rejected.append(f"object {oid} from peer slot {_peer} does not hash to its id; not kept")
            elif t is not None:
                _try(lambda: t.put(oid, data))

        got = _shift_tiers(group, report, offer, to=(rank + d) % world, frm=peer, own=own, lacks=lacks, land=land)
        t = tier(got)
        if t is not None and got.complete and all(_has(t, o) for o, _ in got.objects):
            _try(lambda: t.hold(commit, [o for o, _ in got.objects]))
            report.held = True
    return report


def _copy_local(source: MemoryTier, into: MemoryTier, oid: str, size: int) -> bool:
    """Keep in ``into`` this host's copy of ``oid`` from another slot's tier ``source`` (a block
    this rank wrote that its buddy's slot closure names too, SPEC.md §19.3), hashed to its id
    before it is kept; whether it was (else the peer sends it). No byte crosses the network."""
    if size < 0 or source is into or _size(source, oid) != size:
        return False
    buf = bytearray(size)
    if _try_value(lambda: source.fetch_into(oid, memoryview(buf))) != size or hash_bytes(buf) != oid:
        return False
    _try(lambda: into.put(oid, buf))
    return _has(into, oid)


def _size(tier: MemoryTier, oid: str) -> int:
    """``oid``'s size in ``tier``; -1 when it holds none (or cannot tell: an unreadable tier is no error)."""
    n = _try_value(lambda: tier.size(oid))
    return -1 if n is None else n


def _has(tier: MemoryTier, oid: str) -> bool:
    """Whether ``tier`` holds ``oid``; False when it cannot tell (a directory on the way that is a
    symbolic link): an unreadable tier is no error, never an exception on one rank while the
    others wait in the exchange."""
    return bool(_try_value(lambda: tier.has(oid)))


def _try(fn: Callable[[], object]) -> bool:
    """A cache write that fails (a full tmpfs) leaves the cache short, never the run failed; True
    if it was written."""
    try:
        fn()
    except (ShardstoreError, OSError):
        return False
    return True


def fetch_replicas(
    group: Any,
    *,
    slot: int,
    commit: str,
    own: MemoryTier | None,
    tier_for: Callable[[int], MemoryTier],
    replicas: int = 1,
) -> tuple[PeerCopies, ReplicaReport]:
    """At a restart, after the group agreed on ``commit``: every rank whose own tier does not
    hold ``commit`` for its slot gets the objects it lacks from its buddies (slot + 1, ...),
    each buddy offering its host's tier of that slot (``tier_for``). Returns the copies, each
    verified against its id as it landed and held in memory (never written to ``own``), and the
    report (``rejected``: the copies refused, each naming its peer). Collective over ``group``."""
    need = own is None or _try_value(lambda: own.holds(commit)) is None  # a tier that cannot say: ask
    copies = PeerCopies()
    return _fetch(group, need, copies, slot=slot, commit=commit, own=own, tier_for=tier_for, replicas=replicas)


class PeerFetch:
    """``fetch_replicas`` in flight on a thread of its own (``start_fetch``). A worker whose own
    tier holds the commit (``needed`` false) restores from that tier meanwhile, while the thread
    serves its peers' copies; one that needs copies restores from ``copies`` meanwhile, each
    read of a copy still on its way waiting for it. Nothing else may use the
    exchange's group until ``wait`` returns (Gloo matches a group's messages in the order its
    ranks post them)."""

    def __init__(self, needed: bool, copies: PeerCopies, run: Callable[[], tuple[PeerCopies, ReplicaReport]]) -> None:
        self.needed = needed
        self.copies = copies  # filled as the copies arrive: a read of one still coming waits for it
        self._result: tuple[PeerCopies, ReplicaReport] | None = None
        self._error: BaseException | None = None
        # a daemon thread: a worker that fails meanwhile exits without waiting on its peers
        self._thread = threading.Thread(target=self._run, args=(run,), name="shardstore-fetch", daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[], tuple[PeerCopies, ReplicaReport]]) -> None:
        try:
            self._result = run()
        except BaseException as e:  # noqa: BLE001 - re-raised in the waiting thread
            self._error = e
        finally:
            # ``_fetch`` says so itself once it has begun; a failure before it (setting the
            # thread's CUDA device) must not leave the restore's reads waiting for copies forever
            self.copies.done()

    def wait(self) -> tuple[PeerCopies, ReplicaReport]:
        """The copies and the report, once the exchange is over (its error, if it failed)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def start_fetch(
    group: Any,
    *,
    slot: int,
    commit: str,
    own: MemoryTier | None,
    tier_for: Callable[[int], MemoryTier],
    replicas: int = 1,
) -> PeerFetch:
    """``fetch_replicas`` started on a thread of its own (``PeerFetch``), so that a worker whose
    own tier holds ``commit`` restores from it while it sends its buddies' copies to a worker
    that lacks them. Collective over ``group``, which nothing else may use until ``wait``."""
    need = own is None or _try_value(lambda: own.holds(commit)) is None  # a tier that cannot say: ask
    cuda = _device(group)  # the caller's device: a new thread's current CUDA device is the first one
    copies = PeerCopies(pending=need)  # its reads wait until the exchange has said what is coming

    def run() -> tuple[PeerCopies, ReplicaReport]:
        if cuda.type == "cuda":
            torch.cuda.set_device(cuda)
        return _fetch(group, need, copies, slot=slot, commit=commit, own=own, tier_for=tier_for, replicas=replicas)

    return PeerFetch(need, copies, run)


def _fetch(
    group: Any,
    need: bool,
    copies: PeerCopies,
    *,
    slot: int,
    commit: str,
    own: MemoryTier | None,
    tier_for: Callable[[int], MemoryTier],
    replicas: int,
) -> tuple[PeerCopies, ReplicaReport]:
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        report = ReplicaReport()
        for d in range(1, min(replicas, world - 1) + 1):
            dev = _device(group)
            flags = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
            dist.all_gather(flags, torch.tensor([int(need)], dtype=torch.int64, device=dev), group=group)
            needs = [bool(int(f.item())) for f in flags]
            if not any(needs):
                break
            asker = (rank - d) % world  # the rank whose buddy at distance d this rank is
            offer = Offer()
            if needs[asker]:
                held = _try_value(lambda: tier_for(asker).holds(commit))
                if held is not None:
                    tier = tier_for(asker)
                    # smallest first: the manifests a restore reads before any tensor arrive first
                    offer = Offer(
                        asker, commit, sorted(((o, _size(tier, o)) for o in held), key=lambda e: (e[1], e[0]))
                    )
            source = tier_for(asker) if offer.commit is not None else None
            peer = (rank + d) % world

            def lacks(got: Offer, oid: str) -> bool:
                return (
                    need and got.commit == commit and got.slot == slot
                    and (own is None or not _has(own, oid)) and oid not in copies
                )  # fmt: skip

            def land(got: Offer, oid: str, data: memoryview, _peer: int = peer) -> None:
                # Verified here, on the helper thread while the next message travels, and only here:
                # the restore copies a verified copy without hashing it again (backends.tiers).
                digest = hash_bytes(data)
                if digest != oid:
                    report.rejected.append(
                        f"object {oid}: the copy from peer slot {_peer} does not hash to its id "
                        f"(its bytes hash to {digest}); not used"
                    )
                    copies.refused(oid)  # a read waiting for it goes on to the store
                    return
                # Verified: straight into the buffers of the restore's reads waiting for it, which go on
                # at once (this thread lands the next copy meanwhile); no tier keeps it (SPEC.md §19.3).
                # Not asked for yet: held in memory until a read copies it into its tensor, then let
                # go; past the copies' bound not kept, and its read goes to the store (``PeerCopies.add``).
                # Held as it is only when the message buffer is this object's alone and not reused
                # (no tier of its own: ``copies_out`` off); a view of a message holding other objects
                # would keep the whole message alive, which ``max_held`` counts as this object's bytes
                alone = own is None and (data.obj is None or memoryview(data.obj).nbytes == data.nbytes)
                copies.add(oid, data, _peer, verified=True, copy=not alone)

            got, sent, received = shift(
                group,
                offer,
                to=asker,
                frm=peer,
                fetch_into=source.fetch_into if source is not None else (lambda oid, out: None),
                lacks=lacks,
                land=land,
                copies_out=own is not None,  # land copies out what it keeps: buffers reused
                coming=copies.expect,  # a read of one of them waits for it (the restore runs meanwhile)
            )
            report.sent += sent
            report.received += received
            if need and got.complete and got.commit == commit and got.slot == slot:
                need = False
        return copies, report
    finally:
        copies.done()  # whatever happened: a read still waiting for a copy goes on to the store


def _try_value(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (ShardstoreError, OSError):
        return None
