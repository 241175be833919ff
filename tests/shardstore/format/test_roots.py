"""Learned-state root and full root: invariance under partition and RNG, sensitivity to every learned value."""

from __future__ import annotations

import uuid

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import named_states

import shardstore as ss
from shardstore.state.optim import Hyper, OptimState, ParamOpt

STORE = ss.open_store(f"memory://roots-{uuid.uuid4().hex}")
HYPER = {"decay": Hyper(1e-3, 0.9, 0.95, 1e-8, 0.1), "no_decay": Hyper(1e-3, 0.9, 0.95, 1e-8, 0.0)}


def slot_states(step, tensors, params, assignment, n_slots, rng=None, hyper=HYPER):
    states = []
    for s in range(n_slots):
        names = [n for n in sorted(tensors) if assignment[n] == s]
        po = {n: ParamOpt(params[n][0], params[n][1], params[n][2], params[n][3]) for n in names}
        used = {p.group for p in po.values()}
        optim = OptimState("adamw", {g: h for g, h in hyper.items() if g in used}, po)
        states.append(ss.SlotState({n: tensors[n] for n in names}, optim, dict(rng or {})))
    return states


def commit(step, tensors, params, assignment=None, n_slots=1, rng=None, cursor=7, hyper=HYPER, config=None):
    assignment = assignment or {n: 0 for n in tensors}
    info = ss.CommitInfo(step=step, data_cursor=cursor, config=config)
    cid = ss.save_slots(STORE, slot_states(step, tensors, params, assignment, n_slots, rng, hyper), info=info, ref=None)
    return cid, STORE.commit(cid).learned_root


@st.composite
def partitioned(draw):
    step, tensors, params = draw(named_states())
    n = draw(st.integers(1, 3))
    assignment = {name: draw(st.integers(0, n - 1)) for name in tensors}
    return step, tensors, params, assignment, n


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(partitioned(), st.binary(min_size=1, max_size=16))
def test_learned_root_is_invariant_to_partition_and_rng(p, rng_bytes):
    step, tensors, params, assignment, n = p
    one_id, one_root = commit(step, tensors, params)
    many_id, many_root = commit(step, tensors, params, assignment, n, rng={"torch": rng_bytes})
    assert one_root == many_root
    assert one_id != many_id  # the layout or the RNG differs, so the full root does
    other_rng_id, other_root = commit(step, tensors, params, assignment, n, rng={"torch": rng_bytes + b"!"})
    assert other_root == many_root and other_rng_id != many_id


def _variants(step, tensors, params):
    """Every single-value change of the learned state, one at a time."""
    name = sorted(tensors)[0]
    t = tensors[name]

    def with_tensor(new):
        return step, {**tensors, name: new}, params

    flat = t.reshape(-1).clone()
    if flat.numel():
        b = flat.view(torch.uint8).clone()
        b[0] ^= 1
        yield "tensor byte", with_tensor(b.view(t.dtype).reshape(t.shape))
    yield "dtype", with_tensor(t.to(torch.float64))
    reshape = (lambda x: x.reshape(-1, 1)) if t.dim() != 2 else (lambda x: x.reshape(-1))
    g0, a0, m10, m20 = params[name]
    moved = (g0, a0, None if m10 is None else reshape(m10), None if m20 is None else reshape(m20))
    yield "shape", (step, {**tensors, name: reshape(t)}, {**params, name: moved})
    renamed = {("zz_" + name if n == name else n): v for n, v in tensors.items()}
    reparams = {("zz_" + name if n == name else n): v for n, v in params.items()}
    yield "name", (step, renamed, reparams)
    g, age, m1, m2 = params[name]
    if age > 0:
        m1b = m1.clone()
        m1b.reshape(-1)[0] += 1
        yield "exp_avg", (step, tensors, {**params, name: (g, age, m1b, m2)})
        m2b = m2.clone()
        m2b.reshape(-1)[0] += 1
        yield "exp_avg_sq", (step, tensors, {**params, name: (g, age, m1, m2b)})
        yield "adam age", (step, tensors, {**params, name: (g, age - 1, m1, m2)})
    other = "no_decay" if g == "decay" else "decay"
    yield "group", (step, tensors, {**params, name: (other, age, m1, m2)})
    yield "step", (step + 1, tensors, params)


@SETTINGS
@given(named_states())
def test_any_learned_value_changes_the_root(s):
    step, tensors, params = s
    _, root = commit(step, tensors, params)
    for what, (st2, t2, p2) in _variants(step, tensors, params):
        _, r2 = commit(st2, t2, p2)
        assert r2 != root, what
    _, r_cursor = commit(step, tensors, params, cursor=8)
    assert r_cursor != root
    hyper = {**HYPER, "decay": Hyper(2e-3, 0.9, 0.95, 1e-8, 0.1), "no_decay": Hyper(2e-3, 0.9, 0.95, 1e-8, 0.0)}
    _, r_hyper = commit(step, tensors, params, hyper=hyper)
    assert r_hyper != root
    _, r_config = commit(step, tensors, params, config={"hidden_size": 8})
    assert r_config != root


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=1, max_size=5))
def test_parent_chains_are_acyclic_and_steps_increase(increments):
    tensors = {"w": torch.zeros(2)}
    store = ss.open_store(f"memory://chain-{uuid.uuid4().hex}")
    step = 0
    ids = []
    for inc in increments:
        step += inc
        tensors["w"] += 1
        ids.append(ss.save(store, tensors, step=step, rng=False, transition="train"))
    seen, cur, steps = set(), store.ref("main"), []
    while cur is not None:
        assert cur not in seen
        seen.add(cur)
        c = store.commit(cur)
        steps.append(c.step)
        cur = c.parent
    assert len(seen) == len(ids)
    assert steps == sorted(steps, reverse=True)
