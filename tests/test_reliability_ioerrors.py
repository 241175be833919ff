"""I/O errors at the k-th operation (issue 8, part 3).

Local backend: ``FaultyOs`` makes the k-th system call of two two-slot saves fail with
ENOSPC (sticky: the disk stays full), EIO or EACCES (once). On S3 (moto): the k-th request
of a save is answered 500, 503 (once, or for longer than the retry budget), a timeout
before the request reached the server, a timeout after it did (the answer lost), or 412.
Each save must either succeed (bounded retries, or a fault that does not matter) or raise
a ``ShardstoreError`` subclass — never a bare ``OSError`` or botocore error; the ref must
be exactly where the last successful save put it; and once the fault is gone the store
verifies clean and finishing the saves reproduces the uninterrupted run's commit ids.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any

import pytest
import torch
from botocore.exceptions import ClientError, ReadTimeoutError
from conftest import TinyNet, make_optimizer, train_steps
from faults import FaultyOs, OpLog, S3FaultClient, fast_dir, frozen_slots, patch_local_os
from sweeps import DENSITIES, stride

import shardstore as ss
import shardstore.backends.local as storage_mod
from shardstore.backends.s3.storage import S3Storage
from shardstore.ops.gc import gc

try:
    from tests.s3_server import S3Server, s3_server  # noqa: F401  (fixture)
except ImportError:  # pragma: no cover
    from s3_server import S3Server, s3_server  # type: ignore[no-redef]  # noqa: F401

SLOW = bool(os.environ.get("SHARDSTORE_SLOW"))
ERRNOS = (errno.ENOSPC, errno.EIO, errno.EACCES)


@pytest.fixture(scope="module")
def plan(tmp_path_factory: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyNet(width=4)
    opt = make_optimizer(model)
    states, infos = [], []
    for step in range(1, 4):
        train_steps(model, opt, 1, seed=step)
        states.append(frozen_slots(model, opt, 3, rng={"torch": bytes(range(step, step + 16))}))
        infos.append(ss.CommitInfo(step=step, config={"width": 4}, data_cursor=step))
    scratch = fast_dir(str(tmp_path_factory.mktemp("io")))
    base = os.path.join(scratch, "base")
    store = ss.open_store(base)
    ids = [ss.save_slots(store, states[0], info=infos[0], threads=1)]
    ref_root = os.path.join(scratch, "reference")
    shutil.copytree(base, ref_root)
    ref_store = ss.open_store(ref_root)
    ids += [ss.save_slots(ref_store, states[i], info=infos[i], threads=1) for i in (1, 2)]
    yield {"states": states, "infos": infos, "ids": ids, "base": base, "scratch": scratch}
    shutil.rmtree(scratch, ignore_errors=True)


def _finish_and_check(store: ss.Store, plan: dict[str, Any], done: int) -> None:
    """With the fault gone: ref on the last good commit, verify clean, the rest reproduces the ids."""
    ids = plan["ids"]
    assert store.ref("main") == ids[done], "the ref moved on a failed save (or did not move on a good one)"
    report = ss.verify(store)
    assert report.ok, [str(p) for p in report.problems]
    for j in range(done + 1, 3):
        assert ss.save_slots(store, plan["states"][j], info=plan["infos"][j], threads=1) == ids[j]
    assert ss.verify(store).ok


def _local_case(plan: dict[str, Any], k: int, err: int, monkeypatch: Any) -> str:
    root = os.path.join(plan["scratch"], f"case-{k}-{err}")
    shutil.copytree(plan["base"], root)
    done = 0
    outcome = "ok"
    patch_local_os(monkeypatch, FaultyOs(at=k, err=err, sticky=err == errno.ENOSPC, fsync=False))
    try:
        store = ss.open_store(root, create=False)
        for j in (1, 2):
            ss.save_slots(store, plan["states"][j], info=plan["infos"][j], threads=1)
            done = j
    except ss.ShardstoreError as e:
        outcome = type(e).__name__
        assert root in str(e) or "store" in str(e), e  # the error names where
        if "the ref now holds the new value" in str(e):  # the rename landed, its directory fsync failed
            done += 1
            outcome = "moved-not-durable"
    finally:
        patch_local_os(monkeypatch, FaultyOs(fsync=False))
    _finish_and_check(ss.open_store(root, create=False), plan, done)
    shutil.rmtree(root)
    return outcome


@pytest.mark.parametrize("density", DENSITIES)
def test_local_io_error_at_every_system_call(plan: dict[str, Any], monkeypatch: Any, density: str) -> None:
    root = os.path.join(plan["scratch"], "count")
    shutil.copytree(plan["base"], root)
    counter = FaultyOs(fsync=False)
    patch_local_os(monkeypatch, counter)
    store = ss.open_store(root, create=False)
    for j in (1, 2):
        ss.save_slots(store, plan["states"][j], info=plan["infos"][j], threads=1)
    calls = list(counter.calls)
    cases = [(k, e) for k in range(len(calls)) for e in ERRNOS]
    if not SLOW:  # every third call (CI's long step) or ninth (the test command), each errno in turn
        step = stride(density, dense=3)
        cases = [(k, ERRNOS[(k // step) % 3]) for k in range(0, len(calls), step)]
    outcomes: dict[str, int] = {}
    for k, err in cases:
        o = _local_case(plan, k, err, monkeypatch)
        outcomes[o] = outcomes.get(o, 0) + 1
    assert outcomes.get("StorageError", 0) > len(cases) // 3
    print(f"local I/O errors: {len(cases)} cases over {len(calls)} system calls: {outcomes}")


def test_failed_directory_scan_is_an_error_not_an_empty_listing(
    plan: dict[str, Any], monkeypatch: Any, tmp_path: Any
) -> None:
    """An unreadable directory under refs/ must not make its refs invisible: gc would then
    treat their commits as garbage."""
    root = str(tmp_path / "s")
    store = ss.open_store(root)
    cid = ss.save_slots(store, plan["states"][0], info=plan["infos"][0], ref="runs/exp", threads=1)
    scans = FaultyOs(only=("scandir",))
    patch_local_os(monkeypatch, scans)
    gc(store, grace_seconds=0, dry_run=True)
    at = [w.endswith(os.path.join("refs", "runs")) for w in scans.walked].index(True)
    patch_local_os(monkeypatch, FaultyOs(at=at, err=errno.EACCES, only=("scandir",)))
    with pytest.raises(ss.StorageError, match="refs"):
        gc(store, grace_seconds=0, dry_run=False)
    patch_local_os(monkeypatch, os)
    assert ss.verify(store).ok and store.ref("runs/exp") == cid


def test_journal_failure_after_the_ref_moved_does_not_fail_the_save(plan: dict[str, Any], tmp_path: Any) -> None:
    """The journal is advisory and written after the ref moved: its failure must not report
    a committed save as failed (the caller would redo or abandon a commit that is in)."""
    root = str(tmp_path / "s")

    def hook(n: int, op: str, key: str) -> None:
        if op == "write_once" and key.startswith("journal/"):
            raise ss.StorageError(f"write {key!r}: No space left on device (injected)")

    store = ss.Store(OpLog(storage_mod.LocalStorage(root), hook))
    cid = ss.save_slots(store, plan["states"][0], info=plan["infos"][0], threads=1)
    assert store.ref("main") == cid == plan["ids"][0]


# -- S3 ---------------------------------------------------------------------------------


def _err(status: int, code: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": f"injected {code}"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op"
    )


FAULTS = {
    "500": lambda: (_err(500, "InternalError"), 1),
    "503": lambda: (_err(503, "SlowDown"), 1),
    "503-outage": lambda: (_err(503, "ServiceUnavailable"), 50),
    "timeout": lambda: (ReadTimeoutError(endpoint_url="http://127.0.0.1"), 1),
    "timeout-after": lambda: (("after", ReadTimeoutError(endpoint_url="http://127.0.0.1")), 1),
    "412": lambda: (_err(412, "PreconditionFailed"), 1),
}


def _s3_storage(server: S3Server, url: str) -> S3Storage:
    return S3Storage(url, conditional=True, attempts=3, backoff=0.0005, skip_instance_cache=True, **server.options)


def _s3_case(server: S3Server, plan: dict[str, Any], k: int | None, fault: str) -> tuple[str, int]:
    """The first save into a fresh S3 store, with request ``k`` failing as ``fault``."""
    url = server.url()
    ss.Store(_s3_storage(server, url))  # the store config, written without faults
    storage = _s3_storage(server, url)
    real = storage.transport.run(storage.fs.set_session)
    exc, repeat = FAULTS[fault]()
    proxy = S3FaultClient(real, at=k, fault=exc, repeat=repeat)

    async def set_session(*_a: Any, **_k: Any) -> Any:
        return proxy

    storage.fs.set_session = set_session  # type: ignore[method-assign]
    outcome = "ok"
    try:
        store = ss.Store(storage, create=False)
        ss.save_slots(store, plan["states"][0], info=plan["infos"][0], threads=1)
    except ss.ShardstoreError as e:
        outcome = type(e).__name__
    clean = ss.Store(_s3_storage(server, url), create=False)
    assert clean.ref("main") == (plan["ids"][0] if outcome == "ok" else None), (k, fault, outcome)
    report = ss.verify(clean)
    assert report.ok, (k, fault, [str(p) for p in report.problems])
    if outcome != "ok":
        assert ss.save_slots(clean, plan["states"][0], info=plan["infos"][0], threads=1) == plan["ids"][0]
        assert ss.verify(clean).ok
    return outcome, len(proxy.calls)


@pytest.mark.parametrize("density", DENSITIES)
def test_s3_error_at_every_request(s3_server: S3Server, plan: dict[str, Any], density: str) -> None:  # noqa: F811
    _, n = _s3_case(s3_server, plan, None, "500")
    kinds = list(FAULTS)
    cases = [(k, f) for k in range(n) for f in kinds]
    if not SLOW:  # every ninth request (CI's long step; the gc fence added requests to every ref move) or
        # 27th (the test command), the fault kinds in turn
        step = stride(density, dense=9)
        cases = [(k, kinds[(k // step) % len(kinds)]) for k in range(0, n, step)]
    outcomes: dict[str, int] = {}
    for k, f in cases:
        o, _ = _s3_case(s3_server, plan, k, f)
        outcomes[f"{f}:{o}"] = outcomes.get(f"{f}:{o}", 0) + 1
    print(f"S3 faults: {len(cases)} cases over {n} requests: {dict(sorted(outcomes.items()))}")


def test_s3_412_for_an_absent_object_is_not_taken_as_already_there(s3_server: S3Server, plan: dict[str, Any]) -> None:  # noqa: F811
    """Regression: a create-only PUT answered 412 used to count as "already stored" without
    looking; the save then moved the ref to a commit whose object the server never held."""
    url = s3_server.url()
    ss.Store(_s3_storage(s3_server, url))
    storage = _s3_storage(s3_server, url)
    real = storage.transport.run(storage.fs.set_session)
    proxy = S3FaultClient(real, at=0, fault=_err(412, "PreconditionFailed"), ops=("put_object",))

    async def set_session(*_a: Any, **_k: Any) -> Any:
        return proxy

    storage.fs.set_session = set_session  # type: ignore[method-assign]
    with pytest.raises(ss.StorageError, match="holds no such object"):
        ss.save_slots(ss.Store(storage, create=False), plan["states"][0], info=plan["infos"][0], threads=1)
    clean = ss.Store(_s3_storage(s3_server, url), create=False)
    assert clean.ref("main") is None and ss.verify(clean).ok
