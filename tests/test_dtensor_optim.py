"""Any torch optimizer's DTensor state over real Gloo groups: SGD with momentum and Adagrad
under FSDP2, saved without gathering and restored into any split (SPEC.md §9.1, §5.1, §15.2).

One group of 3 processes serves every check:

- ranks 0 and 1 (a group of their own): FSDP2 trains 2 steps with SGD(momentum) and with
  Adagrad, saves each (``sgd2``, ``ada2``; SGD again through ``AsyncSaver`` while training goes
  on), checks the commit against a plain model restored from it, and (SGD) resumes from it
  bitwise, restores it into tensor parallelism on dim 1 and saves that;
- rank 2: restores each commit into a plain model and saves it whole (``sgd1``, ``ada1``);
- all 3 ranks: FSDP2 (2048 rows over 3: 683, 683, 682) restores the 2-rank and the 1-process
  commits, compares them with the plain model, saves again (``sgd3``), and takes one more
  optimizer step on the restored DTensor state.

``fc1.weight`` is 2048 x 2048 float32 (16 MiB), so its momentum buffer and Adagrad's ``sum``
are chunked (2 x 2 tiles of 1024 x 1024, SPEC.md §5.1) and the 3-rank split cuts tiles. The SGD commit is also
copied with ``copy_commit(slot=1)`` (``copy --shard 1``) and restored from that partial copy.
"""

from __future__ import annotations

import json

import dtensor_models
import pytest
import torch
import torch.distributed as dist
from dtensor_models import WIDE, fsdp
from dtensor_models import train as _train
from gloo_group import run_group

import shardstore as ss

ROWS = COLS = 2048  # fc1.weight: 2 x 2 tiles of 1024 x 1024 (4 MiB each), in C order 0 (top left) to 3


def _net() -> torch.nn.Module:
    """fc1.weight 2048 x 2048 (2 x 2 tiles) and a persistent buffer larger than one block."""
    return dtensor_models.Net(rows=ROWS, table=True, wide=COLS)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "ada": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
}


def _fsdp(mesh) -> torch.nn.Module:
    return fsdp(mesh, _net())


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _equal_to_plain(model, opt, plain, popt) -> bool:
    """Every parameter and every state value (tensors gathered) bitwise equal to a plain model's;
    the state tensors of the sharded model are DTensors split like their parameter."""
    ok = True
    for p, q in zip(model.parameters(), plain.parameters()):
        ok &= torch.equal(_full(p), q)
        a, b = opt.state[p], popt.state[q]
        ok &= sorted(a) == sorted(b) and len(a) > 0
        for k in a:
            if a[k].dim() > 0:
                ok &= type(a[k]) is type(p) and torch.equal(_full(a[k]), b[k])
            else:
                ok &= torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
    return bool(ok)


def _info(step: int) -> ss.CommitInfo:
    return ss.CommitInfo(step=step, job="dtensor-optim")


def _two(store: ss.Store, mesh, group, async_group) -> dict:
    out: dict = {}
    for key, make in OPTIMIZERS.items():
        m = _fsdp(mesh)
        opt = make(m.parameters())
        _train(m, opt, 2, seed=1)
        cid = ss.save_distributed(store, m, opt, info=_info(2), rng=False, ref=key, group=group)
        plain = _net()
        popt = make(plain.parameters())
        ss.restore(store, cid, plain, popt)
        out[f"{key}_saved_equals_plain"] = _equal_to_plain(m, opt, plain, popt)
        if key == "sgd":
            out["partial"] = _partial_copy(store, cid, mesh, group)
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            tp = parallelize_module(
                _net(), mesh, {"fc1": RowwiseParallel(), "fc2": ColwiseParallel()}
            )  # fc1.weight Shard(1)
            topt = make(tp.parameters())
            ss.restore(store, cid, tp, topt)
            out["tp1_placements"] = str(tp.fc1.weight.placements)
            out["tp1_equals_plain"] = _equal_to_plain(tp, topt, plain, popt)
            out["sgd_tp1"] = ss.save_distributed(
                store, tp, topt, info=_info(2), rng=False, ref=None, parent=None, group=group
            )
            saver = ss.AsyncSaver(store)
            saver.save_distributed(m, opt, info=_info(2), group=async_group, rng=False, ref=None, parent=None)
            _train(m, opt, 1, seed=5)  # training goes on while the background save runs
            out["async"] = saver.close()
            resumed = _fsdp(mesh)  # 2 -> 2: restored, it trains the same step to the same bits
            ropt = make(resumed.parameters())
            ss.restore(store, cid, resumed, ropt)
            _train(resumed, ropt, 1, seed=5)
            out["resumed_bitwise"] = all(
                torch.equal(p.to_local(), q.to_local())
                and torch.equal(ropt.state[p]["momentum_buffer"].to_local(), opt.state[q]["momentum_buffer"].to_local())
                for p, q in zip(resumed.parameters(), m.parameters())
            )
        out[key] = cid
    try:  # a DTensor inside an extra's state: this rank's slice is not the extra's tensor
        ss.save_distributed(
            store, m, opt, info=_info(2), rng=False, ref=None, group=group, extra={"h": Holder(m.fc1.weight)}
        )
    except ss.CommitProtocolError as e:
        out["dtensor_extra"] = str(e)
    return out


def _partial_copy(store: ss.Store, cid: str, mesh, group) -> dict:
    """``copy --shard 1`` of the 2-rank SGD commit into an empty store; both ranks restore from it."""
    out: dict = {}
    url = store.url + "-slot1"
    if dist.get_rank(group) == 0:
        r = ss.copy_commit(store, ss.open_store(url), cid, slot=1, ref="sgd")
        out["copied"] = (r.objects_copied, r.bytes_copied)
    dist.barrier(group=group)
    partial = ss.open_store(url, create=False)
    full = _fsdp(mesh)
    fopt = OPTIMIZERS["sgd"](full.parameters())
    ss.restore(store, cid, full, fopt)
    mine = _fsdp(mesh)
    mopt = OPTIMIZERS["sgd"](mine.parameters())
    try:
        ss.restore(partial, cid, mine, mopt)
        out["restored"] = all(
            torch.equal(p.to_local(), q.to_local())
            and torch.equal(mopt.state[p]["momentum_buffer"].to_local(), fopt.state[q]["momentum_buffer"].to_local())
            for p, q in zip(mine.parameters(), full.parameters())
        ) and torch.equal(mine.table, full.table)
    except ss.ObjectNotFound as e:
        out["refused"] = str(e)
    dist.barrier(group=group)
    return out


class Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict:
        return {"t": self.t}


def _three(rank: int, store: ss.Store, mesh) -> dict:
    out: dict = {}
    for key, make in OPTIMIZERS.items():
        plain = _net()
        popt = make(plain.parameters())
        ss.restore(store, key, plain, popt)
        for src in (key, f"{key}1"):  # the 2-rank commit, then the one a single process wrote
            m3 = _fsdp(mesh)
            opt3 = make(m3.parameters())
            ss.restore(store, src, m3, opt3)
            out[f"{src}_into_fsdp3_equals_plain"] = _equal_to_plain(m3, opt3, plain, popt)
        out[f"{key}3"] = ss.save_distributed(store, m3, opt3, info=_info(2), rng=False, ref=None, parent=None)
        out[f"{key}_local_rows"] = (
            opt3.state[m3.fc1.weight][next(k for k in opt3.state[m3.fc1.weight] if k != "step")].to_local().shape[0]
        )
        _train(m3, opt3, 1, seed=9)  # the restored DTensor state steps like the plain model's
        _train(plain, popt, 1, seed=9)
        out[f"{key}_step_after_restore_close"] = all(
            torch.allclose(_full(p), q, rtol=1e-5, atol=1e-7) for p, q in zip(m3.parameters(), plain.parameters())
        )
    return out


def _body(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    store = ss.open_store(root)
    pair = dist.new_group([0, 1])
    async_pair = dist.new_group([0, 1])
    result: dict = {}
    if rank < 2:
        result["two"] = _two(store, DeviceMesh.from_group(pair, "cpu"), pair, async_pair)
    dist.barrier()
    if rank == 2:  # the same states saved whole by one process
        for key, make in OPTIMIZERS.items():
            plain = _net()
            popt = make(plain.parameters())
            ss.restore(store, key, plain, popt)
            result[f"{key}1"] = ss.save(
                store, plain, popt, step=2, job="dtensor-optim", rng=False, ref=f"{key}1", parent=None
            )
    dist.barrier()
    result["three"] = _three(rank, store, init_device_mesh("cpu", (world,)))
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dtensor-optim")
    root = str(tmp / "store")
    store = ss.open_store(root)
    results = run_group(_body, 3, tmp, root)
    return store, [r["two"] for r in results[:2]], [r["three"] for r in results], results[2]


def _objects(store: ss.Store, cid: str) -> set[str]:
    from shardstore.format.grid import payload_blocks
    from shardstore.format.manifest import tensor_payloads
    from shardstore.state.torch_optim import state_objects

    lc = ss.load_commit(store, cid)
    es = lc.entries().values()
    return {o for e in es for _, p, d in tensor_payloads(e) for o, _, _ in payload_blocks(p, d, e.shape)} | {
        o for e in es for o, _, _ in state_objects(e)
    }


def test_fsdp2_sgd_and_adagrad_state_saved_and_restored_bitwise_in_every_direction(runs):
    store, two, three, single = runs
    assert two[0]["sgd"] == two[1]["sgd"] and two[0]["async"] == two[0]["sgd"]  # AsyncSaver: the same commit
    assert all(r["resumed_bitwise"] for r in two)  # FSDP2 x2 -> x2 continues bitwise
    assert two[0]["tp1_placements"] == "(Shard(dim=1),)" and all(
        r["tp1_equals_plain"] for r in two
    )  # FSDP2 -> TP dim 1
    assert all(r[f"{k}_saved_equals_plain"] for r in two for k in OPTIMIZERS)  # FSDP2 x2 -> 1 process
    for r in three:
        for key in OPTIMIZERS:
            assert r[f"{key}_into_fsdp3_equals_plain"], key  # FSDP2 x2 -> FSDP2 x3
            assert r[f"{key}1_into_fsdp3_equals_plain"], key  # 1 process -> FSDP2 x3
            assert r[f"{key}_step_after_restore_close"], key
    assert [r["sgd_local_rows"] for r in three] == [683, 683, 682]
    for key, state_key in (("sgd", "momentum_buffer"), ("ada", "sum")):
        lc = ss.load_commit(store, two[0][key])
        st = {t.key: t for t in lc.entries()["fc1.weight"].state.tensors}
        assert lc.commit.version == 4 and len(st[state_key].object) == 4  # 16 MiB: chunked, four tiles
        if key == "ada":
            assert [s.key for s in lc.entries()["fc1.weight"].state.scalars] == ["step"]  # a 0-d tensor, as it was
    assert ss.verify(store).ok


def test_one_learned_state_root_and_one_set_of_objects_whoever_saved_it(runs):
    store, two, three, single = runs
    for key in OPTIMIZERS:
        commits = {"FSDP2 x2": two[0][key], "1 process": single[f"{key}1"], "FSDP2 x3": three[0][f"{key}3"]}
        if key == "sgd":
            commits["TP dim 1"] = two[0]["sgd_tp1"]
        assert len({three[r][f"{key}3"] for r in range(3)}) == 1
        roots = {k: store.commit(c).learned_root for k, c in commits.items()}
        assert len(set(roots.values())) == 1, roots
        objects = {k: _objects(store, c) for k, c in commits.items()}
        assert all(o == objects["1 process"] for o in objects.values())
        # fc1.weight 4 tiles + 3 small, for the param and its one state tensor; the 5 MiB buffer's 2 tiles
        assert len(objects["1 process"]) == 2 * (4 + 3) + 2
        assert ss.load_commit(store, commits["FSDP2 x2"]).entries()["table"].kind == "buffer"


def test_a_dtensor_inside_an_extra_is_refused_naming_it(runs):
    _, two, _, _ = runs
    for r in two:
        assert "extra 'h' at $.t" in r["dtensor_extra"] and "DTensor" in r["dtensor_extra"]


def _slot1_objects() -> tuple[int, int]:
    """What slot 1 of the 2-rank SGD commit needs, worked out by hand (SPEC.md §Slices held): FSDP2
    gives rank 1 rows 1024-2047 of fc1.weight: its tiles 2 and 3 (1024 x 1024 each), not 0 and 1."""
    mine = 2  # tiles 2 and 3
    small = [ROWS * 4, 4 * ROWS * 4, 4 * 4]  # fc1.bias, fc2.weight, fc2.bias: one object each
    param = mine + len(small), mine * 1024 * 1024 * 4 + sum(small)
    table = 2, 10 * WIDE * 4  # the buffer every rank holds whole: both its column tiles
    return 2 * param[0] + table[0], 2 * param[1] + table[1]  # the parameter and its momentum


def test_copy_shard_k_copies_only_the_blocks_slot_k_held_and_restores_only_its_slice(runs):
    from shardstore.ops.gc import gc

    store, two, _, _ = runs
    n, nbytes = _slot1_objects()
    copied, copied_bytes = two[0]["partial"]["copied"]
    print(
        f"copy --shard 1: {copied} objects, {copied_bytes} bytes (slot 1's data by hand: {n} objects, {nbytes} bytes)"
    )
    assert n == 12 and copied == n + 2 + 1  # data objects, 2 shard manifests, the commit
    assert copied_bytes - nbytes < 64 * 1024  # the rest is the three manifests
    assert two[1]["partial"]["restored"]  # rank 1's slice, bitwise from the partial copy
    refused = two[0]["partial"]["refused"]  # rank 0 needs tiles 0 and 1, which only rank 0 held
    print("restore of slot 0 from the slot-1 copy:", refused)
    assert (
        "'fc1.weight'" in refused and ("block 0" in refused or "block 1" in refused) and "not in the store" in refused
    )
    partial = ss.open_store(store.url + "-slot1", create=False)
    cid = two[0]["sgd"]
    assert ss.verify(partial, [cid], slot=1).ok  # what slot 1 needs is all there
    report = ss.verify(partial, [cid])  # the whole commit is not: exactly slot 0's own blocks are missing
    lc = ss.load_commit(partial, cid)
    w = lc.entries()["fc1.weight"]
    absent = {
        w.param[0].object,
        w.param[1].object,
        w.state.tensors[0].object[0].object,
        w.state.tensors[0].object[1].object,
    }
    assert {(p.kind, p.tensor) for p in report.problems} == {("ObjectNotFound", "fc1.weight")}
    assert {p.object for p in report.problems} == absent
    assert gc(partial, grace_seconds=0, dry_run=True).deleted == {}  # nothing there is garbage


def test_cli_copy_and_verify_shard_k_select_the_same_blocks(runs, tmp_path, capsys):
    from shardstore_cli.shardstore_cli import main

    store, two, _, _ = runs
    cid, dst = two[0]["sgd"], str(tmp_path / "cli-slot1")
    assert main(["copy", store.url, dst, cid, "--shard", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["objects_copied"] == two[0]["partial"]["copied"][0]
    assert set(ss.open_store(dst, create=False).objects()) == set(
        ss.open_store(store.url + "-slot1", create=False).objects()
    )
    assert main(["verify", dst, cid, "--shard", "1"]) == 0
    assert main(["verify", dst, cid]) == 3  # slot 0's own blocks are absent, and said so
    cap = capsys.readouterr()
    assert "ObjectNotFound" in cap.out + cap.err and "fc1.weight" in cap.out + cap.err
