"""The S3 backend against a real S3-compatible HTTP server (moto, on 127.0.0.1).

What the conformance suite cannot show: that requests carry the right conditions, the
probe of conditional writes (and refusing ref updates where the server ignores them),
multipart uploads and ranged reads, bounded retries of transient failures (injected by a
client proxy in front of the real aiobotocore client), a ref write whose answer was lost,
bounded concurrency, and a whole commit saved, verified and restored on S3.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from botocore.exceptions import ClientError, ReadTimeoutError

import shardstore as ss
from shardstore import InvalidName, RefConflict, StorageError
from shardstore.backends.s3.requests import probe_conditions
from shardstore.backends.s3.storage import S3Storage
from shardstore.format.tensors import hash_bytes, new_hasher

try:
    from tests.s3_server import S3Server, make_client, s3_server  # noqa: F401  (fixture)
except ImportError:  # pragma: no cover
    from s3_server import S3Server, make_client, s3_server  # type: ignore[no-redef]  # noqa: F401

MiB = 1024 * 1024


def client_error(status: int, code: str, op: str = "PutObject") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": f"injected {code}"}, "ResponseMetadata": {"HTTPStatusCode": status}}, op
    )


class ProxyClient:
    """Stands in front of the real client: records calls, injects faults, can strip conditions."""

    def __init__(self, real: Any, strip_conditions: bool | tuple[str, ...] = False) -> None:
        self.real = real
        self.faults: dict[str, list[Any]] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.strip = strip_conditions
        self.in_flight = 0
        self.max_in_flight = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.real, name)

        async def call(**kw: Any) -> Any:
            self.calls.append((name, {k: v for k, v in kw.items() if k != "Body"}))
            if self.strip is True or (self.strip and name in self.strip):  # all requests, or the named methods
                kw = {k: v for k, v in kw.items() if k not in ("IfNoneMatch", "IfMatch")}
            queue = self.faults.get(name)
            fault = queue.pop(0) if queue else None
            if fault is not None and not isinstance(fault, tuple):
                raise fault
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(0)
                result = await method(**kw)
            finally:
                self.in_flight -= 1
            if fault is not None:  # ("after", exc): the request happened, its answer is lost
                raise fault[1]
            return result

        return call


def proxied(
    server: S3Server, url: str | None = None, *, strip: bool | tuple[str, ...] = False, **kw: Any
) -> tuple[S3Storage, ProxyClient]:
    storage = S3Storage(
        url or server.url(), conditional=True, backoff=0.001, skip_instance_cache=True, **kw, **server.options
    )
    real = storage.transport.run(storage.fs.set_session)
    proxy = ProxyClient(real, strip_conditions=strip)

    async def set_session(*_a: Any, **_k: Any) -> Any:
        return proxy

    storage.fs.set_session = set_session  # type: ignore[method-assign]
    return storage, proxy


def test_open_store_dispatches_s3_urls_and_probes(s3_server: S3Server) -> None:  # noqa: F811
    store = ss.open_store(s3_server.url(), **s3_server.options)
    assert isinstance(store.storage, S3Storage) and store.storage.conditional


def test_bad_urls_are_refused(s3_server: S3Server) -> None:  # noqa: F811
    with pytest.raises(StorageError, match="s3://bucket/prefix"):
        S3Storage("s3://", **s3_server.options)
    with pytest.raises(InvalidName):
        S3Storage("s3://bucket/../escape", **s3_server.options)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        ss.open_store("s3://no-such-bucket/x", **s3_server.options)


def test_requests_carry_conditions(s3_server: S3Server) -> None:  # noqa: F811
    storage, proxy = proxied(s3_server)
    store = ss.Store(storage)
    oid = store.put(b"object bytes")
    a, b = store.put(b"a"), store.put(b"b")  # a ref names a present object (the gc fence checks)
    store.set_ref("main", a, expected=None)
    store.set_ref("main", b, expected=a)
    puts = [kw for name, kw in proxy.calls if name == "put_object"]
    by_key = {kw["Key"].rsplit("/", 1)[-1]: kw for kw in puts if not kw["Key"].endswith("/refs/main")}
    assert by_key[oid]["IfNoneMatch"] == "*"
    ref_puts = [kw for kw in puts if kw["Key"].endswith("/refs/main")]
    assert ref_puts[0]["IfNoneMatch"] == "*" and "IfMatch" not in ref_puts[0]
    assert ref_puts[1]["IfMatch"] == '"%s"' % hashlib.md5(f"{a}\n".encode()).hexdigest()  # the ETag of the version read
    with pytest.raises(RefConflict, match="refs/main"):
        store.set_ref("main", a, expected=a)


def test_server_without_conditional_writes_refuses_ref_updates(s3_server: S3Server) -> None:  # noqa: F811
    storage, proxy = proxied(s3_server, strip=True)
    storage.conditional, storage.conditional_reason = storage.transport.run(probe_conditions, storage.transport)
    assert storage.conditional is False
    assert "second create-only write" in storage.conditional_reason
    store = ss.Store(storage)
    oid = store.put(b"still stored")  # objects: head, then an unconditional put
    assert store.put_with_id(oid, b"still stored") is False and bytes(store.get(oid)) == b"still stored"
    with pytest.raises(StorageError, match="does not honour conditional writes"):
        store.set_ref("main", oid, expected=None)
    assert store.ref("main") is None


def test_server_ignoring_conditional_deletes_refuses_ref_and_pin_deletes(s3_server: S3Server) -> None:  # noqa: F811
    """A server that honours If-Match on PutObject but not on DeleteObject (S3 before conditional
    deletes, some gateways) would let a ref delete remove a value swapped in meanwhile."""
    storage, proxy = proxied(s3_server, strip=("delete_object",))
    storage.conditional, storage.conditional_reason = storage.transport.run(probe_conditions, storage.transport)
    assert storage.conditional is False and "a delete with a stale If-Match" in storage.conditional_reason
    storage.conditional = True  # as if trusted: the delete still goes out with its If-Match
    store = ss.Store(storage)
    a = store.put(b"a")
    store.set_ref("main", a, expected=None)
    store.delete_ref("main", expected=a)
    deletes = [kw for name, kw in proxy.calls if name == "delete_object" and kw["Key"].endswith("/refs/main")]
    assert deletes and deletes[-1]["IfMatch"] == '"%s"' % hashlib.md5(f"{a}\n".encode()).hexdigest()
    storage.conditional = False  # what the probe concluded: a ref or pin delete is refused
    with pytest.raises(StorageError, match="does not honour conditional"):
        storage.delete_if("pins/p", b"x")


def test_transient_errors_are_retried(s3_server: S3Server) -> None:  # noqa: F811
    storage, proxy = proxied(s3_server)
    proxy.faults["put_object"] = [client_error(503, "SlowDown"), client_error(500, "InternalError")]
    proxy.faults["get_object"] = [ReadTimeoutError(endpoint_url="http://127.0.0.1")]
    assert storage.write_once("objects/aa/x", b"payload") is True
    assert bytes(storage.read("objects/aa/x")) == b"payload"
    assert [n for n, _ in proxy.calls].count("put_object") == 3


def test_retries_are_bounded(s3_server: S3Server) -> None:  # noqa: F811
    storage, proxy = proxied(s3_server, attempts=3)
    proxy.faults["put_object"] = [client_error(503, "ServiceUnavailable") for _ in range(5)]
    with pytest.raises(StorageError, match=r"objects/aa/y.*after 3 attempts"):
        storage.write_once("objects/aa/y", b"payload")
    assert [n for n, _ in proxy.calls].count("put_object") == 3
    proxy.faults["put_object"] = [client_error(403, "AccessDenied")]
    with pytest.raises(StorageError, match="AccessDenied"):
        storage.write_once("objects/aa/z", b"payload")


def test_ref_write_whose_answer_was_lost(s3_server: S3Server) -> None:  # noqa: F811
    storage, proxy = proxied(s3_server)
    store = ss.Store(storage)
    a, b = store.put(b"a"), store.put(b"b")
    # The first put of a ref move is its gc-fence intent (SPEC.md §19.2): the fault hits the ref's.
    proxy.faults["put_object"] = [None, ("after", ReadTimeoutError(endpoint_url="http://127.0.0.1"))]
    store.set_ref("main", a, expected=None)  # landed, answer lost, retry got 412, re-read shows ours
    assert store.ref("main") == a
    proxy.faults["put_object"] = [None, ("after", ReadTimeoutError(endpoint_url="http://127.0.0.1"))]
    store.set_ref("main", b, expected=a)
    assert store.ref("main") == b


def test_multipart_upload_and_ranged_read(s3_server: S3Server) -> None:  # noqa: F811
    storage, proxy = proxied(s3_server, part_size=5 * MiB, multipart_threshold=5 * MiB)
    store = ss.Store(storage)
    data = (
        torch.randint(0, 256, (11 * MiB + 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        .numpy()
        .tobytes()
    )
    oid = store.put(data)
    names = [n for n, _ in proxy.calls]
    assert names.count("upload_part") == 3 and names.count("complete_multipart_upload") == 1
    complete = next(kw for n, kw in proxy.calls if n == "complete_multipart_upload")
    assert complete["IfNoneMatch"] == "*"
    before = len(proxy.calls)
    assert bytes(store.get(oid)) == data
    assert [n for n, _ in proxy.calls[before:]] == ["get_object"] * 3  # three ranges
    assert store.put(data) == oid and [n for n, _ in proxy.calls].count("upload_part") == 3  # HEAD first: no bytes sent


def test_multipart_race_lost_at_completion_is_already_exists(s3_server: S3Server, monkeypatch: Any) -> None:  # noqa: F811
    storage, proxy = proxied(s3_server, part_size=5 * MiB, multipart_threshold=5 * MiB)
    data = b"\x01" * (6 * MiB)
    assert storage.write_once("objects/bb/big", data) is True

    async def nothing_there(key: str) -> None:
        return None

    monkeypatch.setattr(storage, "_head", nothing_there)  # as if another writer finished meanwhile
    assert storage.write_once("objects/bb/big", data) is False
    bucket, prefix = s3_server.url().split("/")[2], storage.prefix
    assert make_client(s3_server).list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []


def test_multipart_412_without_the_object_is_refused_not_taken_as_stored(s3_server: S3Server) -> None:  # noqa: F811
    """A completion answered 412 is "already there" only once a HEAD finds the object (the
    request layer hands the 412 back to the storage, which confirms it, as for a single put)."""
    storage, proxy = proxied(s3_server, part_size=5 * MiB, multipart_threshold=5 * MiB)
    proxy.faults["complete_multipart_upload"] = [client_error(412, "PreconditionFailed", "CompleteMultipartUpload")]
    with pytest.raises(StorageError, match="holds no such object"):
        storage.write_once("objects/dd/big", b"\x03" * (6 * MiB))
    assert not storage.exists("objects/dd/big")
    assert "abort_multipart_upload" in [n for n, _ in proxy.calls]


def test_failed_multipart_upload_is_aborted(s3_server: S3Server) -> None:  # noqa: F811
    storage, proxy = proxied(s3_server, part_size=5 * MiB, multipart_threshold=5 * MiB)
    proxy.faults["upload_part"] = [None, client_error(400, "InvalidRequest", "UploadPart")]
    with pytest.raises(StorageError, match="objects/cc/big"):
        storage.write_once("objects/cc/big", b"\x02" * (11 * MiB))
    assert not storage.exists("objects/cc/big")
    assert "abort_multipart_upload" in [n for n, _ in proxy.calls]
    bucket = s3_server.url().split("/")[2]
    assert make_client(s3_server).list_multipart_uploads(Bucket=bucket, Prefix=storage.prefix).get("Uploads", []) == []


def test_concurrency_is_bounded(s3_server: S3Server) -> None:  # noqa: F811
    storage, proxy = proxied(s3_server, concurrency=4)
    blobs = [f"blob {i}".encode() * 1000 for i in range(40)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        written = list(pool.map(lambda b: storage.write_once(f"objects/dd/{hash_bytes(b)}", b), blobs))
    assert all(written)
    assert 1 < proxy.max_in_flight <= 4
    assert len(list(storage.list("objects"))) == 40


def test_commit_saved_verified_and_restored_on_s3(s3_server: S3Server) -> None:  # noqa: F811
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    store = ss.open_store(s3_server.url(), **s3_server.options)
    cid = ss.save(store, model, opt, step=1)
    assert ss.verify(store).ok
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ss.restore(store, "main", fresh, fresh_opt)
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), n
        assert torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
    assert store.ref("main") == cid
    # any torch optimizer's state (SGD momentum): its objects' sizes are queried from
    # several threads at once before anything is allocated (grid.check_stored_all)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    sgd.step()
    cid = ss.save(store, model, sgd, step=2, ref="sgd", parent=None)
    fresh_sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    ss.restore(store, cid, fresh, fresh_sgd)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(sgd.state[p]["momentum_buffer"], fresh_sgd.state[q]["momentum_buffer"])


def test_downloads_hash_ranges_in_order_as_they_stream(s3_server: S3Server) -> None:  # noqa: F811
    storage, proxy = proxied(s3_server, part_size=5 * MiB, multipart_threshold=64 * MiB, concurrency=2)
    store = ss.Store(storage)
    data = (
        torch.randint(0, 256, (23 * MiB + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        .numpy()
        .tobytes()
    )
    oid = store.put(data)
    key = f"objects/{oid[:2]}/{oid}"

    def gets() -> list[int]:  # start offsets of the ranged GETs sent so far
        return [int(kw["Range"].split("=")[1].split("-")[0]) for n, kw in proxy.calls if n == "get_object"]

    asked: list[str] = []  # every range requested, including those still queued for the semaphore
    real_call = storage.transport.call

    async def counting_call(method: str, k: str, **kw: Any) -> Any:
        if method == "get_object":
            asked.append(kw["Range"])
        return await real_call(method, k, **kw)

    storage.transport.call = counting_call  # type: ignore[method-assign]
    seen = bytearray()
    gets_at_hash: list[int] = []  # how many ranges had been requested when each range was consumed
    hashed_on: set[int] = set()

    def consume(view: memoryview) -> None:
        gets_at_hash.append(len(asked))
        hashed_on.add(threading.get_ident())
        seen.extend(view)

    async def loop_thread() -> int:
        return threading.get_ident()

    proxy.calls.clear()
    asked.clear()
    out = bytearray(len(data))
    assert storage.read_into(key, memoryview(out), consume) == len(data)
    assert bytes(out) == data and bytes(seen) == data  # every range consumed once, in order
    assert sorted(gets()) == list(range(0, len(data), 5 * MiB)) and gets()[0] == 0
    # streaming, not hash-after-download: the first range is hashed when the first GET and
    # at most `concurrency` look-ahead GETs have been requested, long before the last
    assert gets_at_hash[0] <= 1 + 2 < len(asked) == 5
    assert proxy.max_in_flight <= 2
    assert storage.transport.run(loop_thread) not in hashed_on  # 5 MiB ranges are hashed off the event loop
    later = [kw for n, kw in proxy.calls if n == "get_object"][1:]
    assert later and all(kw.get("IfMatch") for kw in later)  # one version of the object, or an error

    assert storage.hash_object(key, ss.format.tensors.new_hasher) == (oid, len(data))
    assert storage.read_hashed(key, ss.format.tensors.new_hasher)[1] == oid
    proxy.calls.clear()
    seen.clear()
    short = bytearray(10)
    assert storage.read_into(key, memoryview(short), consume) == len(data)  # wrong size: first range only
    assert len(gets()) == 1 and short == bytearray(10) and not seen


def test_odd_range_answers(s3_server: S3Server) -> None:  # noqa: F811
    """A server without ETags is read without If-Match; a 206 without Content-Range is refused."""
    storage, proxy = proxied(s3_server, part_size=5 * MiB, multipart_threshold=64 * MiB)
    data = bytes(range(256)) * (44 * 1024)  # 11 MiB: three ranges
    oid = ss.Store(storage).put(data)
    key = f"objects/{oid[:2]}/{oid}"
    real = proxy.real

    class Answers:
        drop: tuple[str, ...] = ()

        def __getattr__(self, name: str) -> Any:
            method = getattr(real, name)

            async def call(**kw: Any) -> Any:
                resp = await method(**kw)
                if name == "get_object":
                    for field in Answers.drop:
                        resp.pop(field, None)
                return resp

            return call

    proxy.real = Answers()
    Answers.drop = ("ETag",)
    proxy.calls.clear()
    assert storage.read_hashed(key, ss.format.tensors.new_hasher) == (data, oid)
    assert not [kw for n, kw in proxy.calls if n == "get_object" and "IfMatch" in kw]
    Answers.drop = ("ContentRange",)
    with pytest.raises(StorageError, match="206 without a Content-Range"):
        storage.read(key)


def test_a_corrupt_object_on_s3_is_caught_by_every_streamed_read(s3_server: S3Server, tmp_path: Any) -> None:  # noqa: F811
    from shardstore.ops.transfer import copy_commit

    storage, _ = proxied(s3_server, part_size=5 * MiB, multipart_threshold=64 * MiB)
    store = ss.Store(storage)
    # A 6 MiB object downloads as two ranges; a flipped byte in the second is caught.
    six = store.put(bytes(range(256)) * (6 * MiB // 256))
    bad6 = bytearray(bytes(store.get(six)))
    bad6[-1] ^= 1  # in the second range
    make_client(s3_server).put_object(
        Bucket=storage.bucket, Key=f"{storage.prefix}/objects/{six[:2]}/{six}", Body=bytes(bad6)
    )
    with pytest.raises(ss.CorruptObject, match=six):
        store.get(six)
    # A saved 6 MiB weight is two blocks (4 MiB + 2 MiB, SPEC.md §5.1): a corrupt block is
    # caught by restore, verify and copy.
    model = torch.nn.Linear(1024, 1536, bias=False)
    cid = ss.save(store, model, step=1, rng=False)
    oid = store.shard(store.commit(cid).layout[0].shard).entries[0].param[0].object
    key = f"objects/{oid[:2]}/{oid}"
    bad = bytearray(bytes(store.get(oid)))
    bad[-1] ^= 1
    make_client(s3_server).put_object(Bucket=storage.bucket, Key=f"{storage.prefix}/{key}", Body=bytes(bad))
    with pytest.raises(ss.CorruptObject, match=oid):
        store.get(oid)
    with pytest.raises(ss.CorruptObject, match=oid):
        ss.restore(store, cid, torch.nn.Linear(1024, 1536, bias=False))
    report = ss.verify(store, [cid])
    assert not report.ok and oid in str(report.problems[0])
    local = ss.open_store(str(tmp_path / "local"))
    with pytest.raises(ss.CorruptObject, match="nothing was written"):
        copy_commit(store, local, cid)
    assert not local.has(oid)


def test_reads_with_a_limit_refuse_before_allocating(s3_server: S3Server) -> None:  # noqa: F811
    """Issue 12, item 9: a blob under a manifest's key larger than the manifest limit is
    refused from the size the first range reports, before the object is allocated or its
    other ranges are requested (before the fix the whole object was read first)."""
    storage, proxy = proxied(s3_server, part_size=5 * MiB)
    big = b"\x03" * (11 * MiB)
    oid = hash_bytes(big)
    storage.write_once(f"objects/{oid[:2]}/{oid}", big)
    proxy.calls.clear()
    with pytest.raises(ss.ObjectTooLarge, match="over this reader's limit"):
        storage.read_hashed(f"objects/{oid[:2]}/{oid}", new_hasher, 1 * MiB)
    assert [n for n, _ in proxy.calls] == ["get_object"]


def test_copy_and_verify_shard_k_on_s3_take_slot_ks_tiles(s3_server: S3Server, tmp_path: Any) -> None:  # noqa: F811
    """``copy --shard K`` from S3 and ``verify --shard K`` on S3 (issue 26): a uint8 [2048, 2560]
    tensor (two column tiles of 2.5 MiB) held by 2 slots as a Shard(1) split holds it (on the
    row-band grid each slot's copy took both blocks); slot K's copy moves its tile and the
    manifests, and slot K verifies on S3 without the other's tile."""
    from shardstore.format.slices import make_slices
    from shardstore.ops.transfer import copy_commit
    from shardstore.store import object_key

    rows, cols = 2048, 2560
    t = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    boxes = [((0, c), (rows, cols // 2)) for c in (0, cols // 2)]
    states = [ss.SlotState({"t": t} if k == 0 else {}, slices=make_slices([("t", b)])) for k, b in enumerate(boxes)]
    store = ss.open_store(s3_server.url(), **s3_server.options)
    cid = ss.save_slots(store, states, info=ss.CommitInfo(step=0, job="j", transition="init"), ref=None, parent=None)
    lc = ss.load_commit(store, cid)
    tiles = lc.entries()["t"].param
    assert [(tuple(b.start), tuple(b.shape)) for b in tiles] == boxes
    manifests = sum(len(store.get(o)) for o in [cid, *lc.shard_ids.values()])
    for k in (0, 1):
        dst = ss.open_store(str(tmp_path / f"slot{k}"))
        result = copy_commit(store, dst, cid, slot=k)
        assert result.bytes_copied == rows * cols // 2 + manifests  # slot k's tile and the 3 manifests, nothing else
        assert dst.has(tiles[k].object) and not dst.has(tiles[1 - k].object)
        assert ss.verify(dst, [cid], slot=k).ok
    store.storage.delete(object_key(tiles[1].object))  # slot 1's tile is lost on S3
    assert ss.verify(store, [cid], slot=0).ok  # slot 0 needs none of it
    report = ss.verify(store, [cid], slot=1)
    assert [(p.kind, p.object) for p in report.problems] == [("ObjectNotFound", tiles[1].object)]


def test_piped_reads_hand_each_piece_on_as_it_streams(s3_server: S3Server) -> None:  # noqa: F811
    """``read_piped`` (a copy's read into a local store): the first range goes to the consumer in
    pieces as its body streams in, never joined into the whole range; the ranges after it in order;
    an empty object and a missing one are answered as by the other reads."""
    from shardstore.backends.s3.transport import PIPE_PIECE

    storage, proxy = proxied(s3_server, part_size=5 * MiB, multipart_threshold=64 * MiB, concurrency=2)
    gen = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (11 * MiB + 7,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    small = data[: 300 * 1024]
    keys = {}
    for blob in (data, small, b""):
        oid = hash_bytes(blob)
        keys[blob] = f"objects/{oid[:2]}/{oid}"
        storage.write_once(keys[blob], blob)

    for blob in (data, small, b""):
        starts: list[int] = []
        pieces: list[bytes] = []

        def start(total: int) -> Any:
            starts.append(total)
            return lambda piece: pieces.append(bytes(piece))

        proxy.calls.clear()
        assert storage.read_piped(keys[blob], start) == len(blob)
        assert starts == [len(blob)] and b"".join(pieces) == blob  # every byte once, in order
        assert len([n for n, _ in proxy.calls if n == "get_object"]) == max(1, -(-len(blob) // (5 * MiB)))
    first: list[int] = []
    pieces.clear()
    storage.read_piped(keys[data], lambda total: lambda piece: (first.append(len(piece)), pieces.append(piece)))
    head = first[: next(i for i in range(len(first) + 1) if sum(first[:i]) >= 5 * MiB)]
    assert sum(head) == 5 * MiB and len(head) > 1 and max(head) <= PIPE_PIECE  # streamed, not joined
    with pytest.raises(ss.ObjectNotFound):
        storage.read_piped("objects/ab/" + "ab" * 32, lambda total: lambda piece: None)


def test_a_piped_read_cut_mid_body_starts_over(s3_server: S3Server) -> None:  # noqa: F811
    """A connection lost while a piped body streams in is retried from the first byte: ``start`` is
    called again (its caller drops what the first consumer got) and the second consumer gets it all."""
    import aiohttp

    storage, proxy = proxied(s3_server, part_size=5 * MiB, multipart_threshold=64 * MiB)
    data = bytes(range(256)) * (4 * MiB // 256)
    oid = hash_bytes(data)
    key = f"objects/{oid[:2]}/{oid}"
    storage.write_once(key, data)
    real = proxy.real
    cut = [1]

    class Flaky:
        def __init__(self, body: Any) -> None:
            self.body, self.reads = body, 0

        async def read(self, n: int = -1) -> bytes:
            self.reads += 1
            if self.reads == 3 and cut[0]:
                cut[0] = 0
                raise aiohttp.ClientPayloadError("injected: the connection was lost mid-body")
            return await self.body.read(n)

        def close(self) -> None:
            self.body.close()

    class Cutting:
        def __getattr__(self, name: str) -> Any:
            method = getattr(real, name)

            async def call(**kw: Any) -> Any:
                resp = await method(**kw)
                if name == "get_object":
                    resp["Body"] = Flaky(resp["Body"])
                return resp

            return call

    proxy.real = Cutting()
    got: list[list[bytes]] = []

    def start(total: int) -> Any:
        got.append([])
        return got[-1].append

    proxy.calls.clear()
    assert storage.read_piped(key, start) == len(data)
    assert len(got) == 2 and got[0] and b"".join(got[0]) == data[: sum(map(len, got[0]))]  # the cut attempt's part
    assert b"".join(got[1]) == data and cut == [0]
    assert [n for n, _ in proxy.calls] == ["get_object", "get_object"]
