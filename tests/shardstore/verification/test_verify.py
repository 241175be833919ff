"""Verification rejects every corruption and every forged-but-well-hashed inconsistency,
naming the object and tensor, on load and in ``verify``."""

from __future__ import annotations

import os
import random

import pytest
from conftest import TinyNet, make_optimizer, train_steps
from faults import forge_ref
from sweeps import DENSITIES, stride

import shardstore as ss
from shardstore.format.manifest import encode


def _path(store: ss.Store, oid: str) -> str:
    return os.path.join(store.storage.root, "objects", oid[:2], oid)


def _rewrite(store: ss.Store, oid: str, data: bytes) -> None:
    with open(_path(store, oid), "wb") as f:
        f.write(data)


def _all_referenced(store: ss.Store, cid: str) -> list[tuple[str, str]]:
    """(object id, kind) of every object the commit references, the commit itself first."""
    lc = ss.load_commit(store, cid)
    out = [(cid, "commit"), (lc.commit.config, "config")]
    for s, sid in lc.shard_ids.items():
        out.append((sid, "shard"))
        for r in lc.shards[s].rng:
            out.append((r.object, "rng"))
        for e in lc.shards[s].entries:
            out.append((e.param, "tensor"))
            if e.optim and e.optim.exp_avg:
                out += [(e.optim.exp_avg, "tensor"), (e.optim.exp_avg_sq, "tensor")]
    return out


@pytest.fixture
def committed(store):
    model = TinyNet(width=4)
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    names = [n for n, _ in model.named_parameters()]
    cid = ss.save_slots(
        store,
        [ss.capture(model, opt, names=names[:4]), ss.capture(model, opt, names=names[4:])],
        info=ss.CommitInfo(step=2, config={"w": 4}),
    )
    return store, cid, model, opt


def _load_fails(store, cid, model, opt) -> ss.ShardstoreError:
    fresh = TinyNet(width=4, seed=3)
    with pytest.raises(ss.ShardstoreError) as info:
        ss.restore(store, cid, fresh, make_optimizer(fresh))
    return info.value


def test_clean_commit_verifies(committed):
    store, cid, *_ = committed
    report = ss.verify(store)
    assert report.ok, [str(p) for p in report.problems]
    assert report.objects_checked == len({o for o, _ in _all_referenced(store, cid)})
    assert not ss.verify(store, deep=False).problems


@pytest.mark.parametrize("density", DENSITIES)
def test_every_single_byte_change_of_every_small_object_is_rejected(committed, density):
    """Each byte of the commit, shard manifests and config (CI's long step; every fifth byte in
    the test command), and sampled bytes of every tensor object: xor-ed with a random non-zero
    value, the object is rejected by name."""
    store, cid, model, opt = committed
    rnd = random.Random(0)
    step = stride(density, dense=1, sample_factor=5)
    cases = 0
    for oid, kind in dict.fromkeys(_all_referenced(store, cid)):
        original = open(_path(store, oid), "rb").read()
        positions = (
            range(rnd.randrange(step), len(original), step)
            if kind in ("commit", "shard", "config")
            else rnd.sample(range(len(original)), min(4, len(original)))
        )
        for pos in positions:
            bad = bytearray(original)
            bad[pos] ^= rnd.randrange(1, 256)
            _rewrite(store, oid, bytes(bad))
            with pytest.raises(ss.CorruptObject, match=oid):
                store.get(oid)
            report = ss.verify(store, [cid]) if kind != "commit" else None
            if report is not None:
                assert any(p.object == oid for p in report.problems), (kind, pos)
            cases += 1
        _rewrite(store, oid, original)
    assert ss.verify(store).ok
    assert cases > 2000 // step


@pytest.mark.parametrize("cut", ["empty", "one", "half", "minus_one", "append"])
def test_truncated_or_extended_objects(committed, cut):
    store, cid, model, opt = committed
    lc = ss.load_commit(store, cid)
    e = lc.shards[1].entries[0]
    original = open(_path(store, e.param), "rb").read()
    n = len(original)
    bad = {
        "empty": b"",
        "one": original[:1],
        "half": original[: n // 2],
        "minus_one": original[:-1],
        "append": original + b"\0",
    }[cut]
    _rewrite(store, e.param, bad)
    problems = ss.verify(store, [cid]).problems
    assert [p.object for p in problems] == [e.param] and problems[0].tensor == e.name
    assert isinstance(problems[0].error, ss.CorruptObject)
    quick = ss.verify(store, [cid], deep=False).problems
    assert [p.object for p in quick] == [e.param] and isinstance(quick[0].error, ss.TensorMismatch)
    err = _load_fails(store, cid, model, opt)  # refused by its size before any byte is read (SPEC.md §16), as quick
    assert isinstance(err, ss.TensorMismatch) and e.param in str(err)  # verify reports it: no hash was needed


def test_missing_objects_are_reported_each(committed):
    store, cid, model, opt = committed
    lc = ss.load_commit(store, cid)
    gone = [lc.shards[0].entries[0].param, lc.shards[1].entries[-1].optim.exp_avg_sq]
    for oid in gone:
        os.unlink(_path(store, oid))
    report = ss.verify(store, [cid])
    assert sorted(p.object for p in report.problems) == sorted(gone)
    assert all(isinstance(p.error, ss.ObjectNotFound) for p in report.problems)
    err = _load_fails(store, cid, model, opt)
    assert isinstance(err, ss.ObjectNotFound)


def test_missing_shard_manifest(committed):
    store, cid, model, opt = committed
    sid = ss.load_commit(store, cid).shard_ids[1]
    os.unlink(_path(store, sid))
    report = ss.verify(store, [cid])
    assert any(p.object == sid and isinstance(p.error, ss.ObjectNotFound) for p in report.problems)
    with pytest.raises(ss.ObjectNotFound, match=sid):
        ss.load_commit(store, cid)


def _forge_commit(store: ss.Store, cid: str, **changes) -> str:
    c = store.commit(cid)
    import msgspec

    return store.put_manifest(msgspec.structs.replace(c, **changes))


def _forge_shard(store: ss.Store, sid: str, **changes) -> str:
    import msgspec

    return store.put_manifest(msgspec.structs.replace(store.shard(sid), **changes))


def test_shard_from_another_commit_is_rejected(committed):
    store, cid, model, opt = committed
    train_steps(model, opt, 1)
    names = [n for n, _ in model.named_parameters()]
    other = ss.save_slots(
        store,
        [ss.capture(model, opt, names=names[:4]), ss.capture(model, opt, names=names[4:])],
        info=ss.CommitInfo(step=3, config={"w": 4}),
    )
    c, o = store.commit(cid), store.commit(other)
    import msgspec

    mixed_layout = (c.layout[0], msgspec.structs.replace(o.layout[1]))
    forged = _forge_commit(store, cid, layout=mixed_layout)
    with pytest.raises(ss.BindingError, match=o.layout[1].shard):
        ss.load_commit(store, forged)
    assert any(isinstance(p.error, ss.BindingError) for p in ss.verify(store, [forged]).problems)


def test_layout_owning_a_tensor_twice_or_not_at_all(committed):
    store, cid, *_ = committed
    c = store.commit(cid)
    import msgspec

    first = c.layout[0].tensors[0]
    twice = (c.layout[0], msgspec.structs.replace(c.layout[1], tensors=tuple(sorted((*c.layout[1].tensors, first)))))
    with pytest.raises(ss.LayoutError, match="owned twice"):
        ss.load_commit(store, _forge_commit(store, cid, layout=twice))
    unowned = (msgspec.structs.replace(c.layout[0], tensors=c.layout[0].tensors[1:]), c.layout[1])
    with pytest.raises(ss.LayoutError, match=first.replace(".", r"\.")):
        ss.load_commit(store, _forge_commit(store, cid, layout=unowned))
    gap = (msgspec.structs.replace(c.layout[1], slot=1),)
    with pytest.raises(ss.LayoutError):
        ss.load_commit(store, _forge_commit(store, cid, layout=gap))


def test_inconsistent_adam_cursor_is_rejected(committed):
    store, cid, *_ = committed
    import msgspec

    c = store.commit(cid)
    shard = store.shard(c.layout[0].shard)
    e = shard.entries[0]
    bad_entry = msgspec.structs.replace(e, optim=msgspec.structs.replace(e.optim, age=e.optim.age + 1))
    sid = _forge_shard(store, c.layout[0].shard, entries=(bad_entry, *shard.entries[1:]))
    forged = _forge_commit(store, cid, layout=(msgspec.structs.replace(c.layout[0], shard=sid), c.layout[1]))
    with pytest.raises(ss.CursorError, match=e.name.replace(".", r"\.")):
        ss.load_commit(store, forged)


def test_dtype_or_shape_forged_in_entry(committed):
    store, cid, model, opt = committed
    import msgspec

    c = store.commit(cid)
    shard = store.shard(c.layout[1].shard)
    e = shard.entries[0]
    for change in ({"dtype": "float64"}, {"shape": (*e.shape, 2)}):
        bad = msgspec.structs.replace(e, **change)
        sid = _forge_shard(store, c.layout[1].shard, entries=(bad, *shard.entries[1:]))
        forged = _forge_commit(store, cid, layout=(c.layout[0], msgspec.structs.replace(c.layout[1], shard=sid)))
        # the learned-state root no longer matches the forged entries
        with pytest.raises(ss.ManifestError, match="learned-state root"):
            ss.load_commit(store, forged)
        problems = ss.verify(store, [forged]).problems
        assert any(isinstance(p.error, ss.TensorMismatch) and p.tensor == e.name for p in problems)


def test_learned_root_forgery(committed):
    store, cid, *_ = committed
    forged = _forge_commit(store, cid, learned_root="0" * 64)
    with pytest.raises(ss.ManifestError, match="learned-state root"):
        ss.load_commit(store, forged)


def test_ref_to_missing_commit(committed):
    store, cid, *_ = committed
    forge_ref(store, "dangling", "f" * 64)
    report = ss.verify(store)
    assert any(p.object == "f" * 64 and isinstance(p.error, ss.ObjectNotFound) for p in report.problems)


def test_manifest_bytes_are_what_is_hashed(committed):
    store, cid, *_ = committed
    assert bytes(store.get(cid)) == encode(store.commit(cid))


def test_malformed_ref_is_a_problem_not_a_crash(committed):
    store, cid, *_ = committed
    with open(os.path.join(store.storage.root, "refs", "broken"), "wb") as f:
        f.write(b"not a commit id\n")
    seen = []
    report = ss.verify(store, progress=seen.append)
    assert [type(p.error) for p in report.problems] == [ss.ManifestError]
    assert "broken" in str(report.problems[0])
    assert report.commits == [cid] and sum(seen) == report.bytes_hashed > 0


@pytest.mark.parametrize("algorithm", ["adam", "adamw"])
def test_adam_without_groups_is_refused_in_a_shard_and_in_a_commit(store, algorithm):
    """SPEC.md §12: a writer writes ``none`` exactly when there are no groups (every writer
    version did), so ``adam``/``adamw`` with no groups is a second spelling of one state, refused
    in a shard manifest and in a commit. Before issue 26 both forgeries verified clean, and
    load_commit took them."""
    import msgspec
    import torch

    from shardstore.format.roots import learned_root

    cid = ss.save(store, {"w": torch.zeros(3)}, step=0, rng=False)
    c = store.commit(cid)
    assert c.optimizer.algorithm == "none" and store.shard(c.layout[0].shard).algorithm == "none"
    sid = _forge_shard(store, c.layout[0].shard, algorithm=algorithm)  # the root does not cover a shard's algorithm
    in_shard = _forge_commit(store, cid, layout=(msgspec.structs.replace(c.layout[0], shard=sid),))
    spec = ss.manifest.OptimizerSpec(algorithm=algorithm, groups=())
    root = learned_root(
        step=c.step,
        data_cursor=c.data_cursor,
        config=c.config,
        optimizer=spec,
        entries=list(store.shard(c.layout[0].shard).entries),
    )
    in_commit = _forge_commit(store, cid, optimizer=spec, learned_root=root)
    for forged, where in ((in_shard, sid), (in_commit, in_commit)):
        with pytest.raises(ss.ManifestError, match=f"algorithm '{algorithm}' with no optimizer groups"):
            ss.load_commit(store, forged)
        problems = ss.verify(store, [forged]).problems
        assert [(p.kind, p.object) for p in problems] == [("ManifestError", where)], [str(p) for p in problems]
    assert ss.verify(store, [cid]).ok
