"""Peer replicas over a real 3-process Gloo group (``checkpoint.replicas``): each slot's committed
objects land in its buddy's memory tier, only new objects move at the next commit, a worker
whose tier is gone gets its slot back from its buddy, and a buddy that sends wrong bytes is
caught by the reader's verification and named."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import blake3
import pytest
from gloo_group import run_group

from shardstore.backends.memory_tier import MemoryTier
from shardstore.backends.tiers import TieredStorage
from shardstore.checkpoint import replicas
from shardstore.checkpoint.replicas import buddies, fetch_replicas, replicate, start_fetch
from shardstore.format import tensors
from shardstore.format.tensors import hash_bytes
from shardstore.store import open_store

C1, C2 = "c1" * 32, "c2" * 32


def _objects(rank: int, n: int, version: int = 0) -> dict[str, bytes]:
    """Slot ``rank``'s objects: ``n`` payloads, the last one changed in ``version`` 1."""
    datas = [bytes([rank, i]) * (1000 + i) for i in range(n)]
    if version:
        datas[-1] = b"changed" + datas[-1]
    return {hash_bytes(d): d for d in datas}


def _count_hashing() -> list[int]:
    """From now on in this process, the bytes shardstore's BLAKE3 is fed (``[0]``)."""
    hashed = [0]

    class Counting:
        AUTO = blake3.blake3.AUTO

        def __init__(self, data: object = None, **kwargs: object) -> None:
            self._h = blake3.blake3(**kwargs)
            if data is not None:
                self.update(data)

        def update(self, data: object) -> Counting:
            hashed[0] += memoryview(data).nbytes  # type: ignore[arg-type]
            self._h.update(data)
            return self

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    tensors.blake3 = SimpleNamespace(blake3=Counting)  # type: ignore[attr-defined]  # this spawned process only
    return hashed


def _body(rank: int, world: int, home: str) -> dict:
    # Messages of two objects each: every exchange below takes several messages, so the
    # pipeline (the next message packed, the last one landed, while one travels) is exercised.
    replicas.MESSAGE_BYTES = 4096
    # Count the tier reads into memory of their own: a sender reads each object straight into
    # the message it packs, so replicating and fetching take none.
    whole_reads = [0]
    fetch = MemoryTier.fetch

    def counted_fetch(self: MemoryTier, oid: str) -> bytes | None:
        whole_reads[0] += 1
        return fetch(self, oid)

    MemoryTier.fetch = counted_fetch  # type: ignore[method-assign]  # this spawned process only
    # Count the message buffers each exchange allocates (fresh memory, whose first touch costs CPU):
    # at most two to pack into and two to receive into, each of at most one message.
    boxes: list[list[int]] = []
    box, shift = replicas._box, replicas.shift

    def counted_box(old: object, n: int) -> object:
        new = box(old, n)  # type: ignore[arg-type]
        if new is not old:
            boxes[-1].append(new.numel())
        return new

    def counted_shift(*args: object, **kwargs: object) -> object:
        boxes.append([])
        return shift(*args, **kwargs)  # type: ignore[arg-type]

    replicas._box, replicas.shift = counted_box, counted_shift  # type: ignore[assignment]
    roots = {r: os.path.join(home, f"host{r}") for r in range(world)}
    own = MemoryTier(roots[rank], rank)
    tier_for = lambda slot: MemoryTier(roots[rank], slot)  # noqa: E731 - this host's tier of a slot
    out: dict = {}
    # commit 1: every slot's objects go to its buddy
    first = _objects(rank, 4)
    for oid, data in first.items():
        own.put(oid, data)
    own.hold(C1, first)
    r1 = replicate(None, slot=rank, commit=C1, objects=first, own=own, tier_for=tier_for)
    # commit 2: one object changed, so one object's bytes move
    second = _objects(rank, 4, version=1)
    for oid, data in second.items():
        own.put(oid, data)
    own.hold(C2, second)
    r2 = replicate(None, slot=rank, commit=C2, objects=second, own=own, tier_for=tier_for)
    before = (rank - 1) % world
    out["first"] = [r1.sent, r1.received, r1.held]
    out["second"] = [r2.sent, r2.received, r2.held, len(second.keys() - first.keys())]
    out["replica"] = sorted(tier_for(before).objects())
    out["replica_holds"] = tier_for(before).holds(C2) is not None
    out["expected_replica"] = sorted(_objects(before, 4, version=1))
    # slot 1's host is lost: its replacement has an empty tier and gets slot 1 from slot 2's host
    if rank == 1:
        own = MemoryTier(os.path.join(home, "replacement1"), 1)
    hashed = _count_hashing()
    copies, report = fetch_replicas(None, slot=rank, commit=C2, own=own, tier_for=tier_for)
    out["fetched"] = sorted(oid for oid in second if copies.fetch(oid) is not None)
    out["fetch_received"] = report.received
    out["hashed_fetching"] = hashed[0]
    if rank == 1:  # the restore's reads of those copies: each copied into its tensor, none hashed again
        hashed[0] = 0
        reader = TieredStorage(open_store(os.path.join(home, "empty1")).storage, [own, copies], fill=own)
        for oid, data in second.items():
            into = bytearray(len(data))
            assert reader.read_into_hashed(f"objects/{oid[:2]}/{oid}", memoryview(into)) == (len(data), oid)
            assert into == data
        out["hashed_restoring"] = hashed[0]
        out["restore_counts"] = reader.counts()
        out["tier_filled"] = sorted(o for o in second if own.has(o))  # none: a peer's copy is not kept
    # the same exchange in the background: a worker whose tier holds the commit need not wait for it
    if rank == 1:
        own = MemoryTier(os.path.join(home, "replacement1c"), 1)
    fetching = start_fetch(None, slot=rank, commit=C2, own=own, tier_for=tier_for)
    if rank == 1:  # reads at once, while the copies travel: each waits for its copy (the store is empty)
        reader = TieredStorage(open_store(os.path.join(home, "empty1c")).storage, [own, fetching.copies], fill=own)
        out["read_while_coming"] = all(
            bytes(reader.read(f"objects/{oid[:2]}/{oid}")) == data for oid, data in second.items()
        )
        out["read_while_coming_counts"] = reader.counts()
    copies, report = fetching.wait()
    out["background"] = [fetching.needed, sorted(oid for oid in second if copies.fetch(oid) is not None)]
    # slot 2's host now holds a corrupt replica of slot 1: the replacement's reader refuses it
    bad = max(second, key=lambda o: len(second[o])) if rank == 1 else None
    if rank == 2:
        victim = max(_objects(1, 4, version=1).items(), key=lambda kv: len(kv[1]))[0]
        path = Path(tier_for(1).dir) / "objects" / victim[:2] / victim
        os.chmod(path, 0o644)
        path.write_bytes(b"X" + path.read_bytes()[1:])
    if rank == 1:
        own = MemoryTier(os.path.join(home, "replacement1b"), 1)
    copies, report = fetch_replicas(None, slot=rank, commit=C2, own=own, tier_for=tier_for)
    out["whole_reads"] = whole_reads[0]
    # an exchange of many messages (12 objects of 1000 bytes, four to a message, each way)
    many = {hash_bytes(bytes([rank, i]) * 500): bytes([rank, i]) * 500 for i in range(12)}
    landed: dict[str, bytes] = {}

    def fetch_into(oid: str, into: memoryview) -> int:
        into[:] = many[oid]
        return len(many[oid])

    def land(_: object, oid: str, data: memoryview) -> None:
        landed[oid] = bytes(data)

    offer = replicas.Offer(rank, C2, [(oid, len(d)) for oid, d in many.items()])
    replicas.shift(
        None, offer, to=(rank + 1) % world, frm=(rank - 1) % world, fetch_into=fetch_into,
        lacks=lambda got, oid: True, land=land, copies_out=True,
    )  # fmt: skip
    out["many"] = [len(landed), all(hash_bytes(d) == o for o, d in landed.items()), boxes[-1]]
    out["boxes"] = [list(b) for b in boxes]  # these exchanges only: the completion below moves objects over 4096 bytes
    if rank == 1:
        store = open_store(os.path.join(home, "store1"))  # the durable copy, for the rejected object
        for data in second.values():
            store.put(data)
        reader = TieredStorage(store.storage, [own, copies], fill=own)
        for oid, data in second.items():
            assert bytes(reader.read(f"objects/{oid[:2]}/{oid}")) == data
        out["counts"] = reader.counts()
        out["rejected"] = report.rejected + reader.rejected  # refused as it landed, naming the peer
        out["bad"] = bad
    # again in the background, the restore's reads into their buffers waiting for the copies: the
    # good ones are handed over from the bytes verified as they landed, the corrupt one is refused
    # before any of its bytes reaches a buffer, and read from the store
    if rank == 1:
        own = MemoryTier(os.path.join(home, "replacement1d"), 1)
    fetching = start_fetch(None, slot=rank, commit=C2, own=own, tier_for=tier_for)
    if rank == 1:
        reader = TieredStorage(store.storage, [own, fetching.copies], fill=own)
        outs = {oid: bytearray(len(data)) for oid, data in second.items()}
        got = [reader.read_into_hashed(f"objects/{oid[:2]}/{oid}", memoryview(into)) for oid, into in outs.items()]
        out["waited_reads"] = [
            got == [(len(d), o) for o, d in second.items()],
            all(outs[o] == d for o, d in second.items()),
        ]
        out["waited_counts"] = reader.counts()
    _, report = fetching.wait()
    if rank == 1:
        out["waited_rejected"] = report.rejected + reader.rejected
    out.update(_completion(rank, world, home))
    return out


C3 = "c3" * 32


def _written(r: int) -> dict[str, bytes]:
    """The two objects slot ``r`` writes at commit 3: ``a`` (in slot r+1's closure too: a block
    straddling their slices) and ``b`` (in slot r-1's: a tensor slot r records and r-1 holds)."""
    return {"a": b"C3a" + bytes([r]) * 3000, "b": b"C3b" + bytes([r]) * 5000}


def _completion(rank: int, world: int, home: str) -> dict:
    """Commit 3, on fresh hosts: slot r's closure is its own two objects, slot r-1's ``a`` and slot
    r+1's ``b`` (two distances: 1 and 2). Slot 1's tier copy of its ``a`` is corrupt, so slot 2
    refuses it (completion and replica alike, naming the slot that sent it) and its tier does not
    hold the commit, nor its buddy slot 0 a replica of it."""
    host = os.path.join(home, f"c3host{rank}")
    tier_for = lambda slot: MemoryTier(host, slot)  # noqa: E731 - this host's tier of a slot
    own = tier_for(rank)
    for data in _written(rank).values():
        own.put(hash_bytes(data), data)
    if rank == 1:  # a flipped byte in this tier's copy of slot 1's ``a``
        oid = hash_bytes(_written(1)["a"])
        path = Path(own.dir) / "objects" / oid[:2] / oid
        os.chmod(path, 0o644)
        path.write_bytes(b"X" + path.read_bytes()[1:])
    closure = [hash_bytes(d) for d in _written(rank).values()]
    closure += [hash_bytes(_written((rank - 1) % world)["a"]), hash_bytes(_written((rank + 1) % world)["b"])]
    own.hold(C3, closure)
    report = replicate(None, slot=rank, commit=C3, objects=closure, own=own, tier_for=tier_for)
    return {
        "c3": {
            "filled": report.filled,
            "local": report.local,
            "holds": own.holds(C3) is not None,
            "buddy_holds": report.held,
            "rejected": report.rejected,
        }
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    home = tmp_path_factory.mktemp("replicas")
    return run_group(_body, 3, home, str(home))


def test_buddies_are_the_next_slots_round_the_ring() -> None:
    assert buddies(0, 3, 1) == [1] and buddies(2, 3, 1) == [0] and buddies(1, 3, 5) == [2, 0]
    assert buddies(0, 1, 1) == []


def test_each_slot_is_held_by_its_buddy_and_only_new_objects_move(ranks: list[dict]) -> None:
    one = sum(len(d) for d in _objects(0, 4).values())
    for r in ranks:
        assert r["first"] == [one, one, True]  # every object once, held whole
        assert r["replica"] == r["expected_replica"] and r["replica_holds"]  # the old version evicted
        sent, received, held, new = r["second"]
        assert new == 1 and held
        assert sent == received == len(b"changed") + 2 * 1003  # the changed object only


def test_a_replacement_with_an_empty_tier_gets_its_slot_from_its_buddy(ranks: list[dict]) -> None:
    assert ranks[1]["fetched"] == sorted(_objects(1, 4, version=1))
    assert ranks[1]["fetch_received"] == sum(len(d) for d in _objects(1, 4, version=1).values())
    assert ranks[0]["fetched"] == ranks[2]["fetched"] == []  # their own tiers hold the commit
    # no tier keeps a peer's copy (SPEC.md §19.3): its buddy's tier holds it, its next commit writes it through
    assert ranks[1]["tier_filled"] == []


def test_the_exchange_in_the_background_says_who_must_wait_and_brings_the_same_copies(ranks: list[dict]) -> None:
    assert [r["background"][0] for r in ranks] == [False, True, False]
    assert ranks[1]["background"][1] == sorted(_objects(1, 4, version=1))
    assert ranks[0]["background"][1] == ranks[2]["background"][1] == []
    assert ranks[1]["read_while_coming"]  # a read of a copy still on its way waited for it
    counts = ranks[1]["read_while_coming_counts"]
    assert counts["store"] == 0 and counts["peers"] == sum(len(d) for d in _objects(1, 4, version=1).values())


def test_a_buddy_sending_wrong_bytes_is_named_and_the_store_read_instead(ranks: list[dict]) -> None:
    r = ranks[1]
    bad = r["bad"]
    assert r["counts"]["store"] == len(_objects(1, 4, version=1)[bad])
    assert r["counts"]["peers"] == sum(len(d) for d in _objects(1, 4, version=1).values()) - r["counts"]["store"]
    assert len(r["rejected"]) == 1
    assert r["rejected"][0].startswith(f"object {bad}: the copy from peer slot 2 does not hash to its id")


def test_reads_waiting_for_copies_get_the_verified_ones_and_the_store_for_a_corrupt_one(ranks: list[dict]) -> None:
    r = ranks[1]
    bad = r["bad"]
    assert r["waited_reads"] == [True, True]
    assert r["waited_counts"]["store"] == len(_objects(1, 4, version=1)[bad])
    assert r["waited_counts"]["peers"] == sum(len(d) for d in _objects(1, 4, version=1).values()) - len(
        _objects(1, 4, version=1)[bad]
    )
    assert len(r["waited_rejected"]) == 1
    assert r["waited_rejected"][0].startswith(f"object {bad}: the copy from peer slot 2 does not hash to its id")


def test_senders_read_objects_straight_into_the_messages(ranks: list[dict]) -> None:
    assert [r["whole_reads"] for r in ranks] == [0, 0, 0]
    assert all(r["first"][0] > 0 for r in ranks) and ranks[1]["fetch_received"] > 0  # bytes did move


def test_each_exchange_allocates_at_most_two_message_buffers_each_way(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["many"][:2] == [12, True]  # three messages each way moved, every byte intact
        assert sorted(r["many"][2]) == [4000] * 4  # two buffers to pack into, two to receive into
        for allocated in r["boxes"]:  # two to pack into, two to receive into, however many messages
            assert len(allocated) <= 4 and all(n <= 4096 for n in allocated), r["boxes"]
    assert replicas.MESSAGE_BYTES <= 16 << 20  # so at most 64 MiB of fresh buffers per exchange


def test_each_fetched_byte_is_hashed_once_as_it_lands_and_not_again_by_the_restore(ranks: list[dict]) -> None:
    r = ranks[1]
    assert r["fetch_received"] > 0 and r["hashed_fetching"] == r["fetch_received"]
    assert r["hashed_restoring"] == 0 and r["restore_counts"]["peers"] == r["fetch_received"]
    assert ranks[0]["hashed_fetching"] == ranks[2]["hashed_fetching"] == 0  # senders hash nothing


def test_each_slots_tier_is_completed_from_the_tiers_that_wrote_its_objects_each_copy_verified(ranks) -> None:
    """``replicate`` first completes each slot's tier (SPEC.md §19.3): slot r gets slot r-1's ``a``
    (distance 1) and slot r+1's ``b`` (distance 2) from their tiers; a buddy keeps from its host's
    own tier, hashed, what it holds there (slot r+1's tier has slot r's ``a`` now) instead of having
    it sent. Slot 1's corrupt copy of its ``a`` is refused by slot 2, completing and as a buddy,
    naming slot 1: slot 2's tier lacks it, so it does not hold the commit and slot 0 holds no
    replica of slot 2."""
    size = {r: {k: len(d) for k, d in _written(r).items()} for r in range(3)}
    got = [r["c3"] for r in ranks]
    assert got[0]["filled"] == size[2]["a"] + size[1]["b"] and got[1]["filled"] == size[0]["a"] + size[2]["b"]
    assert got[2]["filled"] == size[0]["b"]  # slot 1's ``a`` refused
    assert got[0]["holds"] and got[1]["holds"] and not got[2]["holds"], got
    # slot 0's buddy (rank 1) keeps from its own tier slot 0's ``a`` (completed there) and slot 1's ``b`` (written)
    assert got[1]["buddy_holds"] and got[1]["local"] == size[0]["a"] + size[1]["b"], got
    assert not got[0]["buddy_holds"] and not got[2]["buddy_holds"], got  # slot 2's offer incomplete; slot 1's copy bad
    assert not got[0]["rejected"] and not got[1]["rejected"], got
    bad = hash_bytes(_written(1)["a"])
    completing, as_buddy = got[2]["rejected"]  # in that order: completion runs first
    assert completing.startswith(f"object {bad}: the copy from slot 1 (rank 1) does not hash to its id"), completing
    assert as_buddy.startswith(f"object {bad} from peer slot 1 does not hash to its id"), as_buddy


def test_a_fetch_that_fails_before_its_exchange_lets_the_waiting_reads_go_on() -> None:
    """The fetch thread can fail before ``_fetch`` starts (setting its CUDA device): the reads
    waiting for copies (``PeerCopies(pending=True)``) go on to the store, and ``wait`` raises
    the failure, instead of a restore that waits forever."""
    import threading

    from shardstore.backends.tiers import PeerCopies

    def fails() -> tuple[PeerCopies, replicas.ReplicaReport]:
        raise RuntimeError("no such CUDA device")

    fetching = replicas.PeerFetch(True, PeerCopies(pending=True), fails)
    answer: list[object] = []
    reader = threading.Thread(
        target=lambda: answer.append(fetching.copies.read_verified_into("ab" * 32, memoryview(bytearray(4))))
    )
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive() and answer == [None]  # nothing came: the read goes on to the next tier
    with pytest.raises(RuntimeError, match="no such CUDA device"):
        fetching.wait()


def _buddy_host(rank: int, host: str) -> tuple[Callable[[int], MemoryTier], MemoryTier | None, dict[str, bytes]]:
    """Two ranks exchanging 4 KiB messages (two objects each: several messages). Rank 0's host
    holds its own slot's commit ``C1`` and slot 1's replica of it; rank 1's tier is left empty.
    Returns this host's ``tier_for``, rank 0's own tier (None on rank 1) and slot 1's objects."""
    replicas.MESSAGE_BYTES = 4096
    tier_for = lambda slot: MemoryTier(host, slot)  # noqa: E731 - this host's tier of a slot
    theirs = _objects(1, 6)
    if rank != 0:
        return tier_for, None, theirs
    for slot, objects in ((0, _objects(0, 6)), (1, theirs)):  # its own slot, then its buddy's replica
        tier = tier_for(slot)
        for oid, data in objects.items():
            tier.put(oid, data)
        tier.hold(C1, objects)
    return tier_for, tier_for(0), theirs


def _own_none_body(rank: int, world: int, home: str) -> dict:
    """Rank 0's host holds slot 1's replica; rank 1 has no tier of its own (``own=None``) and
    restores while the copies travel, asking for each before it lands (rank 0 sends slowly), so
    that copies are handed to the reads waiting for them (``deliver``)."""
    import time

    tier_for, own, theirs = _buddy_host(rank, os.path.join(home, f"nonehost{rank}"))
    if rank == 0:
        fetch_into = MemoryTier.fetch_into

        def slow(self: MemoryTier, *a: object, **k: object) -> int | None:
            time.sleep(0.1)  # rank 1's reads wait for the copies
            return fetch_into(self, *a, **k)  # type: ignore[arg-type]

        MemoryTier.fetch_into = slow  # type: ignore[method-assign]  # this spawned process only
        fetching = start_fetch(None, slot=0, commit=C1, own=own, tier_for=tier_for)
        fetching.wait()
        return {}
    fetching = start_fetch(None, slot=1, commit=C1, own=None, tier_for=tier_for)
    reader = TieredStorage(open_store(os.path.join(home, "noneempty")).storage, [fetching.copies])
    served = []
    for oid, data in sorted(theirs.items(), key=lambda kv: (len(kv[1]), kv[0])):  # in the order they come
        into = bytearray(len(data))
        got = reader.read_into_hashed(f"objects/{oid[:2]}/{oid}", memoryview(into))
        served.append(got == (len(data), oid) and into == data)
    copies, _ = fetching.wait()
    return {"served": all(served), "counts": reader.counts(), "held": [len(copies), copies.nbytes()]}


def test_a_worker_without_a_tier_keeps_no_copy_it_handed_to_a_waiting_read(tmp_path: Path) -> None:
    """``own=None`` (no memory tier on the replacement): a copy delivered to the restore's read
    waiting for it is let go as it is with a tier (SPEC.md §19.3, ``PeerCopies.deliver``: a copy
    handed over is kept by no tier), not also held for the rest of the run."""
    _, got = run_group(_own_none_body, 2, tmp_path, str(tmp_path))
    assert got["served"] and got["counts"]["store"] == 0, got
    assert got["held"] == [0, 0], got


def _own_none_held_body(rank: int, world: int, home: str) -> dict:
    """As ``_own_none_body``, but rank 1 asks for nothing while the copies travel, so every copy
    lands ahead of its read and is held; it then reads the first object of each message and
    says how many bytes the copies still held keep alive (each distinct buffer under them)."""
    tier_for, own, theirs = _buddy_host(rank, os.path.join(home, f"heldhost{rank}"))
    if rank == 0:
        start_fetch(None, slot=0, commit=C1, own=own, tier_for=tier_for).wait()
        return {}
    copies, _ = start_fetch(None, slot=1, commit=C1, own=None, tier_for=tier_for).wait()
    order = sorted(theirs.items(), key=lambda kv: (len(kv[1]), kv[0]))  # the order they came: 2 a message
    for oid, data in order[::2]:
        into = bytearray(len(data))
        assert copies.read_verified_into(oid, memoryview(into)) == len(data) and into == data
    bases = {}
    for held, _, _ in copies._objects.values():
        base = held.obj if isinstance(held, memoryview) else held
        bases[id(base)] = memoryview(base).nbytes
    return {"held": copies._held, "nbytes": copies.nbytes(), "alive": sum(bases.values())}


def test_a_worker_without_a_tier_holds_no_more_than_the_bytes_of_the_copies_it_holds(tmp_path: Path) -> None:
    """``own=None``: a copy landed ahead of its read is held, counted against ``max_held`` by its
    own size (SPEC.md §19.3), so it must not keep alive the rest of the message it came in (other
    objects, already read and let go): the bound would count a fraction of the memory held."""
    _, got = run_group(_own_none_held_body, 2, tmp_path, str(tmp_path))
    assert got["held"] == got["nbytes"] > 0, got
    assert got["alive"] == got["held"], got
