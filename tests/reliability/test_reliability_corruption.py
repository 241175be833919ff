"""Corruption sweep (issue 8, part 4), git-fsck style: plant damage, every reader must see it.

A two-slot commit (model config, AdamW moments, RNG objects) on a local store, then:

- every bit of every small object flipped: the commit manifest, both shard manifests, the
  model config object, the ref file and the store config;
- random bits of the tensor, moment and RNG objects (2,000 in CI);
- every referenced object truncated to 0, 1, n/2 and n-1 bytes, extended by one byte,
  deleted; pairs of objects swapped.

Each must be detected by ``verify`` (a problem naming the damaged object) and by every
load path — ``load_commit`` where the damage is in a manifest, ``restore`` (model,
optimizer, RNG), ``copy_commit`` and ``export_commit`` — with a typed error naming the
object, before any tensor is handed back. (A failed ``restore`` may already have written
into the destination tensors; that is its documented contract: repeat or abandon it.)
In CI every bit of a manifest goes through ``load_commit`` (``verify`` for the model
config), every 4th also through ``verify``, every 16th through every path; every 10th
tensor bit goes through every path. ``SHARDSTORE_SLOW=1`` sends every case through
every path.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import pytest
import torch
from faults import fast_dir, forge_ref
from sweeps import DENSITIES

import shardstore as ss
from shardstore.ops.interchange import export_commit

SLOW = bool(os.environ.get("SHARDSTORE_SLOW"))


class Tiny(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(3, 4, generator=g))
        self.b = torch.nn.Parameter(torch.randn(4, generator=g))
        self.s = torch.nn.Parameter(torch.randn(2, generator=g))


@pytest.fixture(scope="module")
def world(tmp_path_factory: Any) -> Any:
    scratch = fast_dir(str(tmp_path_factory.mktemp("corrupt")))
    root = os.path.join(scratch, "store")
    store = ss.open_store(root)
    model = Tiny()
    opt = torch.optim.AdamW(
        [
            {"params": [model.w], "name": "decay"},
            {"params": [model.b, model.s], "name": "no_decay", "weight_decay": 0.0},
        ]
    )
    for _ in range(2):
        opt.zero_grad()
        (model.w.sum() + model.b.square().sum() + model.s.sum()).backward()
        opt.step()
    states = [ss.capture(model, opt, names=["b", "w"]), ss.capture(model, opt, names=["s"])]
    cid = ss.save_slots(store, states, info=ss.CommitInfo(step=2, config={"hidden": 4, "eps": 1e-6}, data_cursor=2))
    yield {"root": root, "cid": cid, "scratch": scratch}
    shutil.rmtree(scratch, ignore_errors=True)


def _objects(store: ss.Store, cid: str) -> dict[str, str]:
    """object id -> kind, for everything the commit references."""
    lc = ss.load_commit(store, cid)
    out = {cid: "commit", lc.commit.config: "config"}
    for s, sid in lc.shard_ids.items():
        out[sid] = "shard"
        for r in lc.shards[s].rng:
            out[r.object] = "rng"
        for e in lc.shards[s].entries:
            out[e.param] = "tensor"
            if e.optim and e.optim.exp_avg:
                out[e.optim.exp_avg] = "tensor"
                out[e.optim.exp_avg_sq] = "tensor"
    return out


def _path(root: str, oid: str) -> str:
    return os.path.join(root, "objects", oid[:2], oid)


class Damage:
    """Write damaged bytes at a path; undo restores the original."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.original = open(path, "rb").read() if os.path.exists(path) else None

    def write(self, data: bytes | None) -> None:
        if data is None:
            os.unlink(self.path)
        else:
            with open(self.path, "wb") as f:
                f.write(data)

    def undo(self) -> None:
        assert self.original is not None
        self.write(self.original)


def _detect(root: str, cid: str, name: str, paths: tuple[str, ...], tmp: str) -> None:
    """Every path in ``paths`` refuses the store with a typed error whose message contains ``name``."""
    try:
        store = ss.open_store(root, create=False)
    except ss.StoreConfigError:
        assert name == "config"
        return
    if "verify" in paths:
        report = ss.verify(store)
        assert not report.ok, f"verify missed damage to {name}"
        assert any(name in str(p) or p.object == name for p in report.problems), [str(p) for p in report.problems]
    for path in paths:
        if path == "verify":
            continue
        with pytest.raises(ss.ShardstoreError) as info:
            if path == "load_commit":
                ss.load_commit(store, "main")
            elif path == "restore":
                m = Tiny(seed=5)
                o = torch.optim.AdamW([{"params": [m.w], "name": "decay"}, {"params": [m.b, m.s], "name": "no_decay"}])
                ss.restore(store, "main", m, o, rng=True, slot=0)
                ss.restore(store, "main", m, o, rng=True, slot=1)
            elif path == "copy":
                dst = ss.open_store(os.path.join(tmp, "dst"))
                try:
                    ss.copy_commit(store, dst, "main", ref="main")
                finally:
                    shutil.rmtree(os.path.join(tmp, "dst"))
            elif path == "export":
                try:
                    export_commit(store, "main", os.path.join(tmp, "export"), with_optimizer=True)
                finally:
                    shutil.rmtree(os.path.join(tmp, "export"), ignore_errors=True)
        assert name in str(info.value) or (name == "ref" and "main" in str(info.value)), (path, str(info.value))


def _flip(data: bytes, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


ALL = ("verify", "load_commit", "restore", "copy", "export")
#: The paths that read each kind of object (load_commit reads manifests only; an export holds no RNG).
PATHS = {
    "commit": ALL,
    "shard": ALL,
    "config": ("verify", "restore", "copy", "export"),
    "tensor": ("verify", "restore", "copy", "export"),
    "rng": ("verify", "restore", "copy"),
}


def test_clean_store_passes_every_path(world: Any) -> None:
    store = ss.open_store(world["root"], create=False)
    assert ss.verify(store).ok
    m = Tiny(seed=5)
    ss.restore(store, "main", m)


@pytest.mark.long
def test_every_bit_of_every_small_object(world: Any) -> None:
    root, cid = world["root"], world["cid"]
    store = ss.open_store(root, create=False)
    small = [(oid, kind) for oid, kind in _objects(store, cid).items() if kind in ("commit", "shard", "config")]
    targets = [(_path(root, oid), oid, PATHS[kind]) for oid, kind in small]
    targets += [(os.path.join(root, "refs", "main"), "ref", ALL), (os.path.join(root, "config"), "config", ALL)]
    cases = 0
    for path, name, heavy_paths in targets:
        d = Damage(path)
        assert d.original is not None
        try:
            for bit in range(len(d.original) * 8):
                d.write(_flip(d.original, bit))
                if SLOW or bit % 16 == 0:
                    paths = heavy_paths
                elif bit % 4 == 0:
                    paths = heavy_paths[:2]
                else:  # the first gate of every path: the object is refused by name
                    paths = heavy_paths[1:2] if heavy_paths[1] == "load_commit" else heavy_paths[:1]
                _detect(root, cid, name, paths, world["scratch"])
                cases += 1
        finally:
            d.undo()
    assert ss.verify(ss.open_store(root, create=False)).ok
    print(f"small-object bit flips: {cases}")


@pytest.mark.parametrize("density", DENSITIES)
def test_random_bits_of_tensor_and_rng_objects(world: Any, density: str) -> None:
    """2,000 random bit flips in CI's long step, 500 in the test command (20,000 when slow)."""
    root, cid = world["root"], world["cid"]
    store = ss.open_store(root, create=False)
    data = [(oid, kind) for oid, kind in _objects(store, cid).items() if kind in ("tensor", "rng")]
    rnd = random.Random(4)
    n = 20000 if SLOW else 2000 if density == "dense" else 500
    for i in range(n):
        oid, kind = rnd.choice(data)
        d = Damage(_path(root, oid))
        d.write(_flip(d.original, rnd.randrange(len(d.original) * 8)))
        try:
            _detect(root, cid, oid, PATHS[kind] if (SLOW or i % 10 == 0) else ("verify",), world["scratch"])
        finally:
            d.undo()
    print(f"tensor/RNG bit flips: {n}")


@pytest.mark.parametrize("cut", ["empty", "one", "half", "minus_one", "append", "delete"])
def test_truncate_extend_delete_every_object(world: Any, cut: str) -> None:
    root, cid = world["root"], world["cid"]
    store = ss.open_store(root, create=False)
    for oid, kind in _objects(store, cid).items():
        d = Damage(_path(root, oid))
        raw = d.original
        assert raw is not None
        bad = {
            "empty": b"",
            "one": raw[:1],
            "half": raw[: len(raw) // 2],
            "minus_one": raw[:-1],
            "append": raw + b"\x00",
            "delete": None,
        }[cut]
        if bad == raw:
            continue  # a 1-byte object cut to 1 byte is itself
        d.write(bad)
        try:
            _detect(root, cid, oid, PATHS[kind], world["scratch"])
        finally:
            d.undo()


def test_swapped_objects(world: Any) -> None:
    root, cid = world["root"], world["cid"]
    store = ss.open_store(root, create=False)
    objs = list(_objects(store, cid).items())
    rnd = random.Random(5)
    pairs = [(a, b) for i, a in enumerate(objs) for b in objs[i + 1 :]]
    for (a, ka), (b, kb) in pairs if SLOW else rnd.sample(pairs, 40):
        da, db = Damage(_path(root, a)), Damage(_path(root, b))
        if da.original == db.original:
            continue
        da.write(db.original)
        db.write(da.original)
        try:
            _swapped_detected(root, a, b)
        finally:
            da.undo()
            db.undo()
    assert ss.verify(ss.open_store(root, create=False)).ok


def _swapped_detected(root: str, a: str, b: str) -> None:
    report = ss.verify(ss.open_store(root, create=False))
    assert {a, b} & {p.object for p in report.problems}, [str(p) for p in report.problems]
    with pytest.raises(ss.ShardstoreError) as info:
        m = Tiny(seed=5)
        o = torch.optim.AdamW([{"params": [m.w], "name": "decay"}, {"params": [m.b, m.s], "name": "no_decay"}])
        for slot in (0, 1):
            ss.restore(ss.open_store(root, create=False), "main", m, o, rng=True, slot=slot)
    assert a in str(info.value) or b in str(info.value), str(info.value)


def test_invalid_utf8_in_a_manifest_string_is_a_manifest_error(tmp_path: Any) -> None:
    """Regression: msgspec (0.22) raises UnicodeDecodeError (not DecodeError) for invalid UTF-8
    inside a string; a bit flip in the store config escaped open_store as that untyped error.
    msgspec 0.23 raises DecodeError("Invalid UTF-8 ..."): both must come out typed."""
    root = str(tmp_path / "s")
    ss.open_store(root)
    raw = bytearray(open(os.path.join(root, "config"), "rb").read())
    raw[raw.index(b"blake3")] = 0xE6
    open(os.path.join(root, "config"), "wb").write(bytes(raw))
    with pytest.raises(ss.StoreConfigError, match="(?i)utf-8"):
        ss.open_store(root, create=False)
    with pytest.raises(ss.ManifestError):
        ss.decode(b'{"a":"\xff"}')
    from shardstore.format.manifest import decode_config

    with pytest.raises(ss.ManifestError):
        decode_config(b'{"a":"\xff"}')


def test_a_ref_naming_a_missing_commit_is_reported_by_ref_name(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    ghost = "ab" * 32
    forge_ref(store, "main", ghost)
    report = ss.verify(store)
    assert [p.object for p in report.problems] == [ghost] and "named by ref 'main'" in str(report.problems[0])
    with pytest.raises(ss.ObjectNotFound, match=f"commit {ghost} \\(named by .main.\\)"):
        ss.load_commit(store, "main")
