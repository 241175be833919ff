"""How many requests the S3 backend sends (counted on its transport, never timed).

A commit's small requests cost as much as its data on S3 (a round trip each), so these pin
the request budget: presence checks of many objects read listing pages instead of a HEAD
per object (``requests.listed_sizes``), a copy writes the objects a listing found absent
without looking first, and a commit of N objects costs N writes and a fixed number of
requests around them.
"""

from __future__ import annotations

import collections
import uuid
from typing import Any

import pytest
import torch

import shardstore as ss
from shardstore.backends.s3 import requests as s3_requests
from shardstore.backends.s3.storage import S3Storage
from shardstore.backends.s3.transport import S3Error
from shardstore.ops.transfer import commit_closure, copy_commit
from shardstore.store import object_key

try:
    from tests.s3_server import BUCKET, S3Server, make_client, s3_server  # noqa: F401  (fixture)
except ImportError:  # pragma: no cover
    from s3_server import BUCKET, S3Server, make_client, s3_server  # type: ignore[no-redef]  # noqa: F401


class Counted:
    """Counts the requests a storage's transport sends, by aiobotocore method (retries included)."""

    def __init__(self, storage: S3Storage, *, drop: tuple[str, ...] = ()) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.sent: list[tuple[str, dict[str, Any]]] = []
        real = storage.transport.call

        async def call(method: str, key: str, **kw: Any) -> Any:
            self.calls[method] += 1
            kw = {k: v for k, v in kw.items() if k not in drop}  # a server that ignores these parameters
            self.sent.append((method, {k: v for k, v in kw.items() if k != "Body"}))
            return await real(method, key, **kw)

        storage.transport.call = call  # type: ignore[method-assign]

    def clear(self) -> None:
        self.calls.clear()
        self.sent.clear()


def _storage(server: S3Server, **kw: Any) -> S3Storage:
    return S3Storage(server.url(), conditional=True, backoff=0.001, skip_instance_cache=True, **kw, **server.options)


def _keys(n: int) -> list[str]:
    return [f"objects/{i % 7:02x}/{i:064x}" for i in range(n)]


def test_sizes_of_many_keys_come_from_one_listing(s3_server: S3Server) -> None:  # noqa: F811
    storage = _storage(s3_server)
    keys = _keys(12)
    for i, key in enumerate(keys[:8]):
        storage.write_once(key, b"x" * i)
    counted = Counted(storage)
    assert storage.sizes(keys + ["objects/zz/not-there"]) == {key: i for i, key in enumerate(keys[:8])}
    assert counted.calls == {"list_objects_v2": 1}  # 13 keys: one lane, one page (not 13 HEADs)
    assert storage.sizes([]) == {}


@pytest.mark.parametrize("ignores_start", [False, True], ids=["start-after", "server-ignores-start-after"])
def test_sizes_walk_pages_and_lanes_exactly(
    s3_server: S3Server,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    ignores_start: bool,
) -> None:
    """Pages of 3 keys and lanes of 4: every key is resolved, present or absent, across page
    and lane boundaries, in no more requests than keys asked about (a HEAD each); a server
    that ignores StartAfter still gets the right answer, paging on from where it is."""
    monkeypatch.setattr(s3_requests, "PAGE_KEYS", 3)
    monkeypatch.setattr(s3_requests, "LANE_KEYS", 4)
    storage = _storage(s3_server, concurrency=3)
    keys = _keys(30)
    present = {k: 3 + i for i, k in enumerate(keys) if i % 3 != 1}
    for key, n in present.items():
        storage.write_once(key, b"y" * n)
    asked = [k for i, k in enumerate(keys) if i % 5 != 0] + ["objects/00/absent", "objects/ff/absent"]
    counted = Counted(storage, drop=("StartAfter",) if ignores_start else ())
    got = storage.sizes(asked)
    assert got == {k: n for k, n in present.items() if k in asked}
    lists = [kw for method, kw in counted.sent if method == "list_objects_v2"]
    assert set(counted.calls) == {"list_objects_v2"}
    if not ignores_start:
        assert len(lists) <= len(asked)
        assert all(kw["MaxKeys"] == 3 for kw in lists)
        assert len({kw["StartAfter"] for kw in lists if "StartAfter" in kw}) >= 3  # three lanes walked


def _commit(store: ss.Store, n: int) -> str:
    g = torch.Generator().manual_seed(n)
    return ss.save(store, {f"w{i}": torch.randn(64 + i, generator=g) for i in range(n)}, step=0, rng=False)


def test_copy_to_s3_costs_a_write_per_object_and_a_fixed_rest(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Any,
) -> None:
    """A commit of N objects copied to a fresh S3 store: N + 2 manifest writes, no HEAD (a
    listing finds the objects absent, a create-only write is its own check), and a fixed number
    of requests for the barriers' structural check, the fence and the ref, whatever N is."""
    local = ss.open_store(str(tmp_path / "src"))
    totals = {}
    for n in (6, 18):
        cid = _commit(local, n)
        objects = len(commit_closure(ss.load_commit(local, cid)).ids())
        dst = ss.open_store(s3_server.url(), **s3_server.options)
        counted = Counted(dst.storage)  # type: ignore[arg-type]
        copy_commit(local, dst, cid, ref="main")
        assert dst.ref("main") == cid
        calls = counted.calls
        assert calls["head_object"] == 0, calls
        assert calls["put_object"] == objects + 2, calls  # every object, the intent and the ref
        assert calls["list_objects_v2"] <= 3, calls  # the objects' presence, gc markers, the fence's check
        totals[n] = sum(calls.values()) - objects
    assert totals[6] == totals[18], totals  # the rest does not grow with the number of objects
    assert totals[6] <= 10, totals


def test_save_to_s3_checks_its_closure_with_listings(s3_server: S3Server) -> None:  # noqa: F811
    """A save's own requests: its objects (create-only, no look first), the manifests read back
    once each (by id, never as a ref name first), and the gc fence's presence check of the
    closure it just read back as listing pages, not a HEAD per object nor a third read of
    the manifests."""
    store = ss.open_store(s3_server.url(), **s3_server.options)
    counted = Counted(store.storage)  # type: ignore[arg-type]
    cid = _commit(store, 12)
    calls = dict(counted.calls)
    objects = len(commit_closure(ss.load_commit(store, cid)).ids())
    assert "head_object" not in calls, calls
    assert calls["put_object"] == objects + 3, calls  # every object, the intent, the ref, the journal
    assert calls["get_object"] == 3, calls  # the ref before the save, the shard manifest and the commit read back
    assert calls["list_objects_v2"] == 3, calls  # the tensors' presence, gc markers, the closure's presence
    assert sum(calls.values()) == objects + 10, calls


def test_a_second_save_to_s3_sends_only_what_changed(s3_server: S3Server) -> None:  # noqa: F811
    """A save whose tensors are mostly already stored: one listing finds them, each is refreshed
    (a copy onto itself, for gc's grace period) without its bytes being sent again; only the
    changed tensor and the new manifests are written."""
    store = ss.open_store(s3_server.url(), **s3_server.options)
    g = torch.Generator().manual_seed(7)
    state = {f"w{i}": torch.randn(256, generator=g) for i in range(10)}
    first = ss.save(store, state, step=0, rng=False)
    state["w3"] = state["w3"] + 1
    counted = Counted(store.storage)  # type: ignore[arg-type]
    second = ss.save(store, state, step=1, rng=False)
    assert second != first and store.ref("main") == second
    calls = counted.calls
    bodies = [kw["Key"] for method, kw in counted.sent if method == "put_object" and "/objects/" in kw["Key"]]
    assert len(bodies) == 3, bodies  # w3's new bytes, the shard manifest, the commit manifest
    assert calls["copy_object"] == 9, calls  # the unchanged tensors, refreshed where they are
    assert "head_object" not in calls, calls


def test_the_probe_runs_once_per_filesystem_and_bucket(s3_server: S3Server) -> None:  # noqa: F811
    """The server's request conditions are probed by the first store written through an s3fs
    filesystem in a bucket; the next store there (another prefix, the same server and
    credentials) trusts that answer, and creating it costs one look and one write."""
    mine = {**s3_server.options, "default_block_size": (5 << 20) + uuid.uuid4().int % 4096}  # a filesystem of its own
    first = S3Storage(s3_server.url(), **mine)
    probing = Counted(first)
    ss.Store(first)
    assert probing.calls["put_object"] == 4 and probing.calls["delete_object"] == 2, probing.calls  # probe + config
    assert first.conditional is True
    second = S3Storage(s3_server.url(), **mine)
    assert second.fs is first.fs  # fsspec's instance cache: the same options, the same filesystem
    counted = Counted(second)
    ss.Store(second)
    assert dict(counted.calls) == {"get_object": 1, "put_object": 1}, counted.calls  # the config: absent, created
    assert second.conditional is True
    other = S3Storage(s3_server.url(), skip_instance_cache=True, **mine)  # another filesystem: probes
    counted = Counted(other)
    ss.Store(other)
    assert counted.calls["put_object"] == 4, counted.calls


def test_a_refused_probe_is_not_shared_with_the_next_store(s3_server: S3Server) -> None:  # noqa: F811
    """Only a probe that found the conditions honoured stands for the bucket: a refusal may be
    the credential's for that one prefix (a prefix-scoped policy) or a transient answer, not the
    server's, so the next store through the same filesystem probes for itself and moves refs."""
    mine = {**s3_server.options, "default_block_size": (5 << 20) + uuid.uuid4().int % 4096}  # a filesystem of its own
    first = S3Storage(s3_server.url(), **mine)
    real = first.transport.call

    async def denied(method: str, key: str, **kw: Any) -> Any:
        if key.startswith("tmp/probe-"):
            raise S3Error(403, "AccessDenied", "not under this prefix", False)
        return await real(method, key, **kw)

    first.transport.call = denied  # type: ignore[method-assign]
    with pytest.raises(ss.StorageError, match="AccessDenied"):
        _commit(ss.Store(first), 2)  # its objects stored, its ref refused
    second = S3Storage(s3_server.url(), **mine)
    assert second.fs is first.fs  # the same filesystem and bucket, another prefix
    store = ss.Store(second)
    cid = _commit(store, 2)
    assert store.ref("main") == cid and second.conditional is True


def test_copy_from_s3_costs_a_read_per_object(s3_server: S3Server, tmp_path: Any) -> None:  # noqa: F811
    """A commit of N objects copied out of S3 by its id: N reads and one look for a ref of that
    name, nothing else (no HEAD: the id is read as a commit while the ref is looked up)."""
    src = ss.open_store(s3_server.url(), **s3_server.options)
    cid = _commit(src, 9)
    objects = len(commit_closure(ss.load_commit(src, cid)).ids())
    counted = Counted(src.storage)  # type: ignore[arg-type]
    copy_commit(src, ss.open_store(str(tmp_path / "dst")), cid)
    assert dict(counted.calls) == {"get_object": objects + 1}, counted.calls


def test_a_ref_named_like_a_commit_id_still_wins(tmp_path: Any) -> None:
    """load_commit reads a full id as a commit while it looks for a ref of that name; a ref of
    that name still wins (SPEC.md §14), and an id that is not there is still TargetNotFound."""
    store = ss.open_store(str(tmp_path / "s"))
    a, b = _commit(store, 2), _commit(store, 3)
    store.set_ref(a, b, expected=None)
    assert ss.load_commit(store, a).id == b
    assert ss.load_commit(store, b).id == b
    with pytest.raises(ss.TargetNotFound):
        ss.load_commit(store, "f" * 64)


def test_object_reads_skip_the_servers_checksum_and_the_rest_ask_for_it(s3_server: S3Server) -> None:  # noqa: F811
    """An object is hashed against its id by its reader, every byte, so its GETs do not ask
    botocore to check the server's CRC as well (response_checksum_validation is when_required);
    a ref, which has no id to be checked against, asks for it (ChecksumMode=ENABLED)."""
    store = ss.open_store(s3_server.url(), **s3_server.options)
    cid = _commit(store, 2)
    counted = Counted(store.storage)  # type: ignore[arg-type]
    ss.load_commit(store, "main")
    gets = [kw for method, kw in counted.sent if method == "get_object"]
    refs = [kw for kw in gets if "/refs/" in kw["Key"]]
    objects = [kw for kw in gets if "/objects/" in kw["Key"]]
    assert refs and objects and cid in objects[0]["Key"]
    assert all(kw.get("ChecksumMode") == "ENABLED" for kw in refs)
    assert not any("ChecksumMode" in kw for kw in objects)
    client = store.storage.transport.run(store.storage.fs.set_session)  # type: ignore[attr-defined]
    assert client.meta.config.response_checksum_validation == "when_required"


def test_restore_from_s3_checks_sizes_with_listings(s3_server: S3Server) -> None:  # noqa: F811
    """Restore checks every object it will read is there with its size before the first byte
    lands (SPEC.md §16): on S3 from listing pages, not a HEAD per object; then a read each."""
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    store = ss.open_store(s3_server.url(), **s3_server.options)
    cid = ss.save(store, model, opt, step=1, rng=False)
    objects = len(commit_closure(ss.load_commit(store, cid)).ids())
    counted = Counted(store.storage)  # type: ignore[arg-type]
    again = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    ss.restore(store, "main", again, torch.optim.AdamW(again.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert "head_object" not in counted.calls, counted.calls
    assert counted.calls["list_objects_v2"] == 1, counted.calls
    assert counted.calls["get_object"] <= objects + 1, counted.calls  # each object once, and the ref


def test_a_second_copy_to_s3_refreshes_what_is_there_without_a_head(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Any,
) -> None:
    """Copying a commit whose objects are mostly at the destination already: the listing finds
    them with their sizes, each is refreshed (CopyObject) with no HEAD and no bytes sent."""
    local = ss.open_store(str(tmp_path / "src"))
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(128, generator=g) for i in range(8)}
    first = ss.save(local, state, step=0, rng=False)
    state["w0"] = state["w0"] * 2
    second = ss.save(local, state, step=1, rng=False)
    dst = ss.open_store(s3_server.url(), **s3_server.options)
    copy_commit(local, dst, first, ref="main")
    counted = Counted(dst.storage)  # type: ignore[arg-type]
    done = copy_commit(local, dst, second, ref="main")
    assert dst.ref("main") == second and done.objects_skipped == 7 and done.objects_copied == 3
    assert counted.calls["copy_object"] == 7, counted.calls
    assert "head_object" not in counted.calls, counted.calls


def _truncate(server: S3Server, store: ss.Store, oid: str) -> None:
    """Overwrite object ``oid`` with its bytes less the last 4 (a torn object, written around the store)."""
    key = store.storage.transport.key(object_key(oid))  # type: ignore[attr-defined]
    client = make_client(server)
    data = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=key, Body=data[:-4])


def test_a_listed_object_of_the_wrong_size_is_replaced_by_copy(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Any,
) -> None:
    """A copy's listing finds an object at the destination with its size: one of the wrong size
    (torn) is not refreshed and trusted but replaced by the verified source bytes (SPEC.md §19.1)."""
    local = ss.open_store(str(tmp_path / "src"))
    cid = _commit(local, 4)
    dst = ss.open_store(s3_server.url(), **s3_server.options)
    copy_commit(local, dst, cid, ref="main")
    victim = sorted(commit_closure(ss.load_commit(local, cid)).data)[0]
    _truncate(s3_server, dst, victim)
    assert not ss.verify(dst, [cid]).ok
    done = copy_commit(local, dst, cid, ref="main")
    assert done.objects_copied == 1, done
    assert dst.object_size(victim) == local.object_size(victim)
    assert ss.verify(dst, [cid]).ok


def test_restore_from_s3_refuses_a_listed_object_of_the_wrong_size(s3_server: S3Server) -> None:  # noqa: F811
    """Restore's sizes come from a listing on S3: a torn object is still refused before any byte
    lands in the destination (SPEC.md §16), and the destination keeps its values."""
    store = ss.open_store(s3_server.url(), **s3_server.options)
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(64, generator=g) for i in range(3)}
    cid = ss.save(store, state, step=0, rng=False)
    lc = ss.load_commit(store, cid)
    victim = next(e.param for e in lc.shards[0].entries if e.name == "w2")
    _truncate(s3_server, store, victim)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(ss.TensorMismatch):
        ss.restore(store, "main", into)
    assert all(torch.count_nonzero(t) == 0 for t in into.values())


def test_a_second_copy_of_the_same_commit_to_s3_reports_everything_skipped(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Any,
) -> None:
    """The manifests a copy writes without looking first (a lone manifest, a create-only write)
    were already there: they are counted as skipped, not as copied (the write found them)."""
    local = ss.open_store(str(tmp_path / "src"))
    cid = _commit(local, 3)
    dst = ss.open_store(s3_server.url(), **s3_server.options)
    first = copy_commit(local, dst, cid, ref="main")
    again = copy_commit(local, dst, cid, ref="main")
    assert again.objects_copied == 0 and again.bytes_copied == 0, again
    assert again.objects_skipped == first.objects_copied, (first, again)


def test_a_save_to_s3_replaces_a_listed_tensor_object_of_the_wrong_size(s3_server: S3Server) -> None:  # noqa: F811
    """A save's listing finds its unchanged tensors with their sizes: one of the wrong size (torn)
    is not refreshed and named by the new commit but replaced by the bytes just hashed."""
    store = ss.open_store(s3_server.url(), **s3_server.options)
    g = torch.Generator().manual_seed(9)
    state = {f"w{i}": torch.randn(64, generator=g) for i in range(3)}
    ss.save(store, state, step=0, rng=False)
    victim = next(e.param for e in ss.load_commit(store, "main").shards[0].entries if e.name == "w1")
    _truncate(s3_server, store, victim)
    second = ss.save(store, state, step=1, rng=False)
    assert store.object_size(victim) == 64 * 4
    assert ss.verify(store, [second]).ok


def _bench_requests() -> Any:
    """``benchmarks/_s3_requests`` (the request model the budget benchmarks extrapolate with)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "_s3_requests.py"
    spec = importlib.util.spec_from_file_location("_s3_requests_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmarks_listing_model_counts_the_pages_the_backend_sends(
    s3_server: S3Server,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``listing_requests`` (what bench_scale_sim charges for a presence check of many objects at
    16,384 ranks) is the number of listing pages ``listed_sizes`` really sends, for dense, sparse
    and absent keys across pages and lanes (small pages and lanes, so that each case crosses them)."""
    model = _bench_requests()
    monkeypatch.setattr(s3_requests, "PAGE_KEYS", 4)
    monkeypatch.setattr(s3_requests, "LANE_KEYS", 5)
    storage = _storage(s3_server, concurrency=3)
    keys = _keys(60)
    present = [k for i, k in enumerate(keys) if i % 4 != 3]
    for key in present:
        storage.write_once(key, b"z")
    cases = {
        "dense": present[:40],
        "sparse": present[::7],
        "absent": [k for i, k in enumerate(keys) if i % 4 == 3] + ["objects/ff/absent"],
        "one": present[5:6],
        "mixed": keys[3:50:2],
    }
    for name, asked in cases.items():
        counted = Counted(storage)
        assert storage.sizes(asked) == {k: 1 for k in asked if k in present}, name
        want = model.listing_requests(sorted(present), asked, page=4, lane=5, lanes=3)
        assert counted.calls == {"list_objects_v2": want}, (name, want)
