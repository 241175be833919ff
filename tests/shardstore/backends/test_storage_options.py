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


@pytest.fixture
def no_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """No credentials, profile or endpoint from this machine, and no instance-role lookup."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv(ENV, "{}")  # restored at teardown: main() sets it for this process


@pytest.mark.parametrize(
    "option, named",
    [
        ("part_size=abc", "part_size: Expected `int`, got `str`"),
        ("concurrency=abc", "concurrency: Expected `int`, got `str`"),
        ("config_kwargs=5", "config_kwargs: Expected `object | null`, got `int`"),
        ("client_kwargs=5", "client_kwargs: Expected `object | null`, got `int`"),
        ("endpoint_url=notaurl", "endpoint_url 'notaurl' is not a URL"),
        ("key=AKIAEXAMPLE", "key is given without secret"),
        ("secret=s3cr3t", "secret is given without key"),
        ("profile=no-such-profile", "ProfileNotFound: The config profile (no-such-profile) could not be found"),
        ("config_kwargs.no_such_setting=1", "TypeError: Got unexpected keyword argument 'no_such_setting'"),
    ],
)
def test_bad_storage_options_are_one_typed_line_and_exit_2(
    option: str, named: str, no_aws: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression (issue 30, defect 9): each was a Python traceback from the first request."""
    code = main(["refs", "s3://bucket/run", "--storage-option", option])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("shardstore: error: StorageOptionError: ") and err.count("\n") == 1, err
    assert named in err, err


@pytest.mark.parametrize(
    "value, named",
    [
        ('{"part_size": "abc"}', "part_size: Expected `int`, got `str`"),
        ('{"client_kwargs": 5}', "client_kwargs: Expected `object | null`, got `int`"),
        ('{"key": 5, "secret": "s"}', "key: Expected `str | null`, got `int`"),
        ('{"conditional": "no"}', "conditional: Expected `bool | null`, got `str`"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_a_wrong_type_in_the_environment_is_one_typed_line_and_exit_2(
    value: str, named: str, no_aws: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV, value)
    code = main(["refs", "s3://bucket/run"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("shardstore: error: StorageOptionError: ") and err.count("\n") == 1, err
    assert named in err, err


def test_shardtrain_refuses_a_bad_storage_option_alike(
    tmp_path: Any, no_aws: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardstore_cli.shardtrain_cli import main as shardtrain

    argv = ["prepare", "--out", str(tmp_path / "job"), "--seed-store", "s3://bucket/seeds", "--seed-commit", "0" * 64]
    code = shardtrain([*argv, "--storage-option", "part_size=abc"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("shardtrain: error: StorageOptionError: ") and err.count("\n") == 1, err
    assert "part_size: Expected `int`, got `str`" in err
    assert shardtrain([*argv, "--storage-option", "nonsense"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "job").exists()
