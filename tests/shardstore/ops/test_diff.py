"""Tests of shardstore.diff: one tensor, layout only, Adam age only, fields, stats, and the mirror law."""

from __future__ import annotations

import uuid

import pytest
import torch
from conftest import TinyNet, make_optimizer, train_steps
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardstore as ss
from shardstore.ops.diff import CommitDiff, diff
from shardstore.state.optim import Hyper, OptimState, ParamOpt


def _slots(model: torch.nn.Module, opt: torch.optim.Optimizer, split: list[list[str]]) -> list[ss.SlotState]:
    return [ss.capture(model, opt, names=names, rng=False) for names in split]


def _commit(store: ss.Store, states: list[ss.SlotState], step: int, **info: object) -> str:
    return ss.save_slots(store, states, info=ss.CommitInfo(step=step, **info), ref=None, parent=None)  # type: ignore[arg-type]


def _check_mirror(store: ss.Store, a: str, b: str, stats: bool = False) -> CommitDiff:
    ab, ba = diff(store, a, b, stats=stats), diff(store, b, a, stats=stats)
    assert ba == ab.mirrored()
    assert ab == ba.mirrored()
    assert diff(store, a, a, stats=stats).empty
    assert diff(store, b, b, stats=stats).empty
    return ab


def test_same_commit_is_empty(store, trained):
    model, opt = trained
    a = _commit(store, _slots(model, opt, [[n for n, _ in model.named_parameters()]]), 3)
    d = diff(store, a, a[:10], stats=True)
    assert d.empty and d.learned_root_equal and not d.layout_changed
    assert d.tensors == () and len(d.unchanged) == 8


def test_one_tensor_changed_with_stats(store, trained):
    model, opt = trained
    names = [n for n, _ in model.named_parameters()]
    a = _commit(store, _slots(model, opt, [names]), 3)
    with torch.no_grad():
        before = model.mid.weight.detach().clone()
        model.mid.weight[2, 5] += 0.5
    b = _commit(store, _slots(model, opt, [names]), 3)
    d = _check_mirror(store, a, b, stats=True)
    assert [t.name for t in d.tensors] == ["mid.weight"]
    t = d.tensors[0]
    assert t.status == "changed" and t.changes == ("param",)
    assert set(t.stats) == {"param"}  # moments are the same objects: nothing to compare
    s = t.stats["param"]
    want_diff = (model.mid.weight.detach().double() - before.double()).abs().max().item()
    assert s.max_abs_diff == want_diff
    assert s.rel_l2 == pytest.approx(want_diff / before.double().norm().item(), rel=1e-12)
    assert not d.learned_root_equal and not d.layout_changed and d.fields == ()
    assert len(d.unchanged) == 7


def test_layout_only_keeps_learned_root(store, trained):
    model, opt = trained
    names = sorted(n for n, _ in model.named_parameters())
    a = _commit(store, _slots(model, opt, [names]), 3)
    b = _commit(store, _slots(model, opt, [names[:3], names[3:]]), 3)
    assert a != b
    d = _check_mirror(store, a, b)
    assert d.learned_root_equal
    assert d.tensors == () and d.fields == () and d.groups == ()
    assert d.slots == (1, 2) and d.layout_changed and not d.empty
    assert sorted(m.name for m in d.moved) == names[3:]
    assert all(m.slot_before == 0 and m.slot_after == 1 for m in d.moved)


def test_adam_age_only(store, trained):
    model, opt = trained
    names = [n for n, _ in model.named_parameters()]
    a = _commit(store, _slots(model, opt, [names]), 3)
    opt.state[model.out.bias]["step"] = torch.tensor(2.0)  # born one step later
    b = _commit(store, _slots(model, opt, [names]), 3)
    d = _check_mirror(store, a, b)
    assert [t.name for t in d.tensors] == ["out.bias"]
    t = d.tensors[0]
    assert t.changes == ("age", "birth") and t.age == (3, 2)
    assert not d.learned_root_equal and d.fields == () and not d.layout_changed


def test_fields_groups_added_removed(store):
    model = TinyNet()
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    names = sorted(n for n, _ in model.named_parameters())
    a = _commit(store, _slots(model, opt, [names[:-1]]), 2, config={"hidden": 8, "eps": 1e-5}, job="j1")
    opt.param_groups[0]["lr"] = 0.5
    train_steps(model, opt, 1)
    b = _commit(
        store, _slots(model, opt, [names[1:]]), 3, config={"hidden": 16, "eps": 1e-5}, job="j2", transition="grow"
    )
    d = _check_mirror(store, a, b, stats=True)
    assert [t.name for t in d.by_status("added")] == [names[-1]]
    assert [t.name for t in d.by_status("removed")] == [names[0]]
    fields = {f.name: (f.before, f.after) for f in d.fields}
    assert fields["step"] == (2, 3) and fields["job"] == ("j1", "j2") and fields["transition"] == ("train", "grow")
    assert fields["config.hidden"] == (8, 16) and "config.eps" not in fields and "config" in fields
    assert [(g.name, g.before["lr"], g.after["lr"]) for g in d.groups] == [("decay", 0.01, 0.5)]
    changed = d.by_status("changed")
    assert changed and all(set(t.stats) == {"param", "exp_avg", "exp_avg_sq"} for t in changed)


# -- the mirror law over generated pairs ---------------------------------------------------

_BASE = {f"w{i}": torch.arange(6, dtype=torch.float32).reshape(2, 3) * (i + 1) for i in range(4)}
_OPS = st.sampled_from(["value", "dtype", "shape", "add", "remove", "age", "lr", "split", "step", "config", "rng"])


def _state(tensors: dict[str, torch.Tensor], ages: dict[str, int], lr: float) -> OptimState:
    params = {
        n: ParamOpt(
            "g", ages.get(n, 1), torch.ones_like(t, dtype=torch.float32), torch.full_like(t, 0.5, dtype=torch.float32)
        )
        for n, t in tensors.items()
    }
    return OptimState("adamw", {"g": Hyper(lr, 0.9, 0.999, 1e-8, 0.0)}, params)


def _build(store: ss.Store, ops: list[str]) -> str:
    tensors = dict(_BASE)
    ages: dict[str, int] = {}
    lr, cut, step, config, rng = 1e-3, 2, 5, {"layers": 2}, {"torch": b"\x01"}
    for op in ops:
        if op == "value":
            tensors["w0"] = _BASE["w0"] + 1  # ops are idempotent: a set of ops names the state
        elif op == "dtype":
            tensors["w1"] = tensors["w1"].double()
        elif op == "shape":
            tensors["w2"] = tensors["w2"].reshape(3, 2)
        elif op == "add":
            tensors["x9"] = torch.zeros(4)
        elif op == "remove":
            tensors.pop("w3", None)
        elif op == "age":
            ages["w0"] = 2
        elif op == "lr":
            lr = 1e-2
        elif op == "split":
            cut = 1
        elif op == "step":
            step = 6
        elif op == "config":
            config = {"layers": 3}
        elif op == "rng":
            rng = {"torch": b"\x02"}
    names = sorted(tensors)
    full = _state(tensors, ages, lr)
    states = []
    for part in (names[:cut], names[cut:]):
        sub = OptimState(full.algorithm, full.groups, {n: full.params[n] for n in part})
        states.append(ss.SlotState({n: tensors[n] for n in part}, sub, dict(rng)))
    return _commit(store, states, step, config=config)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_OPS, max_size=4), st.lists(_OPS, max_size=4), st.booleans())
def test_diff_mirrors(ops_a: list[str], ops_b: list[str], stats: bool) -> None:
    store = ss.open_store(f"memory://shardstore-diff/{uuid.uuid4().hex}")
    a, b = _build(store, ops_a), _build(store, ops_b)
    d = _check_mirror(store, a, b, stats=stats)
    assert d.empty == (a == b)
    assert d.learned_root_equal == (set(ops_a) - {"split", "rng"} == set(ops_b) - {"split", "rng"})
