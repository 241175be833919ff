"""One storage conformance suite, run on every backend: memory://, a local directory, S3 (moto).

``StorageConformance`` holds the tests; each subclass only says how to open a fresh,
empty store. The suite pins the ``Storage`` protocol's contract as the store uses it:
create-only objects, compare-and-swap refs, reading back through ``Store.get`` (which
re-hashes), listing, delete, mtime and sizes. The race test of the compare-and-swap runs
on the local backend only (moto does not serialise concurrent conditional writes).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from typing import Any

import pytest

from shardstore import ObjectNotFound, RefConflict, Store, open_store
from shardstore.backends.base import BatchedWrites, HashedReads, Storage, StreamedReads
from shardstore.errors import CorruptObject, ObjectTooLarge
from shardstore.format.tensors import hash_bytes
from shardstore.store import object_key

try:  # `python -m pytest` from the root, or plain `pytest` (rootdir/tests on sys.path)
    from tests.s3_server import S3Server, s3_server  # noqa: F401  (fixture)
except ImportError:  # pragma: no cover
    from s3_server import S3Server, s3_server  # type: ignore[no-redef]  # noqa: F401

FAKE = "ab" + "0" * 62


class StorageConformance:
    """The contract every backend must keep. Subclasses provide ``store`` and the optional
    fast paths (``backends.base``'s Protocols) they are documented to offer."""

    FAST_PATHS: frozenset[type] = frozenset()

    @pytest.fixture
    def store(self) -> Store:  # pragma: no cover - overridden
        raise NotImplementedError

    def test_offers_exactly_its_documented_fast_paths(self, store: Store) -> None:
        s = store.storage
        assert isinstance(s, Storage)
        offered = {p for p in (HashedReads, StreamedReads, BatchedWrites) if isinstance(s, p)}
        assert offered == self.FAST_PATHS

    def test_read_refuses_past_its_limit_before_allocating(self, store: Store) -> None:
        s = store.storage
        s.write_once("objects/ab/" + FAKE, b"x" * 100)
        assert bytes(s.read("objects/ab/" + FAKE, limit=100)) == b"x" * 100
        with pytest.raises(ObjectTooLarge):
            s.read("objects/ab/" + FAKE, limit=99)

    def test_create_only_objects(self, store: Store) -> None:
        s = store.storage
        assert s.write_once("objects/ab/" + FAKE, b"first") is True
        assert s.write_once("objects/ab/" + FAKE, b"second") is False
        assert bytes(s.read("objects/ab/" + FAKE)) == b"first"

    def test_put_get_verifies(self, store: Store) -> None:
        data = b"some tensor bytes" * 100
        oid = store.put(data)
        assert oid == hash_bytes(data)
        assert store.has(oid)
        assert bytes(store.get(oid)) == data
        assert store.put(data) == oid  # idempotent
        assert store.put_with_id(oid, data) is False

    def test_get_rejects_bytes_that_do_not_hash_to_their_name(self, store: Store) -> None:
        store.storage.write_once(object_key(FAKE), b"not what the name says")
        with pytest.raises(CorruptObject, match=FAKE):
            store.get(FAKE)

    def test_missing(self, store: Store) -> None:
        s = store.storage
        assert not s.exists("objects/ab/" + FAKE)
        assert s.size("objects/ab/" + FAKE) is None
        assert s.mtime("objects/ab/" + FAKE) is None
        with pytest.raises(ObjectNotFound, match=FAKE):
            s.read("objects/ab/" + FAKE)
        with pytest.raises(ObjectNotFound):
            store.get(FAKE)

    def test_sizes_and_empty_object(self, store: Store) -> None:
        empty = store.put(b"")
        assert store.object_size(empty) == 0
        assert bytes(store.get(empty)) == b""
        big = bytes(range(256)) * 4096  # 1 MiB
        oid = store.put(big)
        assert store.object_size(oid) == len(big)
        assert bytes(store.get(oid)) == big

    def test_mtime_is_recent(self, store: Store) -> None:
        oid = store.put(b"fresh")
        m = store.storage.mtime(object_key(oid))
        assert m is not None and abs(time.time() - m) < 120

    def test_ensure_refreshes_a_present_object(self, store: Store) -> None:
        """``Store.ensure`` (every writer relying on a present object) makes it young again
        and gives its size; the same for a duplicate ``put`` (issue 12, item 1)."""
        oid = store.put(b"kept by a later writer")
        assert store.ensure(FAKE) is None
        pause = 1.05 if type(store.storage).__name__ == "S3Storage" else 0.02  # S3's LastModified: whole seconds
        for refresh in (lambda: store.ensure(oid), lambda: store.put(b"kept by a later writer")):
            first = store.storage.mtime(object_key(oid))
            time.sleep(pause)
            refresh()
            assert store.storage.mtime(object_key(oid)) > first
        assert store.ensure(oid) == len(b"kept by a later writer")

    def test_listing(self, store: Store) -> None:
        ids = sorted(store.put(f"object {i}".encode()) for i in range(5))
        assert sorted(store.objects()) == ids
        keys = list(store.storage.list("objects"))
        assert keys == sorted(keys) and set(keys) == {object_key(o) for o in ids}
        assert list(store.storage.list("nothing-here")) == []

    def test_delete(self, store: Store) -> None:
        oid = store.put(b"doomed")
        store.storage.delete(object_key(oid))
        assert not store.has(oid)
        store.storage.delete(object_key(oid))  # deleting what is gone is not an error
        assert store.put(b"doomed") == oid and store.has(oid)  # and it can be written again

    def test_ref_create_only(self, store: Store) -> None:
        a, b = store.put(b"a"), store.put(b"b")  # a ref names a present object (the gc fence checks)
        store.set_ref("main", a, expected=None)
        assert store.ref("main") == a
        with pytest.raises(RefConflict, match="refs/main"):
            store.set_ref("main", b, expected=None)
        assert store.ref("main") == a

    def test_ref_compare_and_swap(self, store: Store) -> None:
        a, b, c = (store.put(x) for x in (b"a", b"b", b"c"))
        store.set_ref("runs/main", a, expected=None)
        store.set_ref("runs/main", b, expected=a)
        with pytest.raises(RefConflict):
            store.set_ref("runs/main", c, expected=a)  # stale
        assert store.ref("runs/main") == b
        with pytest.raises(RefConflict):
            store.set_ref("absent", c, expected=a)  # expected a ref that does not exist
        assert store.ref("absent") is None
        assert store.refs() == {"runs/main": b}

    def test_delete_ref_and_resolve(self, store: Store) -> None:
        oid = store.put(b"commit-ish")
        store.set_ref("main", oid, expected=None)
        assert store.resolve("main") == oid
        assert store.resolve(oid[:10]) == oid
        store.delete_ref("main", expected=oid)
        assert store.ref("main") is None and store.refs() == {}

    def test_delete_if_is_a_compare_and_delete(self, store: Store) -> None:
        s, a, b = store.storage, b"a\n", b"b\n"
        s.swap("refs/x", None, a)
        with pytest.raises(RefConflict, match="refs/x"):
            s.delete_if("refs/x", b)  # holds another value: kept
        assert bytes(s.read("refs/x")) == a
        s.delete_if("refs/x", a)
        assert not s.exists("refs/x")
        with pytest.raises(RefConflict, match="refs/x"):
            s.delete_if("refs/x", a)  # already gone

    def test_ref_and_pin_deletes_keep_what_a_concurrent_writer_swapped_in(self, store: Store) -> None:
        """The writer lands between the delete's read and its delete: before, the delete removed
        the new ref value / the objects just added to the pin (handing them to gc)."""
        a, b, c = (store.put(x) for x in (b"a", b"b", b"c"))
        store.set_ref("main", a, expected=None)
        store.pin("keep", [a], expected=None)
        inner_delete_if = store.storage.delete_if

        def racing(key: str, expected: bytes) -> None:
            if key.endswith("refs/main"):
                store.set_ref("main", b, expected=a)
            else:
                store.add_to_pin("keep", [c])
            inner_delete_if(key, expected)

        store.storage.delete_if = racing  # type: ignore[method-assign]
        with pytest.raises(RefConflict):
            store.delete_ref("main", expected=a)
        with pytest.raises(RefConflict):
            store.unpin("keep")
        store.storage.delete_if = inner_delete_if  # type: ignore[method-assign]
        assert store.ref("main") == b and store.pinned("keep") == tuple(sorted((a, c)))
        store.unpin("keep")
        assert store.pinned("keep") is None

    def test_reopen_sees_the_same_store(self, store: Store) -> None:
        oid = store.put(b"persisted")
        store.set_ref("main", oid, expected=None)
        again = self.reopen(store)
        assert again.ref("main") == oid and bytes(again.get(oid)) == b"persisted"

    def reopen(self, store: Store) -> Store:
        return Store(store.storage, create=False)


class TestMemory(StorageConformance):
    @pytest.fixture
    def store(self) -> Store:
        return open_store(f"memory://conformance-{uuid.uuid4().hex}")


class TestLocal(StorageConformance):
    FAST_PATHS = frozenset({HashedReads, StreamedReads, BatchedWrites})

    @pytest.fixture
    def store(self, tmp_path: Any) -> Store:
        return open_store(str(tmp_path / "store"))

    def reopen(self, store: Store) -> Store:
        return open_store(store.url, create=False)

    def test_cas_race_exactly_one_winner_per_round(self, store: Store) -> None:
        procs, rounds = 4, 6
        ctx = mp.get_context("fork")
        barrier = ctx.Barrier(procs)
        results = ctx.Queue()
        workers = [
            ctx.Process(target=_race_worker, args=(store.url, i, rounds, barrier, results)) for i in range(procs)
        ]
        for w in workers:
            w.start()
        outcomes = [results.get(timeout=60) for _ in range(procs * rounds)]
        for w in workers:
            w.join(timeout=60)
            assert w.exitcode == 0
        for r in range(rounds):
            this = [o for o in outcomes if o[0] == r]
            assert sorted(o[2] for o in this).count("won") == 1, this
            assert all(o[2] in ("won", "conflict") for o in this), this
        assert store.ref("race") is not None


def _race_worker(url: str, me: int, rounds: int, barrier: Any, results: Any) -> None:
    store = open_store(url, create=False)
    for r in range(rounds):
        barrier.wait()
        current = store.ref("race")  # every process reads the same value: the last round's winner wrote it
        barrier.wait()
        try:
            store.set_ref("race", store.put(f"{r}/{me}".encode()), expected=current)
            results.put((r, me, "won"))
        except RefConflict:
            results.put((r, me, "conflict"))
        barrier.wait()  # the round is over before anyone reads the ref again


class TestS3(StorageConformance):
    FAST_PATHS = frozenset({HashedReads, StreamedReads})

    @pytest.fixture
    def store(self, s3_server: S3Server) -> Store:  # noqa: F811
        return open_store(s3_server.url(), **s3_server.options)

    def reopen(self, store: Store) -> Store:
        from shardstore.backends.s3.storage import S3Storage

        s = store.storage
        assert isinstance(s, S3Storage)
        return Store(S3Storage(s.url, **_opts_of(s)), create=False)

    def test_probe_finds_conditional_writes(self, store: Store) -> None:
        assert store.storage.conditional is True  # type: ignore[attr-defined]
        assert list(store.storage.list("tmp")) == []  # the probe cleans up after itself


def _opts_of(storage: Any) -> dict[str, Any]:
    return dict(storage.fs.storage_options)
