"""Read-only operations never write (issue 23, item 3).

``verify``, ``log``, ``show``, ``diff``, ``cat``, ``refs``, ``export``, ``gc --dry-run`` and
``restore`` run through the command line (in this process) and the library against a store
whose backend fails every write, and on S3 with every write answered AccessDenied, as for a
credential whose policy allows reads only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardstore as ss
import shardstore.store
from shardstore.backends.base import Buffer
from shardstore.backends.options import ENV
from shardstore.backends.s3.transport import S3Error, S3Transport
from shardstore.errors import StorageError
from shardstore_cli.shardstore_cli import main

try:
    from tests.s3_server import S3Server, s3_server  # noqa: F401  (fixture)
except ImportError:  # pragma: no cover
    from s3_server import S3Server, s3_server  # type: ignore[no-redef]  # noqa: F401


class ReadOnly:
    """A backend that reads through to ``inner`` and fails (and records) every write."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.url, self.writes = inner, inner.url, []

    def _refuse(self, op: str, key: str, *_: Any, **__: Any) -> Any:
        self.writes.append((op, key))
        raise StorageError(f"read-only: {op} {key}")

    def write_once(self, key: str, data: Buffer) -> bool:
        return self._refuse("write_once", key)

    def swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        self._refuse("swap", key)

    def delete(self, key: str) -> None:
        self._refuse("delete", key)

    def delete_if(self, key: str, expected: bytes) -> None:
        self._refuse("delete_if", key)

    def touch(self, key: str) -> int | None:
        return self._refuse("touch", key)

    def begin_write(self, key: str, data: Buffer) -> Any:
        return self._refuse("begin_write", key)

    def sync(self) -> None:
        return None  # a barrier writes nothing

    def read(self, key: str, limit: int | None = None) -> Buffer:
        return self.inner.read(key, limit=limit)

    def __getattr__(self, name: str) -> Any:  # size, exists, list, mtime and the read fast paths
        if name in ("read_hashed", "hash_object", "read_into", "size", "exists", "list", "mtime"):
            return getattr(self.inner, name)
        raise AttributeError(name)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def two_commits(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    store = ss.open_store(str(tmp_path / "store"))
    model, opt = _model()
    a = ss.save(store, model, opt, step=1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    b = ss.save(store, model, opt, step=2)
    store.add_to_pin("jobs/x", [store.commit(b).layout[0].shard])
    yield str(tmp_path / "store"), a, b


def test_read_only_commands_never_write(
    two_commits: tuple[str, str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, a, b = two_commits
    backends: list[ReadOnly] = []
    real = shardstore.store.store.open_storage

    def read_only(u: str, **kw: Any) -> ReadOnly:
        backends.append(ReadOnly(real(u, **kw)))
        return backends[-1]

    monkeypatch.setattr(shardstore.store.store, "open_storage", read_only)
    cat_id = ss.Store(real(url)).commit(b).layout[0].shard
    for argv in (
        ["verify", url],
        ["verify", url, "--quick"],
        ["verify", url, "--shard", "0", b],
        ["log", url],
        ["show", url, "main"],
        ["diff", url, a, b, "--stats"],
        ["cat", url, cat_id],
        ["refs", url],
        ["export", url, "main", str(tmp_path / "out"), "--with-optimizer", "--weights-only"],
        ["gc", url, "--dry-run", "--grace", "0"],
    ):
        code = main(argv)
        out = capsys.readouterr()
        assert code == 0, (argv, out.err)
    assert len(backends) >= 10 and all(not be.writes for be in backends), [be.writes for be in backends]
    # the library's restore through the same backend
    store = ss.open_store(url, create=False)
    model, opt = _model()
    ss.restore(store, a, model, opt)
    assert not backends[-1].writes
    with pytest.raises(StorageError, match="read-only"):  # the wrapper does refuse writes: a real check
        store.set_ref("other", a, expected=None)
    assert backends[-1].writes


def test_verify_on_s3_with_a_read_only_credential(
    s3_server: S3Server,
    capsys: pytest.CaptureFixture[str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every write answered AccessDenied (a read-only policy), from the moment a store is
    opened: verify, log, show, refs and restore all succeed and send no write (no
    conditional-write probe, no refresh); `shardstore verify` exits 0. Before the probe
    moved to the first write, opening the store sent PutObject and DeleteObject under tmp/."""
    url = s3_server.url()
    writer = ss.open_store(url, **s3_server.options)
    model, opt = _model()
    cid = ss.save(writer, model, opt, step=1)
    writes = {
        "put_object",
        "delete_object",
        "copy_object",
        "create_multipart_upload",
        "upload_part",
        "complete_multipart_upload",
        "delete_objects",
    }
    sent: list[str] = []
    real_call = S3Transport.call

    async def read_only_call(self: S3Transport, method: str, key: str, **kw: Any) -> Any:
        sent.append(method)
        if method in writes:
            raise S3Error(403, "AccessDenied", "this credential may only read", False)
        return await real_call(self, method, key, **kw)

    monkeypatch.setattr(S3Transport, "call", read_only_call)
    monkeypatch.setenv(ENV, json.dumps(s3_server.options))  # how every store below is reached
    assert main(["verify", url]) == 0
    capsys.readouterr()
    assert main(["verify", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and cid in report["commits"] and report["objects_checked"] > 0
    for argv in (["log", url], ["show", url, "main"], ["refs", url], ["verify", url, "--quick"]):
        assert main(argv) == 0, capsys.readouterr().err
    fresh, fresh_opt = _model()
    ss.restore(ss.open_store(url, create=False), "main", fresh, fresh_opt)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    assert sent and not set(sent) & writes, sorted(set(sent) & writes)
    # a write through the same credential is refused, so the check above is a real one
    with pytest.raises(StorageError, match="AccessDenied"):
        ss.open_store(url, create=False).set_ref("other", cid, expected=None)
