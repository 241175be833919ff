"""Corruption that verify used to pass, and load paths that wrote before validating (issue 12, items 3-8).

Each test plants one defect an adversarial pass found and checks that ``verify`` reports it
(naming the object) and that every load path refuses it *before* writing into the caller's
tensors:

- item 3: one object named by two entries with different byte sizes (in one commit, across commits);
- item 4: a model config nested 2,000 deep, or junk, under a valid commit;
- item 5: an oversized or malformed RNG object (and, issue 26, a Python or NumPy state no writer produces);
- item 6: a local object rewritten or truncated after it was hashed (copy, export), or while it is read;
- item 7: a torn (0-byte) object already at a copy's destination;
- item 8: a commit naming one shard manifest in many slots.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from faults import OpLog

import shardstore as ss
from shardstore.backends.local import LocalStorage
from shardstore.format.manifest import FORMAT_VERSION, CommitManifest, ShardManifest, SlotLayout
from shardstore.format.rng import capture_rng, restore_rng
from shardstore.format.roots import learned_root
from shardstore.format.tensors import hash_bytes, new_hasher, tensor_bytes
from shardstore.store import object_key


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)}


def _forge(store: ss.Store, shards: list[ShardManifest], *, layout: list[str] | None = None) -> str:
    """Write ``shards`` and a commit binding them with a correct learned-state root, without
    the writer's own checks (an attacker with write access to manifests, or a buggy tool).
    ``layout``: the shard manifest id of each slot (default: one slot per shard given)."""
    sids = [store.put_manifest(sh) for sh in shards]
    sids = layout if layout is not None else sids
    first = shards[0]
    entries = [e for sh in shards for e in sh.entries]
    commit = CommitManifest(
        version=FORMAT_VERSION, job=first.job, schedule=None, profile="fp32", config=first.config,
        optimizer=ss.manifest.OptimizerSpec(algorithm="none", groups=()), step=first.step, data_cursor=None,
        layout=tuple(SlotLayout(slot=i, shard=sid, tensors=tuple(e.name for e in store.shard(sid).entries)) for i, sid in enumerate(sids)),
        learned_root=learned_root(step=first.step, data_cursor=None, config=first.config,
                                  optimizer=ss.manifest.OptimizerSpec(algorithm="none", groups=()), entries=entries),
        parent=None, transition="train",
    )  # fmt: skip
    return store.put_manifest(commit)


def _shard(store: ss.Store, cid: str) -> ShardManifest:
    return ss.load_commit(store, cid).shards[0]


@pytest.fixture
def base(tmp_path: Any) -> Any:
    """A store with one plain commit (two tensors, a model config, RNG), weights only."""
    store = ss.open_store(str(tmp_path / "s"))
    cid = ss.save(store, _model(), step=0, config={"hidden": 4}, rng=True)
    return store, cid


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

        def put_after_damage(oid: str, data: Any, damage: str = damage, **kw: Any) -> bool:
            if oid == w:  # the source's bytes were hashed; now change the file under them
                _rewrite(src, w, b"\0" * 64 if damage == "rewrite" else b"")
            return real(oid, data, **kw)

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


# -- item 3: every entry's size rule ------------------------------------------------------------


def test_one_object_named_with_two_sizes_in_one_commit(base: Any) -> None:
    store, cid = base
    sh = _shard(store, cid)
    b, w = sh.entries
    forged = msgspec.structs.replace(
        sh, entries=(b, msgspec.structs.replace(w, param=b.param))
    )  # w (64 B) names b's 16 B
    bad = _forge(store, [forged])
    report = ss.verify(store, [bad])
    assert any(p.kind == "TensorMismatch" and p.object == b.param for p in report.problems), [
        str(p) for p in report.problems
    ]
    with pytest.raises(ss.TensorMismatch, match=b.param):
        ss.load_commit(store, bad)


def test_one_object_named_with_two_sizes_across_commits(base: Any) -> None:
    """Before the fix verify checked an object's size for the first entry naming it only."""
    store, cid = base
    sh = _shard(store, cid)
    b, w = sh.entries
    small = msgspec.structs.replace(w, shape=(2, 2))  # names w's 64-byte object as 16 bytes
    bad = _forge(store, [msgspec.structs.replace(sh, entries=(b, small))])
    for quick in (False, True):
        report = ss.verify(store, [cid, bad], deep=not quick)
        hits = [p for p in report.problems if p.kind == "TensorMismatch" and p.commit == bad and p.object == w.param]
        assert hits, (quick, [str(p) for p in report.problems])
        assert not [p for p in report.problems if p.commit == cid]


# -- items 4 and 5: model config and RNG objects are decoded and bounded, before restore writes ---


def _untouched_restore(store: ss.Store, target: str, error: type[Exception], **kw: Any) -> None:
    """restore(target) raises ``error`` and the destination tensors still hold what they held."""
    dest = {"w": torch.full((4, 4), 7.0), "b": torch.full((4,), 7.0)}
    with pytest.raises(error):
        ss.restore(store, target, dest, **kw)
    assert all(bool((t == 7.0).all()) for t in dest.values()), "restore wrote into the tensors before refusing"


@pytest.mark.parametrize(
    "config", [b'{"a":' + b"[" * 2000 + b"]" * 2000 + b"}", b"junk", b'{"a":1.5}'], ids=["deep", "junk", "float"]
)
def test_a_bad_model_config_is_found_by_verify_and_refused_before_restore_writes(base: Any, config: bytes) -> None:
    store, cid = base
    oid = store.put(config)
    sh = _shard(store, cid)
    bad = _forge(store, [msgspec.structs.replace(sh, config=oid)])
    report = ss.verify(store, [bad])
    assert [p.object for p in report.problems] == [oid], [str(p) for p in report.problems]
    assert report.problems[0].kind == "ManifestError"
    _untouched_restore(store, bad, ss.ManifestError)


def _mt_state(kind: str, **changes: Any) -> bytes:
    """A Python or NumPy RNG object as a writer stores it (SPEC.md §10), with ``changes`` to its fields."""
    if kind == "python":
        version, words, gauss = random.Random(0).getstate()
        doc: dict[str, Any] = {"version": version, "state": list(words), "gauss": gauss}
    else:
        name, key, pos, has_gauss, gauss = np.random.RandomState(0).get_state(legacy=True)
        doc = {
            "bit_generator": name,
            "key": key.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss).hex(),
        }
    doc.update(changes)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@pytest.fixture
def keep_rng() -> Any:
    """The process's generators as they were, whatever a test (or the code before a fix) set."""
    saved = capture_rng(cuda=False)
    yield
    restore_rng(saved)


#: States NumPy's or Python's generator takes but no writer produces (issue 26): NumPy reads its key
#: at ``pos`` (100000: past its 624 words, a segfault on the next draw) and indexes a 623-word key
#: out of range (an untyped IndexError); Python truncates a word of 2^32 to 32 bits.
_HOSTILE_MT = {
    "numpy-pos-100000": ("numpy", lambda: _mt_state("numpy", pos=100000)),
    "numpy-key-623": (
        "numpy",
        lambda: _mt_state("numpy", key=np.random.RandomState(0).get_state(legacy=True)[1].tolist()[:623]),
    ),
    "python-word-2^32": ("python", lambda: _mt_state("python", state=[1 << 32, *random.Random(0).getstate()[1][1:]])),
}


@pytest.mark.parametrize(
    "kind, rng",
    [
        ("torch", b"\0" * (2 << 20)),
        ("python", b"not a python state"),
        ("numpy", b'{"bit_generator":"MT19937"}'),
        *_HOSTILE_MT.values(),
    ],
    ids=["torch-2MiB", "python-junk", "numpy-junk", *_HOSTILE_MT],
)
def test_a_bad_rng_object_is_found_by_verify_and_refused_before_restore_writes(
    base: Any, keep_rng: Any, kind: str, rng: Any
) -> None:
    """A hostile Python or NumPy state is reported by verify, naming the RNG object, and refused
    by restore before a tensor or generator is written (SPEC.md §10; before issue 26 the
    hostile ones verified clean, and restore set them into the process's generators)."""
    store, cid = base
    rng = rng() if callable(rng) else rng
    before = (random.getstate(), np.random.get_state(legacy=True))
    oid = store.put(rng)
    sh = _shard(store, cid)
    entries = tuple(msgspec.structs.replace(r, object=oid) if r.kind == kind else r for r in sh.rng)
    bad = _forge(store, [msgspec.structs.replace(sh, rng=entries)])
    report = ss.verify(store, [bad])
    assert [p.object for p in report.problems] == [oid], [str(p) for p in report.problems]
    assert issubclass(type(report.problems[0].error), ss.ManifestError)
    _untouched_restore(store, bad, ss.ManifestError, rng=True)
    after = (random.getstate(), np.random.get_state(legacy=True))
    assert before[0] == after[0] and all(np.array_equal(x, y) for x, y in zip(before[1], after[1])), (
        "restore set a generator before refusing"
    )


def test_a_torch_rng_state_torch_cannot_set_is_refused_before_restore_writes(base: Any) -> None:
    """verify checks a raw torch state's size limit only (what torch accepts depends on its
    build); restore checks that torch can set it, before writing a tensor."""
    store, cid = base
    oid = store.put(b"sixteen bytes!!!")
    sh = _shard(store, cid)
    bad = _forge(
        store,
        [
            msgspec.structs.replace(
                sh, rng=tuple(msgspec.structs.replace(r, object=oid) if r.kind == "torch" else r for r in sh.rng)
            )
        ],
    )
    assert ss.verify(store, [bad]).ok
    _untouched_restore(store, bad, ss.ManifestError, rng=True)


# -- item 7: copy never trusts a torn object at the destination -----------------------------------


def test_copy_replaces_a_torn_object_at_the_destination(tmp_path: Any, base: Any) -> None:
    src, cid = base
    dst = ss.open_store(str(tmp_path / "dst"))
    w = ss.load_commit(src, cid).entries()["w"].param
    path = os.path.join(dst.url, object_key(w))
    os.makedirs(os.path.dirname(path))
    open(path, "wb").close()  # a 0-byte torn object, as a crash on a weak file system leaves
    for _ in range(2):
        ss.copy_commit(src, dst, cid, ref="main")
        report = ss.verify(dst, deep=False)
        assert report.ok, [str(p) for p in report.problems]
    assert ss.verify(dst).ok


# -- item 8: one shard manifest in many slots is refused before it is read ------------------------


def test_a_repeated_shard_manifest_is_refused_before_reading(base: Any) -> None:
    store, cid = base
    sid = ss.load_commit(store, cid).shard_ids[0]
    sh = store.shard(sid)
    bad = _forge(store, [sh], layout=[sid] * 128)
    log = OpLog(store.storage)
    counted = ss.Store(log, create=False)
    with pytest.raises(ss.LayoutError, match="same shard manifest"):
        ss.load_commit(counted, bad)
    report = ss.verify(counted, [bad])
    assert [p.kind for p in report.problems] == ["LayoutError"]
    assert sum(1 for op, key, _ in log.log if key.endswith(sid)) == 0  # never read, not 128 times
    from shardstore.ops.gc import gc

    store.set_ref("bad", bad, expected=None)
    with pytest.raises(ss.LayoutError):
        gc(counted, grace_seconds=3600, dry_run=True)
    # at most once, for the good commit main that names the same shard manifest (walked first when its id sorts first)
    assert [op for op, key, _ in log.log if key.endswith(sid) and op == "read"] in ([], ["read"])


def test_an_optimizer_that_does_not_match_is_refused_before_restore_writes(tmp_path: Any) -> None:
    """Group names are checked (on a stand-in of the optimizer) before any tensor is read;
    before the fix the parameters were overwritten, then StateMismatch was raised."""
    store = ss.open_store(str(tmp_path / "s"))
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([{"params": [w], "name": "decay"}])
    w.grad = torch.ones(4)
    opt.step()
    cid = ss.save(store, {"w": w}, opt, step=1, rng=False)
    dest = torch.nn.Parameter(torch.full((4,), 7.0))
    other = torch.optim.AdamW([{"params": [dest], "name": "other", "lr": torch.tensor(0.5)}])
    with pytest.raises(ss.StateMismatch, match="other"):
        ss.restore(store, cid, {"w": dest}, other)
    assert bool((dest == 7.0).all()) and float(other.param_groups[0]["lr"]) == 0.5 and not other.state
    ss.restore(store, cid, {"w": dest}, torch.optim.AdamW([{"params": [dest], "name": "decay"}]))
    assert torch.equal(dest, w)


def test_deep_verify_of_a_file_truncated_while_hashed_by_two_threads_is_no_signal(tmp_path: Any) -> None:
    """Deep verify used to hash a large object with two BLAKE3 threads through a mapping of
    the file, where a truncation in the middle raises SIGBUS; it now reads through a buffer,
    so the hash sees fewer bytes and names the damage. Run in a forked child so that a
    signal would be seen (and one that maps the file exits 4)."""
    store = ss.open_store(str(tmp_path / "s"))
    oid = store.put(os.urandom(40 << 20))  # more than two of the threaded reads
    storage = store.storage
    assert isinstance(storage, LocalStorage)

    path = os.path.join(store.url, object_key(oid))
    os.chmod(path, 0o644)

    class Truncating:
        def __init__(self) -> None:
            self.h, self.calls = new_hasher(2), 0

        def update(self, data: Any) -> None:
            self.h.update(data)
            self.calls += 1
            if self.calls == 1:  # the first read is hashed: the file shrinks under the reader
                os.truncate(path, 1 << 20)

        def update_mmap(self, mapped: str) -> None:  # the mapped path: never taken any more
            os._exit(4)

        def hexdigest(self) -> str:
            return self.h.hexdigest()

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        digest, size = storage.hash_object(object_key(oid), Truncating, threads=2)
        os._exit(0 if digest != oid and size < (40 << 20) else 3)
    status = os.waitpid(pid, 0)[1]
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
