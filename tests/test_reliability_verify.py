"""Corruption that verify used to pass, and load paths that wrote before validating (issue 12, items 3-8).

Each test plants one defect an adversarial pass found and checks that ``verify`` reports it
(naming the object) and that every load path refuses it *before* writing into the caller's
tensors:

- item 3: one object named by two entries with different byte sizes (in one commit, across commits);
- item 4: a model config nested 2,000 deep, or junk, under a valid commit;
- item 5: an oversized or malformed RNG object;
- item 6: a local object rewritten or truncated after it was hashed (copy, export), or while it is read;
- item 7: a torn (0-byte) object already at a copy's destination;
- item 8: a commit naming one shard manifest in many slots.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import shardstore as ss
from shardstore.local import LocalStorage
from shardstore.manifest import FORMAT_VERSION, CommitManifest, SlotLayout, encode
from shardstore.store import object_key
from shardstore.tensors import hash_bytes, new_hasher, tensor_bytes


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)}


def _plant(store: ss.Store, data: bytes) -> str:
    """Write ``data`` as an object under its real id (a valid object, hostile content)."""
    return store.put(data)


def _rewrite(store: ss.Store, oid: str, data: bytes) -> None:
    """Replace object ``oid``'s bytes in place (a careless tool or an attacker with write access)."""
    path = os.path.join(store.url, object_key(oid))
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))


# -- item 6: what leaves a local store is the bytes that were verified ---------------------------


def test_copy_writes_the_verified_bytes_even_if_the_source_changes_after_hashing(tmp_path: Any) -> None:
    """Before the fix a local read handed out a live mapping of the file: rewriting it after
    hashing made copy write unverified bytes under the original id (exit 0), and truncating
    it killed the process with SIGBUS. Both run in a forked child so that a signal is seen."""
    src = ss.open_store(str(tmp_path / "src"))
    cid = ss.save(src, _model(), step=0, rng=False)
    w = ss.load_commit(src, cid).entries()["w"].param
    for damage in ("rewrite", "truncate"):
        dst = ss.open_store(str(tmp_path / f"dst-{damage}"))
        real = dst.put_with_id

        def put_after_damage(oid: str, data: Any, damage: str = damage) -> bool:
            if oid == w:  # the source's bytes were hashed; now change the file under them
                _rewrite(src, w, b"\0" * 64 if damage == "rewrite" else b"")
            return real(oid, data)

        dst.put_with_id = put_after_damage  # type: ignore[method-assign]
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                ss.copy_commit(src, dst, cid, threads=1)
                os._exit(0)
            except BaseException:
                os._exit(3)
        status = os.waitpid(pid, 0)[1]
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (damage, status)
        got = ss.open_store(dst.url, create=False)
        assert hash_bytes(got.get(w, verify=False)) == w, damage  # the verified bytes, not the rewritten ones
        assert ss.verify(got, [cid]).ok
        src.storage.delete(object_key(w))  # restore the source object for the next damage kind
        assert src.put(tensor_bytes(_model()["w"])) == w


def test_a_file_that_shrinks_while_read_is_a_typed_error(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    oid = store.put(os.urandom(3 << 20))  # three read chunks
    storage = store.storage
    assert isinstance(storage, LocalStorage)
    h = new_hasher()
    chunks = [0]

    def consume(view: memoryview) -> None:
        h.update(view)
        if chunks[0] == 0:
            _rewrite(store, oid, b"short")
        chunks[0] += 1

    class Hasher:
        update = staticmethod(consume)

        @staticmethod
        def hexdigest() -> str:
            return h.hexdigest()

    with pytest.raises(ss.StorageError, match="shrank"):
        storage.read_hashed(object_key(oid), Hasher)
