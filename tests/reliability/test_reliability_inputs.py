"""Hostile inputs that crashed the command line or exhausted memory (issue 12, items 10-13).

Run through ``shardstore_cli.shardstore_cli.main`` in process (the exit code and the one-line
error are what a user sees):

- item 10: ``import`` of a ``config.json`` nested 100,000 deep, holding a lone surrogate, a
  symbolic link to ``/dev/zero``, or a FIFO: exit 1 with a typed error, nothing written;
- item 11: ``export`` with a symbolic link planted at a temporary's old name (and at the
  output name itself, with ``--force``): no file outside OUT_DIR is touched;
- item 12: store URLs with an unknown protocol, a protocol whose package is missing, an
  invalid bucket name: one line, exit 1, no traceback;
- item 13: ``cat`` of a tensor object over the manifest limit is refused without reading it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import shardstore as ss
from shardstore.backends.local import LocalStorage
from shardstore_cli import shardstore_cli


def _main(capsys: Any, *argv: str) -> tuple[int, str]:
    code = shardstore_cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.err


def _hf_dir(path: Any, config: bytes | None) -> Any:
    path.mkdir()
    if config is not None:
        (path / "config.json").write_bytes(config)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(path / "model.safetensors"))
    return path


# -- item 10 --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b'{"name": "\\ud800"}', b'{"k\\udfff": 1}'],
    ids=["deep", "lone-surrogate-value", "lone-surrogate-key"],
)
def test_import_refuses_a_hostile_config_json(tmp_path: Any, capsys: Any, config: bytes) -> None:
    src = _hf_dir(tmp_path / "src", config)
    store = str(tmp_path / "store")
    code, err = _main(capsys, "import", store, str(src))
    assert code == 1, err
    assert "ManifestError" in err and "Traceback" not in err and err.count("\n") == 1
    assert list(ss.open_store(store).objects()) == []  # refused before anything was written


def test_import_refuses_a_config_json_that_is_a_device_or_a_fifo(tmp_path: Any, capsys: Any) -> None:
    src = _hf_dir(tmp_path / "src", None)
    os.symlink("/dev/zero", src / "config.json")
    code, err = _main(capsys, "import", str(tmp_path / "store"), str(src))
    assert code == 1 and "not a regular file" in err, err
    os.unlink(src / "config.json")
    os.mkfifo(src / "config.json")
    done: list[int] = []
    t = threading.Thread(
        target=lambda: done.append(_main(capsys, "import", str(tmp_path / "store"), str(src))[0]), daemon=True
    )
    t.start()
    t.join(20)
    if not done:  # unblock the reader so that the thread ends, then fail
        with open(src / "config.json", "wb") as f:
            f.write(b"{}")
        t.join(5)
        pytest.fail("import waited on a FIFO")
    assert done == [1]


def test_import_refuses_a_weight_file_that_is_a_fifo_or_a_device(tmp_path: Any, capsys: Any) -> None:
    # safetensors opens a weight file with a blocking open() and holds the GIL meanwhile: a FIFO
    # named model.safetensors stalled the whole process, so that import runs in a child here; a
    # link to a device, which does not block, runs in this process.
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes(b"{}")
    store = str(tmp_path / "store")
    os.mkfifo(src / "model.safetensors")
    code = "import sys; from shardstore_cli import shardstore_cli; sys.exit(shardstore_cli.main(sys.argv[1:]))"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, "import", store, str(src)], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("import waited on a FIFO named model.safetensors")
    os.unlink(src / "model.safetensors")
    os.symlink("/dev/zero", src / "model.safetensors")
    code = shardstore_cli.main(["import", store, str(src)])
    err = capsys.readouterr().err
    for rc, said in ((proc.returncode, proc.stderr), (code, err)):
        assert rc == 1, said
        assert "not a regular file" in said and "model.safetensors" in said, said
        assert "Traceback" not in said and said.count("\n") == 1, said
    assert not os.path.exists(store) or list(ss.open_store(store).objects()) == []


# -- item 11 --------------------------------------------------------------------------------------


def test_export_never_writes_through_a_planted_link(tmp_path: Any, capsys: Any) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    ss.save(store, {"model.norm.weight": torch.ones(4)}, step=0, config={"hidden_size": 4}, rng=False)
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, out / "model.safetensors.partial")  # the old fixed temporary name
    code, err = _main(capsys, "export", store.url, "main", str(out))
    assert code == 0, err
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(out / "model.safetensors") and os.path.getsize(out / "model.safetensors") > 0
    for name in ("config.json", "model.safetensors"):  # links at the outputs themselves, replaced with --force
        os.unlink(out / name)
        os.symlink(victim, out / name)
    code, err = _main(capsys, "export", store.url, "main", str(out), "--force")
    assert code == 0, err
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(out / "config.json") and json.loads((out / "config.json").read_text()) == {
        "hidden_size": 4
    }
    assert [n for n in os.listdir(out) if n.endswith(".partial") and not os.path.islink(out / n)] == []


# -- item 12 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["foo://x", "gs://bucket/x", "s3://Bad_Bucket!/x"])
def test_bad_store_urls_are_one_line_errors(capsys: Any, url: str) -> None:
    code, err = _main(capsys, "refs", url)
    assert code == 1 and err.startswith("shardstore: error: StorageError:") and err.count("\n") == 1, err


# -- item 13 --------------------------------------------------------------------------------------


def test_cat_of_a_big_tensor_object_is_refused_without_reading_it(tmp_path: Any, capsys: Any, monkeypatch: Any) -> None:
    store = ss.open_store(str(tmp_path / "store"))
    big = torch.zeros((64 << 20) // 4 + 1)  # one element past the manifest limit
    # one object of that size (a saved tensor this big is 4 MiB blocks, SPEC.md §5.1)
    oid = store.put_tensor(big)
    store.sync()
    reads: list[str] = []
    real = LocalStorage._read

    def counted(self: LocalStorage, key: str, limit: Any, consume: Any) -> Any:
        reads.append(key)
        return real(self, key, limit, consume)

    monkeypatch.setattr(LocalStorage, "_read", counted)
    code, err = _main(capsys, "cat", store.url, oid)
    assert code == 1 and "manifest limit" in err, err
    assert not [k for k in reads if k.startswith("objects/")]


def test_s3_without_credentials_is_a_one_line_error(capsys: Any, monkeypatch: Any) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup, nothing leaves the machine
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    code, err = _main(capsys, "refs", "s3://bucket/x")
    assert code == 1 and err.startswith("shardstore: error: StorageError:") and err.count("\n") == 1, err
    assert "credentials" in err
