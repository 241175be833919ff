"""A store written before format version 4 (row-band grid, versions 2 and 3) still reads,
verifies, restores, copies, diffs and exports (SPEC.md §Versioning).

``tests/data/v3_store.tar.gz`` was written by shardstore at commit 3066e75, before the tile
grid (``tests/data/make_v3_store.py`` says how): it is the old writer's own bytes, not a
re-creation by the new code.
"""
from __future__ import annotations

import torch


class LegacyModel(torch.nn.Module):
    """``w`` float32 [3, 524288] (6 MiB: two row-band blocks, rows 0-1 and row 2), zero but for
    its first 1000 columns; ``b`` float32 [5]."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.zeros(3, 524288)
        w[:, :1000] = torch.arange(3000, dtype=torch.float32).reshape(3, 1000) / 7
        self.w = torch.nn.Parameter(w)
        self.b = torch.nn.Parameter(torch.arange(5, dtype=torch.float32))


import tarfile  # noqa: E402
from pathlib import Path  # noqa: E402

import msgspec  # noqa: E402
import pytest  # noqa: E402

import shardstore as ss  # noqa: E402
from shardstore.format.grid import grid, on_bands, put_payloads  # noqa: E402
from shardstore.format.manifest import is_chunked, tensor_payloads  # noqa: E402

ADAM = "aa1b164db53e041efa7c76fd29d2b02b0b8ce2d496a605b7633cb0e436d5c60f"  # version 2
SGD = "77e43752beb1b8c06a0c23912104b280b0c62d8dc22c636e99c0712b84268bcb"  # version 3
ROOTS = {ADAM: "9871ab3672bd88f55a511f7f6d2cdf9779bf30a776b7152b90e466b44db5c7e3", SGD: "3cafb4dc68cfc8afe24a5f43415a73469a110212c79740f91846f7096e630c2c"}


def _fresh(lc) -> str:
    """The latest legacy commit's state saved now (version 4, tiles), into a store of its own."""
    store = ss.open_store(f"memory://fresh-{id(lc)}")
    model = LegacyModel()
    return ss.save(store, model, step=0, rng=False)


def _expected():
    """The state ``make_v3_store.py`` saved, recomputed (CPU AdamW and SGD steps are deterministic)."""
    model = LegacyModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.w.grad, model.b.grad = model.w.detach() / 4, torch.ones(5)
    opt.step()
    after_adam = ({k: v.detach().clone() for k, v in model.state_dict().items()}, {k: v.clone() for k, v in opt.state[model.w].items()})
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.w.grad, model.b.grad = model.w.detach() / 8, torch.ones(5)
    sgd.step()
    return after_adam, ({k: v.detach().clone() for k, v in model.state_dict().items()}, sgd.state[model.w]["momentum_buffer"].clone())


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    root = tmp_path_factory.mktemp("legacy") / "store"
    with tarfile.open(Path(__file__).parent / "data" / "v3_store.tar.gz") as tar:
        tar.extractall(root, filter="data")
    return ss.open_store(str(root), create=False), root


def test_a_version_2_and_3_store_reads_and_verifies_as_written(legacy):
    store, _ = legacy
    assert ss.verify(store).ok  # every object re-hashed, the row-band grid checked, the roots recomputed
    (adam_state, adam_moments), (sgd_state, momentum) = _expected()
    for cid, version in ((ADAM, 2), (SGD, 3)):
        lc = ss.load_commit(store, cid)
        assert lc.commit.version == version and lc.commit.learned_root == ROOTS[cid]
        w = lc.entries()["w"]
        assert [(tuple(b.start), tuple(b.shape)) for b in w.param] == grid("float32", (3, 524288), bands=True) == [
            ((0, 0), (2, 524288)), ((2, 0), (1, 524288))]  # fmt: skip
    model = LegacyModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ss.restore(store, ADAM, model, opt)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in adam_state.items())
    assert torch.equal(opt.state[model.w]["exp_avg"], adam_moments["exp_avg"])
    assert torch.equal(opt.state[model.w]["exp_avg_sq"], adam_moments["exp_avg_sq"])
    model = LegacyModel()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ss.restore(store, SGD, model, sgd)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sgd_state.items())
    assert torch.equal(sgd.state[model.w]["momentum_buffer"], momentum)
    # the same state saved now is version 4 on the tile grid: other ids, the same values back
    fresh = ss.open_store(f"memory://legacy-{id(store)}")
    cid = ss.save(fresh, model, sgd, step=2, job="legacy", rng=False)
    lc = ss.load_commit(fresh, cid)
    assert lc.commit.version == 4 and lc.commit.learned_root != ROOTS[SGD]
    assert [(tuple(b.start), tuple(b.shape)) for b in lc.entries()["w"].param] == [((0, 0), (3, 262144)), ((0, 262144), (3, 262144))]
    back = LegacyModel()
    ss.restore(fresh, cid, back)
    assert torch.equal(back.w, model.w)


def test_tools_work_on_a_version_2_and_3_store(legacy, tmp_path):
    from safetensors.torch import load_file

    from shardstore.checkpoint.slots import write_shard_entries
    from shardstore.ops.diff import diff
    from shardstore.ops.interchange import export_commit

    store, _ = legacy
    (_, _), (sgd_state, momentum) = _expected()
    d = diff(store, ADAM, SGD)
    assert [t.name for t in d.tensors] == ["b", "w"]
    export_commit(store, SGD, str(tmp_path / "out"), with_optimizer=False)
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], sgd_state["w"])
    dst = ss.open_store(str(tmp_path / "copy"))
    ss.copy_commit(store, dst, SGD, ref="main")
    assert ss.verify(dst).ok
    part = ss.open_store(str(tmp_path / "slot0"))
    ss.copy_commit(store, part, SGD, slot=0)
    assert ss.verify(part, [SGD], slot=0).ok
    # a metadata-only transition of a version 2 commit keeps its grid and version, and verifies
    lc = ss.load_commit(store, ADAM)
    info = ss.CommitInfo(step=lc.commit.step, job=lc.commit.job, transition="repartition")
    spec = lc.shards[0]
    sids = [write_shard_entries(store, [e], groups=list(spec.groups), algorithm=spec.algorithm, rng={}, info=info, parent=ADAM,
                                slot=i, slots=2) for i, e in enumerate(sorted(lc.entries().values(), key=lambda e: e.name))]  # fmt: skip
    new = ss.write_commit(store, sids, info=info, parent=ADAM)
    assert store.commit(new).learned_root == ROOTS[ADAM] and store.commit(new).version == 2
    assert ss.verify(store, [new]).ok
    # a tensor joining them (shardtrain's grow adds zero layers so) is written on their grid
    entries = list(lc.entries().values())
    assert on_bands(entries) and not on_bands(ss.load_commit(ss.open_store(f"memory://fresh-{id(lc)}"), _fresh(lc)).entries().values())
    (z,) = put_payloads(store, [torch.zeros(3, 524288)], bands=on_bands(entries))
    grown = [*entries, msgspec.structs.replace(lc.entries()["w"], name="z", param=z, optim=None)]
    spec_groups = list(spec.groups)
    sid = write_shard_entries(store, grown, groups=spec_groups, algorithm=spec.algorithm, rng={}, info=info, parent=ADAM, slot=0, slots=1)
    assert store.shard(sid).version == 2 and ss.verify(store, [ss.write_commit(store, [sid], info=info, parent=ADAM)]).ok
    sids.append(sid)
    from shardstore.ops.gc import gc

    deleted = set(gc(store, grace_seconds=0, dry_run=True).deleted)
    assert {new, *sids} <= deleted and not deleted & {b.object for e in entries for _, p, d in tensor_payloads(e) if is_chunked(p) for b in p}


def test_a_payload_valid_on_both_grids_keeps_its_commits_version_in_a_transition():
    """float32 [2^21]: two blocks of 2^20 elements on both grids. A version 2 commit of it, taken
    into a transition, stays version 2 with the same learned-state root when the transition says
    its parent's grid (``bands=banded(version)``, what shardtrain's regroup passes); judged from
    the payloads alone it would become version 4, another root."""
    from shardstore.checkpoint.slots import write_shard_entries
    from shardstore.format.manifest import banded

    store = ss.open_store(f"memory://both-{id(object())}")
    cid = ss.save(store, {"v": torch.arange(1 << 21, dtype=torch.float32)}, step=0, rng=False)
    (e,) = ss.load_commit(store, cid).entries().values()
    assert [(b.start, b.shape) for b in e.param] == [((0,), (1 << 20,)), ((1 << 20,), (1 << 20,))] == [
        (b[0], b[1]) for b in grid("float32", (1 << 21,), bands=True)]  # fmt: skip
    info = ss.CommitInfo(step=0, job="default", transition="repartition")
    v2 = ss.write_commit(store, [write_shard_entries(store, [e], groups=[], algorithm="none", rng={}, info=info, parent=cid,
                                                     slot=0, slots=1, bands=True)], info=info, parent=cid)  # fmt: skip
    parent = store.commit(v2)
    assert parent.version == 2 and ss.verify(store, [v2]).ok
    kept = write_shard_entries(store, [e], groups=[], algorithm="none", rng={}, info=info, parent=v2, slot=0, slots=1,
                               bands=banded(parent.version))  # fmt: skip
    child = store.commit(ss.write_commit(store, [kept], info=info, parent=v2))
    assert child.version == 2 and child.learned_root == parent.learned_root
    judged = write_shard_entries(store, [e], groups=[], algorithm="none", rng={}, info=info, parent=v2, slot=0, slots=1)
    assert store.shard(judged).version == 4 and store.commit(ss.write_commit(store, [judged], info=info, parent=v2)).learned_root != parent.learned_root
