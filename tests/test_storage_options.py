"""S3 storage options reach the backend from one place (shardstore.backends.options): the
environment (SHARDSTORE_STORAGE_OPTIONS), the store URL's query, ``open_store(url, **options)``
and ``--storage-option KEY=VALUE`` on both command lines (issue 23, item 4)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import shardstore as ss
from shardstore.backends.options import ENV, parse_option, resolve
from shardstore.backends.s3.storage import S3Storage
from shardstore.errors import StorageError
from shardstore_cli.shardstore_cli import main

try:
    from tests.s3_server import BUCKET, S3Server, s3_server  # noqa: F401  (fixture)
except ImportError:  # pragma: no cover
    from s3_server import BUCKET, S3Server, s3_server  # type: ignore[no-redef]  # noqa: F401


def test_parsing_and_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_option("client_kwargs.region_name=eu-west-1") == (("client_kwargs", "region_name"), "eu-west-1")
    assert parse_option("concurrency=8") == (("concurrency",), 8)
    assert parse_option("secret=12345") == (("secret",), "12345")  # a numeric-looking secret stays a string
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_option("endpoint_url")
    monkeypatch.setenv(ENV, json.dumps({"endpoint_url": "http://env:1", "client_kwargs": {"verify": False}}))
    url, options = resolve("s3://b/p?endpoint_url=http://query:2&region_name=us-east-2", {"key": "k"})
    assert url == "s3://b/p"
    assert options == {
        "endpoint_url": "http://query:2",
        "client_kwargs": {"verify": False, "region_name": "us-east-2"},
        "key": "k",
    }
    assert (
        resolve("s3://b/p?endpoint_url=http://query:2", {"endpoint_url": "http://kw:3"})[1]["endpoint_url"]
        == "http://kw:3"
    )
    with pytest.raises(StorageError, match=r"'secret' cannot be given in the URL.*--storage-option secret=VALUE"):
        ss.open_store("s3://b/p?secret=x")
    with pytest.raises(StorageError, match="unknown storage option.*endpoint"):
        ss.open_store("s3://b/p", endpoint="http://127.0.0.1:1")  # misspelt: s3fs would keep it silently
    monkeypatch.setenv(ENV, "[1]")
    with pytest.raises(StorageError, match="JSON object"):
        ss.open_store("s3://b/p")


def test_options_reach_the_backend(
    s3_server: S3Server,
    monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    opts: dict[str, Any] = s3_server.options
    creds = {"key": opts["key"], "secret": opts["secret"], "client_kwargs": opts["client_kwargs"]}
    url = s3_server.url()
    store = ss.open_store(f"{url}?endpoint_url={s3_server.endpoint}", **creds)  # the URL's query
    assert isinstance(store.storage, S3Storage) and store.url == url
    cid = store.put(b"hello")
    monkeypatch.setenv(ENV, json.dumps({"endpoint_url": s3_server.endpoint, **creds}))  # the environment alone
    assert bytes(ss.open_store(url, create=False).get(cid)) == b"hello"
    monkeypatch.setenv(ENV, "{}")  # restored at teardown: main() below sets it for this process
    argv = [
        "refs",
        url,
        "--storage-option",
        f"endpoint_url={s3_server.endpoint}",
        "--storage-option",
        f"key={creds['key']}",
        "--storage-option",
        f"secret={creds['secret']}",
        "--storage-option",
        "client_kwargs.region_name=us-east-1",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    assert main(["refs", url, "--storage-option", "nonsense"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
