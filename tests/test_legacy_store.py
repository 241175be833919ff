"""A store written before format version 4 (row-band grid, versions 2 and 3) still reads,
verifies, restores, copies, diffs and exports (SPEC.md §Versioning).

``tests/data/v3_store.tar.gz`` was written by shardstore at commit 3066e75, before the tile
grid (``tests/data/make_v3_store.py`` says how): it is the old writer's own bytes, not a
re-creation by the new code.

A format-1 store (before chunked payloads: every tensor one object, whatever its size) is
built here instead, from the tensors' bytes and version-1 manifests written by the format
layer's encoder (``_format1_store``): format 1's manifests are this version's fields at
version 1, so nothing of the old writer is needed but what it put in a payload.
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
ROOTS = {
    ADAM: "9871ab3672bd88f55a511f7f6d2cdf9779bf30a776b7152b90e466b44db5c7e3",
    SGD: "3cafb4dc68cfc8afe24a5f43415a73469a110212c79740f91846f7096e630c2c",
}


def _fresh(lc) -> str:
    """The latest legacy commit's state saved now (version 4, tiles), into a store of its own."""
    store = ss.open_store(f"memory://fresh-{id(lc)}")
    model = LegacyModel()
    return ss.save(store, model, step=0, rng=False)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """``got`` (read from the store) within 4 float32 ulps of ``want`` (``_expected``'s recomputation).

    Not bitwise: the AdamW and SGD updates are recomputed here with this process's CPU kernels,
    which may round a fused update's last bit otherwise than the machine that wrote the store
    (measured: under ATEN_CPU_CAPABILITY=default). That the bytes read are the bytes written is
    what ``verify`` (every object re-hashed) and the pinned learned-state roots establish."""
    return got.dtype == want.dtype and got.shape == want.shape and torch.allclose(got, want, rtol=2**-22, atol=0.0)


def _expected():
    """The state ``make_v3_store.py`` saved, recomputed (to the last bits of this CPU's kernels: ``_close``)."""
    model = LegacyModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.w.grad, model.b.grad = model.w.detach() / 4, torch.ones(5)
    opt.step()
    after_adam = (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        {k: v.clone() for k, v in opt.state[model.w].items()},
    )
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.w.grad, model.b.grad = model.w.detach() / 8, torch.ones(5)
    sgd.step()
    return after_adam, (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        sgd.state[model.w]["momentum_buffer"].clone(),
    )


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
    assert all(_close(model.state_dict()[k], v) for k, v in adam_state.items())
    assert _close(opt.state[model.w]["exp_avg"], adam_moments["exp_avg"])
    assert _close(opt.state[model.w]["exp_avg_sq"], adam_moments["exp_avg_sq"])
    model = LegacyModel()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ss.restore(store, SGD, model, sgd)
    assert all(_close(model.state_dict()[k], v) for k, v in sgd_state.items())
    assert _close(sgd.state[model.w]["momentum_buffer"], momentum)
    # the same state saved now is version 4 on the tile grid: other ids, the same values back
    fresh = ss.open_store(f"memory://legacy-{id(store)}")
    cid = ss.save(fresh, model, sgd, step=2, job="legacy", rng=False)
    lc = ss.load_commit(fresh, cid)
    assert lc.commit.version == 4 and lc.commit.learned_root != ROOTS[SGD]
    assert [(tuple(b.start), tuple(b.shape)) for b in lc.entries()["w"].param] == [
        ((0, 0), (3, 262144)),
        ((0, 262144), (3, 262144)),
    ]
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
    export_commit(store, SGD, str(tmp_path / "out"), with_optimizer=False, weights_only=True)
    assert _close(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], sgd_state["w"])
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
    assert on_bands(entries) and not on_bands(
        ss.load_commit(ss.open_store(f"memory://fresh-{id(lc)}"), _fresh(lc)).entries().values()
    )
    (z,) = put_payloads(store, [torch.zeros(3, 524288)], bands=on_bands(entries))
    grown = [*entries, msgspec.structs.replace(lc.entries()["w"], name="z", param=z, optim=None)]
    spec_groups = list(spec.groups)
    sid = write_shard_entries(
        store, grown, groups=spec_groups, algorithm=spec.algorithm, rng={}, info=info, parent=ADAM, slot=0, slots=1
    )
    assert (
        store.shard(sid).version == 2 and ss.verify(store, [ss.write_commit(store, [sid], info=info, parent=ADAM)]).ok
    )
    sids.append(sid)
    from shardstore.ops.gc import gc

    deleted = set(gc(store, grace_seconds=0, dry_run=True).deleted)
    assert {new, *sids} <= deleted and not deleted & {
        b.object for e in entries for _, p, d in tensor_payloads(e) if is_chunked(p) for b in p
    }


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
    assert (
        store.shard(judged).version == 4
        and store.commit(ss.write_commit(store, [judged], info=info, parent=v2)).learned_root != parent.learned_root
    )


# -- format 1: every tensor one object, whatever its size ----------------------------------------


class Format1Model(torch.nn.Module):
    """``w`` float32 [1280, 1024] (5 MiB, over the 4 MiB block bound), ``b`` float32 [4], and a
    persistent uint8 buffer ``counts`` of 4 MiB + 1 bytes: each over the bound is one object in
    format 1, and so are ``w``'s AdamW moments. (Format 1's own writer had no buffers: entries
    with ``kind`` came later within version 1, from writers that chunk. ``counts`` stands for
    the rule, every payload of a version-1 manifest one object of any size; ``w`` and ``b`` are
    entries exactly as that writer wrote them.)"""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(26)
        self.w = torch.nn.Parameter(torch.randn(1280, 1024, generator=g))
        self.b = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
        self.register_buffer("counts", (torch.arange((1 << 22) + 1) % 251).to(torch.uint8))


def _format1_state() -> tuple[Format1Model, torch.optim.AdamW]:
    model = Format1Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.w.grad, model.b.grad = model.w.detach() / 4, torch.ones(4)
    opt.step()
    return model, opt


def _format1_store(path: str) -> tuple[ss.Store, str]:
    """A store as format 1's writer left it (before chunked payloads, commit 583f349): the state
    of ``_format1_state`` with every tensor, moment and buffer one object of its whole bytes, and
    version-1 manifests. Its fields are what this writer gives the state (a save into a scratch
    store, whose chunked payloads are then replaced by whole objects and its versions by 1);
    the objects are written here from the tensors' bytes, the manifests by the format layer's
    encoder (``put_manifest``), so no chunked writer touches the store."""
    from shardstore.format.manifest import FORMAT_VERSION, shard_version
    from shardstore.format.roots import learned_root
    from shardstore.format.tensors import tensor_bytes

    model, opt = _format1_state()
    scratch = ss.open_store(f"memory://format1-{id(model)}")
    lc = ss.load_commit(scratch, ss.save(scratch, model, opt, step=1, job="format-1", rng=False))
    store = ss.open_store(path)
    ids = {n: store.put(tensor_bytes(t)) for n, t in model.state_dict().items()}
    moments = {k: store.put(tensor_bytes(opt.state[model.w][k])) for k in ("exp_avg", "exp_avg_sq")}
    (shard,) = lc.shards.values()
    entries = []
    for e in shard.entries:
        optim = e.optim
        if e.name == "w":
            optim = msgspec.structs.replace(e.optim, **moments)
        elif optim is not None:
            optim = msgspec.structs.replace(e.optim, exp_avg=store.put(tensor_bytes(opt.state[model.b]["exp_avg"])),
                                            exp_avg_sq=store.put(tensor_bytes(opt.state[model.b]["exp_avg_sq"])))  # fmt: skip
        entries.append(msgspec.structs.replace(e, param=ids[e.name], optim=optim))
    assert shard_version(entries) == FORMAT_VERSION and not any(
        is_chunked(p) for e in entries for _, p, _ in tensor_payloads(e)
    )
    sid = store.put_manifest(msgspec.structs.replace(shard, version=FORMAT_VERSION, entries=tuple(entries)))
    c = lc.commit
    root = learned_root(step=c.step, data_cursor=c.data_cursor, config=c.config, optimizer=c.optimizer, entries=entries)
    cid = store.put_manifest(msgspec.structs.replace(c, version=FORMAT_VERSION, layout=(msgspec.structs.replace(c.layout[0], shard=sid),),
                                                     learned_root=root))  # fmt: skip
    store.set_ref("main", cid, expected=None)
    return store, cid


def _format1_reads(rank: int, world: int, root: str, cid: str) -> dict:
    """On each rank of a Gloo group: ``w`` restored into DTensors split by rows and by columns
    (each rank reads the whole 5 MiB object, verified, and keeps its part)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = ss.open_store(root, create=False)
    mesh = init_device_mesh("cpu", (world,))
    w = ss.load_commit(store, cid).entries()["w"]
    want = store.get_tensor(
        w.param, w.dtype, w.shape, what="w"
    )  # the object itself (the main process compared it with the state)
    out = {}
    for dim in (0, 1):
        dest = {"w": distribute_tensor(torch.zeros(1280, 1024), mesh, (Shard(dim),), src_data_rank=None)}
        r = ss.restore(store, cid, dest)
        local = dest["w"].to_local()
        part = want.chunk(world, dim)[rank]
        out[f"shard{dim}"] = local.shape[dim] == (1280, 1024)[dim] // world and bool(torch.equal(local, part))
        out[f"read{dim}"] = r.bytes_read
    return out


def test_a_format_1_store_with_tensors_over_the_block_bound_reads_and_verifies(tmp_path):
    """Format 1 stored a parameter, buffer or moment of any size as one object; since format 2
    (commit 583f349) such a version-1 manifest was refused with GridError ("must be 2 blocks, not
    one object"), so these stores no longer read. They read again (SPEC.md §5.1, §22): load,
    verify, restore (plain and into DTensors on 2 ranks), diff, copy."""
    from gloo_group import run_group

    from shardstore.ops.diff import diff

    store, cid = _format1_store(str(tmp_path / "f1"))
    lc = ss.load_commit(store, cid)  # GridError before issue 26
    assert lc.commit.version == 1 and all(s.version == 1 for s in lc.shards.values())
    assert isinstance(lc.entries()["w"].param, str) and isinstance(lc.entries()["counts"].param, str)
    report = ss.verify(store)
    assert report.ok, [str(p) for p in report.problems]
    want, wopt = _format1_state()
    model = Format1Model()
    with torch.no_grad():
        for t in (model.w, model.b, model.counts):
            t.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ss.restore(store, cid, model, opt)
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in model.state_dict().items())
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state[model.w][k], wopt.state[want.w][k])
    # the same state saved now: tiles (another commit, another root), equal values
    fresh = ss.save(store, want, wopt, step=1, job="format-1", rng=False, ref=None)
    assert store.commit(fresh).version == 4 and store.commit(fresh).learned_root != lc.commit.learned_root
    d = diff(store, cid, fresh, stats=True)
    assert sorted(t.name for t in d.tensors) == ["counts", "w"]  # chunked now: other ids
    assert all(s.max_abs_diff == 0.0 for t in d.tensors for s in t.stats.values()) and {
        k for t in d.tensors for k in t.stats
    }
    dst = ss.open_store(str(tmp_path / "copy"))
    ss.copy_commit(store, dst, cid, ref="main")
    assert ss.verify(dst).ok and dst.commit(cid).version == 1
    # a metadata-only transition naming its objects again stays version 1, with its root
    from shardstore.checkpoint.slots import write_shard_entries

    info = ss.CommitInfo(step=1, job="format-1", transition="repartition")
    (spec,) = lc.shards.values()
    sid = write_shard_entries(store, list(spec.entries), groups=list(spec.groups), algorithm=spec.algorithm, rng={}, info=info, parent=cid,
                              slot=0, slots=1)  # fmt: skip
    moved = ss.write_commit(store, [sid], info=info, parent=cid)
    assert (
        store.commit(moved).version == 1
        and store.commit(moved).learned_root == lc.commit.learned_root
        and ss.verify(store, [moved]).ok
    )
    reads = run_group(_format1_reads, 2, tmp_path, str(tmp_path / "f1"), cid)
    assert all(r["shard0"] and r["shard1"] for r in reads), reads
    assert all(r["read0"] == r["read1"] == 1280 * 1024 * 4 for r in reads), reads  # the whole object, once per restore
