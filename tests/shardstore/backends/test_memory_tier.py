"""The memory tier (``backends.memory_tier``) and the tiers above a store (``backends.tiers``):
what a tier holds and evicts over many commits, where its directory may live, and reads served
memory → peers → store with every copy verified against its id and counted per tier."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import blake3
import pytest
import torch
from conftest import TinyNet, make_optimizer, train_steps

import shardstore as ss
from shardstore.backends.memory_tier import MemoryTier, default_tier_root
from shardstore.backends.tiers import PeerCopies, TieredStorage
from shardstore.errors import TierError
from shardstore.format.closure import commit_closure


def _tiered(store: ss.Store, *tiers: object, fill: MemoryTier | None = None) -> tuple[ss.Store, TieredStorage]:
    storage = TieredStorage(store.storage, list(tiers), fill=fill)  # type: ignore[arg-type]
    return ss.Store(storage, create=False), storage


def _closure(store: ss.Store, cid: str) -> set[str]:
    return commit_closure(ss.load_commit(store, cid), slot=0).ids()


def _flip(tier: MemoryTier, oid: str) -> None:
    path = Path(tier.dir) / "objects" / oid[:2] / oid
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("keep", [1, 2])
def test_the_tier_holds_the_closure_of_the_last_k_commits_over_many_commits(tmp_path: Path, keep: int) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    tier = MemoryTier(str(tmp_path / "tier"), 0, keep=keep)
    writer, _ = _tiered(store, tier, fill=tier)  # write-through: every object a commit writes lands in the tier
    model, opt = TinyNet(), None
    opt = make_optimizer(model)
    closures: list[set[str]] = []
    for step in range(1, 7):
        train_steps(model, opt, 1, seed=step)
        cid = ss.save(writer, model, opt, step=step)
        closures.append(_closure(store, cid))
        held = tier.hold(cid, closures[-1])
        want = set().union(*closures[-keep:])
        assert set(tier.objects()) == want  # older commits' objects evicted, nothing of the last K missing
        assert held == tier.nbytes() == sum(store.object_size(o) or 0 for o in want)
        assert [h.commit for h in tier.held()][-1] == cid and len(tier.held()) == min(step, keep)
    assert len(closures[0] - set(tier.objects())) > 0  # the first commit's changed tensors are gone


def test_restore_reads_memory_first_and_a_corrupt_copy_costs_a_store_read(tmp_path: Path) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    tier = MemoryTier(str(tmp_path / "tier"), 0)
    model = TinyNet()
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    writer, _ = _tiered(store, tier, fill=tier)
    cid = ss.save(writer, model, opt, step=2)
    tier.hold(cid, _closure(store, cid))
    # From memory: every object, none from the store.
    reader, counted = _tiered(store, tier, fill=tier)
    fresh = TinyNet(seed=5)
    ss.restore(reader, cid, fresh, make_optimizer(fresh))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert counted.counts()["store"] == 0 and counted.counts()["memory"] > 0 and not counted.rejected
    # A flipped byte in the tier's copy: detected against the id, read from the store, named.
    victim = ss.load_commit(store, cid).shards[0].entries[0].param
    _flip(tier, victim)
    reader, counted = _tiered(store, tier, fill=tier)
    again = TinyNet(seed=6)
    ss.restore(reader, cid, again, make_optimizer(again))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert counted.counts()["store"] == store.object_size(victim)
    assert len(counted.rejected) == 1 and victim in counted.rejected[0] and tier.dir in counted.rejected[0]
    assert "does not hash to its id" in counted.rejected[0]
    # The verified copy from the store replaced the corrupt one: the next restore reads memory only.
    reader, counted = _tiered(store, tier, fill=tier)
    ss.restore(reader, cid, TinyNet(seed=7))
    assert counted.counts()["store"] == 0 and not counted.rejected


def test_a_peer_copy_is_used_only_if_it_hashes_to_its_id_and_the_peer_is_named(tmp_path: Path) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    model = TinyNet()
    cid = ss.save(store, model, step=1)
    lc = ss.load_commit(store, cid)
    good, bad = lc.shards[0].entries[0].param, lc.shards[0].entries[1].param
    peers = PeerCopies()
    peers.add(good, bytes(store.get(good)), peer=1)
    wrong = bytearray(store.get(bad))
    wrong[0] ^= 0xFF
    peers.add(bad, bytes(wrong), peer=2)
    empty = MemoryTier(str(tmp_path / "tier"), 0)
    reader, counted = _tiered(store, empty, peers, fill=empty)
    ss.restore(reader, cid, TinyNet(seed=3))
    counts = counted.counts()
    assert counts["peers"] == store.object_size(good)
    assert counts["store"] > store.object_size(bad) and counts["memory"] == 0  # the rest, manifests included
    assert counted.rejected == [
        f"object {bad}: the copy from peer slot 2 does not hash to its id (its bytes hash to "
        f"{ss.format.tensors.hash_bytes(bytes(wrong))}); not used"
    ]
    # the store's copy is kept in the tier (read-allocate), the peer's is not: its buddy's tier holds it (SPEC.md §19.3)
    assert not empty.has(good) and empty.has(bad)


def test_a_tier_copy_of_the_wrong_size_is_refused_before_it_lands(tmp_path: Path) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    cid = ss.save(store, TinyNet(), step=1)
    oid = ss.load_commit(store, cid).shards[0].entries[0].param
    peers = PeerCopies()
    peers.add(oid, bytes(store.get(oid)) + b"\0", peer=0)
    reader, counted = _tiered(store, peers)
    dest = torch.empty(store.object_size(oid) // 4, dtype=torch.float32)
    reader.read_into(oid, dest)
    assert counted.counts() == {"memory": 0, "peers": 0, "store": dest.numel() * 4}
    assert "has " in counted.rejected[0] and "not the" in counted.rejected[0]


def test_a_peer_copy_read_into_another_device_is_staged_and_let_go(tmp_path: Path) -> None:
    """A block whose destination is not in CPU memory (here the meta device, standing in for a
    GPU) is read into a CPU buffer and copied out: the read takes the verified peer copy
    (``read_verified_into``) and lets it go, where a read that went through ``get_tensor`` would
    leave it held by ``PeerCopies`` for the rest of the restore."""
    from shardstore.format.grid import read_jobs, run_reads

    store = ss.open_store(str(tmp_path / "store"))
    x = torch.arange(64, dtype=torch.float32)
    oid = store.put_tensor(x)
    peers = PeerCopies()
    peers.add(oid, bytearray(store.get(oid)), peer=1, verified=True)
    reader, counted = _tiered(store, peers)
    dest = torch.empty(64, device="meta")
    assert run_reads(read_jobs(reader, oid, "float32", (64,), dest, (0,), "w"), threads=1) == 256
    assert counted.counts() == {"memory": 0, "peers": 256, "store": 0}
    assert len(peers) == 0 and peers.nbytes() == 0  # handed to the read and let go


def test_an_object_named_as_two_dtypes_is_taken_from_its_peer_once(tmp_path: Path) -> None:
    """One peer copy of an object that two tensors name as different dtypes: read once, both
    filled from it; none of it from the store (a second read would find the copy let go)."""
    from shardstore.format.grid import read_jobs, run_reads

    store = ss.open_store(str(tmp_path / "store"))
    x = torch.linspace(-1, 1, 64)
    oid = store.put_tensor(x)
    peers = PeerCopies()
    peers.add(oid, bytearray(store.get(oid)), peer=1, verified=True)
    reader, counted = _tiered(store, peers)
    a, b = torch.zeros(64), torch.zeros(8, 8, dtype=torch.int32)
    jobs = read_jobs(reader, oid, "float32", (64,), a, (0,), "a") + read_jobs(
        reader, oid, "int32", (8, 8), b, (0, 0), "b"
    )
    assert run_reads(jobs, threads=2, once_per_object=True) == 256
    assert counted.counts() == {"memory": 0, "peers": 256, "store": 0}
    assert torch.equal(a, x) and torch.equal(b, x.view(torch.int32).reshape(8, 8))


def test_peer_copies_held_ahead_of_their_reads_stay_within_their_bound(tmp_path: Path) -> None:
    """Copies that land before any read asks for them are held up to ``max_held`` bytes: one
    past the bound is not kept (counted as dropped), its read goes to the store, and the copies
    held are still handed to their reads."""
    store = ss.open_store(str(tmp_path / "store"))
    xs = [torch.full((64,), float(i)) for i in range(3)]  # 256 bytes each
    oids = [store.put_tensor(x) for x in xs]
    peers = PeerCopies(max_held=600)
    kept = [peers.add(oid, memoryview(bytes(store.get(oid))), peer=1, verified=True, copy=True) for oid in oids]
    assert kept == [True, True, False]  # the third would hold 768 bytes
    assert peers.held_peak == 512 and peers.dropped == 256 and len(peers) == 2
    reader, counted = _tiered(store, peers)
    dests = [torch.empty(64) for _ in xs]
    for oid, dest in zip(oids, dests):
        reader.read_into(oid, dest)
    assert counted.counts() == {"memory": 0, "peers": 512, "store": 256}
    assert all(torch.equal(d, x) for d, x in zip(dests, xs))
    assert len(peers) == 0 and peers.nbytes() == 0  # each held copy let go once read


def test_a_copy_past_the_bound_goes_to_a_read_that_began_waiting_after_deliver_found_none(tmp_path: Path) -> None:
    """``fetch_replicas`` lands a verified copy with ``deliver`` (no read waiting yet) and then
    ``add``; a read that starts waiting for it between the two must get the copy even when
    holding it would pass ``max_held``: the copy is not held ahead of a read (one is waiting for
    it), and dropping it sent that read to the store for bytes already verified in hand."""
    store = ss.open_store(str(tmp_path / "store"))
    x = torch.arange(64, dtype=torch.float32)
    oid = store.put_tensor(x)
    data = bytes(store.get(oid))
    peers = PeerCopies(pending=True, max_held=0)  # nothing may be held ahead of its read
    peers.expect([oid])
    receive = memoryview(bytearray(data))  # the exchange's receive buffer, just hashed to oid
    assert peers.deliver(oid, receive, 1) == 0  # no read waiting yet
    reader, counted = _tiered(store, peers)
    dest = torch.zeros(64)
    t = _waiting_read(reader, oid, dest, peers)  # the restore asks for it now
    assert peers.add(oid, receive, 1, verified=True, copy=True)  # handed to that read, not dropped
    t.join(5)
    assert not t.is_alive()
    assert torch.equal(dest, x) and counted.counts() == {"memory": 0, "peers": len(data), "store": 0}
    assert peers.dropped == 0 and peers.held_peak == 0 and len(peers) == 0 and peers._held == 0


class _CountingBlake3:
    """BLAKE3 with the bytes it is fed counted (class-wide ``hashed``): shardstore's one hasher."""

    AUTO = blake3.blake3.AUTO
    hashed = 0

    def __init__(self, data: object = None, **kwargs: object) -> None:
        self._h = blake3.blake3(**kwargs)
        if data is not None:
            self.update(data)

    def update(self, data: object) -> _CountingBlake3:
        type(self).hashed += memoryview(data).nbytes  # type: ignore[arg-type]
        self._h.update(data)
        return self

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@pytest.mark.parametrize("source", ["memory", "peers", "store"])
def test_each_byte_read_through_the_tiers_is_hashed_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    cid = ss.save(store, TinyNet(), step=1)
    oid = ss.load_commit(store, cid).shards[0].entries[0].param
    tier = MemoryTier(str(tmp_path / "tier"), 0)
    peers = PeerCopies()
    if source == "memory":
        tier.put(oid, store.get(oid))
    elif source == "peers":
        peers.add(oid, bytes(store.get(oid)), peer=1)
    reader, counted = _tiered(store, tier, peers, fill=tier)  # fill: a store read is kept in memory too
    dest = torch.empty(store.object_size(oid) // 4, dtype=torch.float32)
    monkeypatch.setattr(ss.format.tensors, "blake3", SimpleNamespace(blake3=_CountingBlake3))
    monkeypatch.setattr(_CountingBlake3, "hashed", 0)
    reader.read_into(oid, dest)
    assert _CountingBlake3.hashed == dest.numel() * 4  # verified once on its way in, not once per layer
    assert counted.counts()[source] == dest.numel() * 4 and not counted.rejected
    assert torch.equal(dest.view(torch.uint8), torch.frombuffer(bytearray(store.get(oid)), dtype=torch.uint8))
    # a copy from the store is kept in the memory tier (read-allocate); a peer's is not, its
    # buddy's tier holds it and the next commit writes it through (SPEC.md §19.3)
    assert tier.has(oid) == (source != "peers")


def test_every_write_goes_to_the_store_and_objects_also_to_the_tier(tmp_path: Path) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    tier = MemoryTier(str(tmp_path / "tier"), 0)
    writer, _ = _tiered(store, tier, fill=tier)
    cid = ss.save(writer, TinyNet(), step=1, ref="main")
    assert store.ref("main") == cid  # refs are the durable store's
    assert ss.verify(store).ok
    assert _closure(store, cid) <= set(tier.objects())
    assert not (Path(tier.dir) / "refs").exists()


def test_a_tier_directory_must_be_private_to_this_user(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(TierError, match="others may write it"):
        MemoryTier(str(shared), 0)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(TierError, match="not a directory"):
        MemoryTier(str(tmp_path / "link"), 0)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(TierError):
        MemoryTier(str(tmp_path / "file"), 0)
    with pytest.raises(TierError, match="at least one commit"):
        MemoryTier(str(tmp_path / "ok"), 0, keep=0)


def test_an_index_that_does_not_decode_is_no_index(tmp_path: Path) -> None:
    tier = MemoryTier(str(tmp_path / "tier"), 3)
    oid = "ab" * 32
    tier.put(oid, b"x")  # its id is wrong on purpose: the index is what is checked here
    tier.hold("cd" * 32, [oid])
    assert tier.holds("cd" * 32) == (oid,)
    index = Path(tier.dir) / "held.json"
    for raw in (
        b"{",
        b'{"version": 1, "commits": [{"commit": "../x", "objects": []}]}',
        b'{"version": 9, "commits": []}',
    ):
        index.write_bytes(raw)
        assert tier.held() == () and tier.holds("cd" * 32) is None


def test_the_default_root_is_named_for_the_store_and_the_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHARDSTORE_TIER_ROOT", str(tmp_path))
    a, b = default_tier_root("/data/store-a"), default_tier_root("s3://bucket/store-a")
    assert a != b and os.path.dirname(a) == str(tmp_path) and f"-{os.geteuid()}-" in os.path.basename(a)
    assert default_tier_root("/data/store-a") == a == default_tier_root("file:///data/store-a")
    assert default_tier_root("store-a") == default_tier_root(os.path.join(os.getcwd(), "store-a"))
    monkeypatch.delenv("SHARDSTORE_TIER_ROOT")
    assert default_tier_root("/data/store-a").startswith("/dev/shm/" if os.path.isdir("/dev/shm") else "/")


def test_a_peer_copy_that_landed_before_its_read_is_held_in_memory_read_unhashed_once_and_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``fetch_replicas`` does with a copy no read is waiting for yet: verified as it lands and
    held in this process's memory (no tier file); the read copies it into its tensor unhashed,
    after which it is let go (the memory held is what landed ahead of the reads), and the tier
    never gets it."""
    store = ss.open_store(str(tmp_path / "store"))
    cid = ss.save(store, TinyNet(), step=1)
    entries = ss.load_commit(store, cid).shards[0].entries
    a, b = entries[0].param, entries[1].param
    tier = MemoryTier(str(tmp_path / "tier"), 0)
    peers = PeerCopies()
    for oid in (a, b):  # as fetch_replicas lands them: hashed in its buffer, copied out of it
        peers.add(oid, bytearray(store.get(oid)), peer=1, verified=True)
    held = store.object_size(a) + store.object_size(b)
    assert peers.nbytes() == held == peers.held_peak
    monkeypatch.setattr(ss.format.tensors, "blake3", SimpleNamespace(blake3=_CountingBlake3))
    monkeypatch.setattr(_CountingBlake3, "hashed", 0)
    reader, counted = _tiered(store, tier, peers, fill=tier)  # the tier first, as a worker reads
    dest_a = torch.empty(store.object_size(a) // 4, dtype=torch.float32)
    reader.read_into(a, dest_a)
    assert _CountingBlake3.hashed == 0  # verified as it arrived; copied straight into the tensor
    assert counted.counts() == {"memory": 0, "peers": dest_a.numel() * 4, "store": 0}
    assert peers.nbytes() == store.object_size(b) and a in peers  # let go once read; b still held
    assert not tier.has(a) and tier.objects() == []  # no tier keeps a peer's copy (SPEC.md §19.3)
    assert torch.equal(dest_a.view(torch.uint8), torch.frombuffer(bytearray(store.get(a)), dtype=torch.uint8))
    peers.clear()
    assert peers.nbytes() == 0 and peers.held_peak == held


def _waiting_read(reader: ss.Store, oid: str, dest: torch.Tensor, peers: PeerCopies) -> threading.Thread:
    """``reader.read_into(oid, dest)`` on a thread of its own, returned once it waits for ``oid``'s copy."""
    t = threading.Thread(target=reader.read_into, args=(oid, dest))
    t.start()
    for _ in range(5000):  # until the read has left its buffer with the copies (at most 5 s)
        if peers._waiting.get(oid):
            return t
        threading.Event().wait(0.001)
    pytest.fail("the read never waited for the copy on its way")


def test_a_read_waiting_for_a_peer_copy_gets_the_verified_bytes_without_reading_the_tier_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``fetch_replicas`` does with a copy a restore is waiting for: hashed in its receive
    buffer and copied from there into the waiting read's tensor (``deliver``). The restore neither
    hashes it again nor writes it to its tier (its buddy's tier holds it: SPEC.md §19.3)."""
    store = ss.open_store(str(tmp_path / "store"))
    cid = ss.save(store, TinyNet(), step=1)
    oid = ss.load_commit(store, cid).shards[0].entries[0].param
    data = bytes(store.get(oid))
    tier = MemoryTier(str(tmp_path / "tier"), 0)
    peers = PeerCopies(pending=True)
    peers.expect([oid])
    calls = {"put": 0, "fetch_into": 0}
    for name in calls:
        real = getattr(MemoryTier, name)

        def counted(*a: object, _real: object = real, _name: str = name, **k: object) -> object:
            calls[_name] += 1
            return _real(*a, **k)  # type: ignore[operator]

        monkeypatch.setattr(MemoryTier, name, counted)
    reader, counted_tiers = _tiered(store, tier, peers, fill=tier)
    dest = torch.zeros(len(data) // 4, dtype=torch.float32)
    t = _waiting_read(reader, oid, dest, peers)
    assert not dest.any()  # nothing lands before the copy is verified
    monkeypatch.setattr(ss.format.tensors, "blake3", SimpleNamespace(blake3=_CountingBlake3))
    monkeypatch.setattr(_CountingBlake3, "hashed", 0)
    receive = memoryview(bytearray(data))  # the exchange's receive buffer
    assert ss.format.tensors.hash_bytes(receive) == oid  # the landing's one hash
    assert peers.deliver(oid, receive, 1) == 1
    t.join(5)
    assert not t.is_alive()
    assert _CountingBlake3.hashed == len(data)  # once, by the landing; the restore hashed nothing
    assert calls == {"put": 0, "fetch_into": 0}  # neither written to the tier nor read from it
    assert counted_tiers.counts() == {"memory": 0, "peers": len(data), "store": 0}
    assert dest.numpy().tobytes() == data and not tier.has(oid) and len(peers) == 0


def test_a_peer_copy_refused_as_it_lands_leaves_a_waiting_read_to_the_store(tmp_path: Path) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    cid = ss.save(store, TinyNet(), step=1)
    oid = ss.load_commit(store, cid).shards[0].entries[0].param
    data = bytes(store.get(oid))
    peers = PeerCopies(pending=True)
    peers.expect([oid])
    reader, counted = _tiered(store, peers)
    dest = torch.zeros(len(data) // 4, dtype=torch.float32)
    t = _waiting_read(reader, oid, dest, peers)
    assert not dest.any()
    peers.refused(oid)  # its bytes did not hash to its id: nothing delivered
    t.join(5)
    assert dest.numpy().tobytes() == data and counted.counts() == {"memory": 0, "peers": 0, "store": len(data)}


def test_a_restore_reads_the_peers_copies_in_the_order_they_come(tmp_path: Path) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    net = TinyNet()
    cid = ss.save(store, net, step=1)
    oids = [e.param for e in ss.load_commit(store, cid).shards[0].entries]
    coming = list(reversed(oids[1:]))  # the first one held here, the rest coming last first
    peers = PeerCopies(pending=True)
    peers.expect(coming)
    reader, _ = _tiered(store, peers)
    order: list[str] = []
    real = TieredStorage.read_into_hashed

    def spy(self: TieredStorage, key: str, out: memoryview) -> tuple[int, str]:
        order.append(key.rsplit("/", 1)[-1])
        return real(self, key, out)

    peers.done()  # nothing comes after all: every read goes on to the store, in the same order
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TieredStorage, "read_into_hashed", spy)
        ss.restore(reader, cid, TinyNet(), threads=1)
    assert [o for o in order if o in oids] == [oids[0], *coming]


def test_no_read_ahead_from_the_store_for_an_object_a_tier_will_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    cid = ss.save(store, TinyNet(), step=1)
    a, b, c = (e.param for e in ss.load_commit(store, cid).shards[0].entries[:3])
    tier = MemoryTier(str(tmp_path / "tier"), 0)
    tier.put(a, store.get(a))
    peers = PeerCopies(pending=True)
    peers.expect([b])
    asked: list[str] = []
    monkeypatch.setattr(type(store.storage), "read_ahead", lambda self, key: asked.append(key.rsplit("/", 1)[-1]))
    reader, _ = _tiered(store, tier, peers, fill=tier)
    for oid in (a, b, c):
        reader.read_ahead(oid)
    assert asked == [c]  # only the one no tier holds or has coming


def test_read_state_dict_on_threads_takes_an_object_several_tensors_name_from_its_peer_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_state_dict`` into fresh tensors on several threads (checks and reads overlapped):
    equal tensors (one object, named as two dtypes and shapes here) are read once, as the restore
    reads them (``run_reads(once_per_object=True)``), so the peer's copy, handed to one read and
    let go, serves all of them and none is read from the store."""
    from shardstore.backends.local import LocalStorage

    store = ss.open_store(str(tmp_path / "store"))
    sd = {
        "a": torch.zeros(1000),
        "b": torch.zeros(1000),
        "c": torch.zeros(10, 100, dtype=torch.int32),
        "d": torch.ones(5),
    }
    cid = ss.save_state_dict(store, sd)
    peers = PeerCopies()
    for oid in store.objects():
        peers.add(oid, bytearray(store.get(oid)), peer=1, verified=True)
    reader, _ = _tiered(store, peers)
    durable: list[str] = []
    real = LocalStorage.read_into

    def counted(self: LocalStorage, key: str, *a: object, **k: object) -> int:
        durable.append(key)
        return real(self, key, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalStorage, "read_into", counted)
    got = ss.read_state_dict(reader, cid, threads=4)
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    assert durable == []  # every tensor from the peer's copies, each taken once
