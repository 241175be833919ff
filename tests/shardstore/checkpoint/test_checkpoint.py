"""save / restore: bitwise continuation, any layout, RNG, dtypes, ownership, rejections."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import TinyNet, make_optimizer, train_steps

import shardstore as ss


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(a: torch.nn.Module, b: torch.nn.Module, oa=None, ob=None) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
        if oa is not None:
            sa, sb = oa.state.get(p, {}), ob.state.get(q, {})
            assert sa.keys() == sb.keys(), n
            for k in sa:
                assert torch.equal(sa[k], sb[k]), (n, k)


def test_round_trip_continues_bitwise(store, trained):
    model, opt = trained
    cid = ss.save(store, model, opt, step=3, config={"width": 8, "eps": 1e-5})
    assert store.ref("main") == cid
    fresh = TinyNet(seed=99)
    fresh_opt = make_optimizer(fresh, lr=0.5)
    info = ss.restore(store, "main", fresh, fresh_opt)
    assert info.commit == cid and info.step == 3 and info.config == {"width": 8, "eps": 1e-5}
    _assert_same(model, fresh, opt, fresh_opt)
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    train_steps(model, opt, 4, seed=7)
    train_steps(fresh, fresh_opt, 4, seed=7)
    _assert_same(model, fresh, opt, fresh_opt)


def test_two_slots_restore_into_three_slots_worth_of_processes(store, trained):
    model, opt = trained
    names = [n for n, _ in model.named_parameters()]
    states = [ss.capture(model, opt, names=names[:3]), ss.capture(model, opt, names=names[3:])]
    cid = ss.save_slots(store, states, info=ss.CommitInfo(step=3))
    lc = ss.load_commit(store, cid)
    assert len(lc.commit.layout) == 2
    # Three "processes", each owning a contiguous third; the rest lives on the meta device.
    thirds = [names[:2], names[2:5], names[5:]]
    rebuilt = {}
    for owned in thirds:
        part = TinyNet(seed=5)
        for n, p in list(part.named_parameters()):
            if n not in owned:
                mod_name, _, attr = n.rpartition(".")
                setattr(part.get_submodule(mod_name), attr, torch.nn.Parameter(torch.empty(p.shape, device="meta")))
        part_opt = make_owned_optimizer(part)  # same named groups as the writer's, owned params only
        res = ss.restore(store, cid, part, part_opt)
        assert sorted(res.tensors) == sorted(owned)
        for n, p in part.named_parameters():
            if n in owned:
                rebuilt[n] = (p, part_opt.state[p])
    for n, p in model.named_parameters():
        q, st = rebuilt[n]
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], st["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], st["exp_avg_sq"])
        assert float(opt.state[p]["step"]) == float(st["step"])


def make_owned_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    owned = [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]
    groups = []
    decay = [p for n, p in owned if p.ndim == 2]
    no_decay = [p for n, p in owned if p.ndim < 2]
    if decay:
        groups.append({"params": decay, "weight_decay": 0.1, "name": "decay"})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return torch.optim.AdamW(groups, lr=1e-2)


def test_learned_root_ignores_layout_but_commit_id_does_not(store, trained):
    model, opt = trained
    names = [n for n, _ in model.named_parameters()]
    one = ss.save(store, model, opt, step=3, ref=None, rng=False)
    two = ss.save_slots(
        store,
        [ss.capture(model, opt, names=names[:4], rng=False), ss.capture(model, opt, names=names[4:], rng=False)],
        info=ss.CommitInfo(step=3),
        ref=None,
    )
    assert one != two
    assert store.commit(one).learned_root == store.commit(two).learned_root


def test_same_inputs_same_commit_id(tmp_path, trained):
    model, opt = trained
    ids = []
    for i in range(2):
        random.seed(1)
        np.random.seed(1)
        torch.manual_seed(1)
        st = ss.open_store(str(tmp_path / f"s{i}"))
        ids.append(ss.save(st, model, opt, step=3, config={"a": 1.5}))
    assert ids[0] == ids[1]


def test_rng_restored(store, trained):
    model, opt = trained
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    ss.save(store, model, opt, step=3)
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    ss.restore(store, "main", model, opt, rng=True)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect


@pytest.mark.parametrize(
    "t",
    [
        torch.tensor(3.5),
        torch.zeros(0, 4),
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        torch.randn(5, dtype=torch.float64),
        torch.randn(7).to(torch.bfloat16),
        torch.randn(7).to(torch.float16),
        torch.arange(-4, 4, dtype=torch.int8),
        torch.arange(9, dtype=torch.int64),
        torch.arange(9, dtype=torch.int32),
        torch.arange(9, dtype=torch.uint8),
        torch.tensor([True, False, True]),
    ],
    ids=lambda t: f"{t.dtype}{list(t.shape)}",
)
def test_dtypes_and_shapes_round_trip(any_store, t):
    src = {"x": t}
    cid = ss.save(any_store, src, step=0, rng=False)
    dst = {"x": torch.full_like(t.contiguous(), 0) if t.numel() else torch.empty_like(t)}
    ss.restore(any_store, cid, dst)
    assert dst["x"].dtype == t.dtype and dst["x"].shape == t.shape
    assert torch.equal(dst["x"], t)
    e = ss.load_commit(any_store, cid).entries()["x"]
    assert len(bytes(any_store.get(e.param))) == t.numel() * t.element_size()


def test_unsupported_dtype_is_rejected(store):
    with pytest.raises(ss.TensorMismatch, match="complex64"):
        ss.save(store, {"z": torch.zeros(2, dtype=torch.complex64)}, step=0)


def test_restore_rejects_shape_and_missing_names(store, trained):
    model, opt = trained
    ss.save(store, model, opt, step=3)
    with pytest.raises(ss.TensorMismatch, match="inp.weight"):
        ss.restore(store, "main", {"inp.weight": torch.zeros(3, 3)})
    with pytest.raises(ss.StateMismatch, match="nope"):
        ss.restore(store, "main", {"nope": torch.zeros(1)})
    assert ss.restore(store, "main", {"nope": torch.zeros(1)}, strict=False).tensors == []


def test_cursor_rules_on_save(store, trained):
    model, opt = trained
    with pytest.raises(ss.CursorError, match="Adam age 3"):
        ss.save(store, model, opt, step=2)
    state = ss.capture(model, opt, births={n: 1 for n, _ in model.named_parameters()})
    with pytest.raises(ss.CursorError):
        ss.save_slots(store, [state], info=ss.CommitInfo(step=3))
    assert store.ref("main") is None


def test_a_commit_of_no_slots_is_refused_before_any_write(store):
    # a layout holds at least one slot (SPEC.md §13): refused naming it, not max() of nothing
    info = ss.CommitInfo(step=1, config={"d_model": 4})
    with pytest.raises(ss.LayoutError, match="no slots"):
        ss.save_slots(store, [], info=info)
    with pytest.raises(ss.LayoutError, match="no slots"):
        ss.write_commit(store, [], info=info, parent=None)
    assert list(store.objects()) == [] and store.ref("main") is None


def test_late_parameter_keeps_its_own_clock(store):
    model = TinyNet()
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    extra = torch.nn.Parameter(torch.ones(4))
    opt.add_param_group({"params": [extra], "weight_decay": 0.0, "name": "late"})
    params = dict(model.named_parameters())
    params["extra"] = extra
    # one more step for everything: the late parameter has age 1, the others 3
    opt.zero_grad()
    (model(torch.randn(2, 4)).sum() + extra.sum()).backward()
    opt.step()
    cid = ss.save(store, params, opt, step=3)
    entries = ss.load_commit(store, cid).entries()
    assert entries["extra"].optim.age == 1 and entries["extra"].optim.birth == 2
    assert entries["inp.weight"].optim.age == 3 and entries["inp.weight"].optim.birth == 0


def test_amsgrad_goes_to_the_torch_form(store):
    """Refused before issue 13; now held as any torch optimizer (tests/shardstore/state/test_trainer_state.py restores it)."""
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), amsgrad=True)
    cid = ss.save(store, model, opt, step=0)
    spec = store.commit(cid).optimizer
    assert spec.algorithm == "torch" and spec.torch_optimizer.class_name == "torch.optim.adam.Adam"
    assert spec.torch_optimizer.groups[0].hyper["amsgrad"] is True


def test_adam_and_adamw_are_distinguished(store, trained):
    model, opt = trained
    ss.save(store, model, opt, step=3)
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(ss.StateMismatch, match="adamw"):
        ss.restore(store, "main", model, adam)


def test_parent_chain_and_cas(store, trained):
    model, opt = trained
    a = ss.save(store, model, opt, step=3)
    train_steps(model, opt, 1)
    b = ss.save(store, model, opt, step=4)
    assert store.commit(b).parent == a
    with pytest.raises(ss.RefConflict):
        store.set_ref("main", a, expected=a)  # stale expectation
    assert store.ref("main") == b


def test_unchanged_tensors_are_not_rewritten(store, trained):
    model, opt = trained
    ss.save(store, model, opt, step=3)
    before = set(store.objects())
    frozen = {n: p for n, p in model.named_parameters()}
    ss.save(store, frozen, step=3, ref="frozen", rng=False)
    after = set(store.objects())
    # a weights-only commit of the same tensors adds only its two manifests
    assert len(after - before) == 2


def test_two_slot_commit_continues_bitwise_in_a_fresh_model(store, trained):
    """Saved as 2 slots, restored whole into fresh objects: training continues identically."""
    model, opt = trained
    names = [n for n, _ in model.named_parameters()]
    ss.save_slots(
        store,
        [ss.capture(model, opt, names=names[::2]), ss.capture(model, opt, names=names[1::2])],
        info=ss.CommitInfo(step=3),
    )
    fresh = TinyNet(seed=11)
    fresh_opt = make_optimizer(fresh, lr=0.3)
    ss.restore(store, "main", fresh, fresh_opt)
    train_steps(model, opt, 5, seed=9)
    train_steps(fresh, fresh_opt, 5, seed=9)
    _assert_same(model, fresh, opt, fresh_opt)


def test_write_shard_entries_relays_existing_objects_without_reading_them(store, trained):
    """A new layout of a commit's entries (SPEC.md §15.1): same learned-state root; missing objects
    and entries that break the shard rules are refused before a manifest is written."""
    import msgspec

    from shardstore.format.manifest import OptimEntry

    model, opt = trained
    cid = ss.save(store, model, opt, step=3, ref=None)
    lc = ss.load_commit(store, cid)
    entries = sorted(lc.entries().values(), key=lambda e: e.name)
    info = ss.CommitInfo(step=3, transition="repartition")
    groups = list(lc.commit.optimizer.groups)
    halves = [entries[: len(entries) // 2], entries[len(entries) // 2 :]]
    used = [[g for g in groups if any(e.optim and e.optim.group == g.name for e in half)] for half in halves]
    before = set(store.objects())
    shards = [
        ss.write_shard_entries(
            store,
            half,
            groups=used[i],
            algorithm=lc.commit.optimizer.algorithm,
            rng={},
            info=info,
            parent=cid,
            slot=i,
            slots=2,
        )
        for i, half in enumerate(halves)
    ]
    new = ss.write_commit(store, shards, info=info, parent=cid)
    assert store.commit(new).learned_root == lc.commit.learned_root
    assert set(store.objects()) - before == {*shards, new}  # manifests only: no payload was written
    ghost = msgspec.structs.replace(entries[0], param="ab" * 32)
    with pytest.raises(ss.ObjectNotFound, match="not in the store"):
        ss.write_shard_entries(
            store, [ghost], groups=[], algorithm="none", rng={}, info=info, parent=cid, slot=0, slots=1
        )
    trained_entry = next(e for e in entries if e.optim is not None)
    skewed = msgspec.structs.replace(trained_entry, optim=msgspec.structs.replace(trained_entry.optim, birth=1))
    assert isinstance(skewed.optim, OptimEntry)
    with pytest.raises(ss.CursorError, match="Adam age"):
        ss.write_shard_entries(
            store,
            [skewed],
            groups=[g for g in groups if g.name == skewed.optim.group],
            algorithm=lc.commit.optimizer.algorithm,
            rng={},
            info=info,
            parent=cid,
            slot=0,
            slots=1,
        )
