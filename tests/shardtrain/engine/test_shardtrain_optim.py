"""Shard-local AdamW: schedule, agreement with torch.optim.AdamW, Adam age, export/import."""

from __future__ import annotations

import math

import pytest
import torch

from shardtrain import AdamW, ConfigError, GroupConfig, OptimizerStateError, Schedule, lr_multiplier

GROUPS = {
    "decay": GroupConfig(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1),
    "no_decay": GroupConfig(lr=2e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.0),
}


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.nn.Parameter(torch.randn(6, 5, generator=g)),
        "norm": torch.nn.Parameter(torch.randn(5, generator=g)),
        "v": torch.nn.Parameter(torch.randn(3, 4, generator=g)),
    }


def _set_grads(params: dict[str, torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=g)


def test_schedule_is_warmup_then_cosine() -> None:
    s = Schedule(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [lr_multiplier(i, s) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(4, s) == 1.0
    assert lr_multiplier(9, s) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(14, s) == pytest.approx(0.1) and lr_multiplier(1000, s) == pytest.approx(0.1)
    assert lr_multiplier(0, Schedule()) == 1.0
    with pytest.raises(ConfigError):
        Schedule(warmup_steps=5, total_steps=2)
    with pytest.raises(ConfigError):
        lr_multiplier(-1, s)


def test_matches_torch_adamw() -> None:
    ours_p, ref_p = _params(), _params()
    schedule = Schedule(warmup_steps=2, total_steps=6, min_ratio=0.0)
    ours = AdamW(ours_p.items(), GROUPS, schedule=schedule)
    groups = [(["w", "v"], GROUPS["decay"]), (["norm"], GROUPS["no_decay"])]
    ref = torch.optim.AdamW(
        [
            {
                "params": [ref_p[n] for n in names],
                "lr": h.lr,
                "betas": (h.beta1, h.beta2),
                "eps": h.eps,
                "weight_decay": h.weight_decay,
            }
            for names, h in groups
        ],
        foreach=False,
    )
    for step in range(6):
        _set_grads(ours_p, step)
        _set_grads(ref_p, step)
        assert ours.step(step) == lr_multiplier(step, schedule)
        for group, (_, h) in zip(ref.param_groups, groups):
            group["lr"] = h.lr * lr_multiplier(step, schedule)
        ref.step()
    _, state = ours.state_export()
    for name in ours_p:
        torch.testing.assert_close(ours_p[name], ref_p[name], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(state[name]["exp_avg"], ref.state[ref_p[name]]["exp_avg"], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(
            state[name]["exp_avg_sq"], ref.state[ref_p[name]]["exp_avg_sq"], rtol=1e-6, atol=1e-8
        )
        assert state[name]["age"] == 6


def test_a_parameter_added_later_starts_its_own_clock() -> None:
    params = _params()
    opt = AdamW(params.items(), GROUPS)
    for step in range(3):
        _set_grads(params, step)
        opt.step(step)
    late = torch.nn.Parameter(torch.ones(4, 4))
    twin = torch.nn.Parameter(torch.ones(4, 4))
    opt.add_parameter("late", late)
    fresh = AdamW([("late", twin)], GROUPS)
    _, state = opt.state_export()
    assert state["late"] == {"exp_avg": None, "exp_avg_sq": None, "age": 0, "group": "decay"}
    late.grad = torch.full((4, 4), 0.5)
    twin.grad = torch.full((4, 4), 0.5)
    _set_grads(params, 3)
    opt.step(3)
    fresh.step(3)
    assert torch.equal(late, twin)  # bias correction used the new parameter's age, 1, not 4
    _, state = opt.state_export()
    assert state["late"]["age"] == 1 and state["w"]["age"] == 4
    with pytest.raises(OptimizerStateError, match="already in the optimizer"):
        opt.add_parameter("late", late)
    with pytest.raises(OptimizerStateError, match="unknown optimizer group 'other'"):
        opt.add_parameter("x", torch.nn.Parameter(torch.ones(2)), group="other")


def test_a_parameter_without_gradient_is_not_updated() -> None:
    params = _params()
    opt = AdamW(params.items(), GROUPS)
    _set_grads(params, 0)
    params["v"].grad = None
    before = params["v"].detach().clone()
    opt.step(0)
    _, state = opt.state_export()
    assert torch.equal(params["v"], before) and state["v"]["age"] == 0 and state["w"]["age"] == 1


def test_export_import_continues_bitwise() -> None:
    straight_p = _params()
    straight = AdamW(straight_p.items(), GROUPS, schedule=Schedule(1, 5))
    resumed_p = _params()
    first = AdamW(resumed_p.items(), GROUPS, schedule=Schedule(1, 5))
    for step in range(2):
        for ps, opt in ((straight_p, straight), (resumed_p, first)):
            _set_grads(ps, step)
            opt.step(step)
    groups, state = first.state_export()
    # What a store would keep: copies of the values, plain numbers.
    saved_params = {n: p.detach().clone() for n, p in resumed_p.items()}
    saved_state = {
        n: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in e.items()} for n, e in state.items()
    }
    new_p = {n: torch.nn.Parameter(t) for n, t in saved_params.items()}
    second = AdamW(new_p.items(), {k: GroupConfig(lr=0.5) for k in GROUPS}, schedule=Schedule(1, 5))
    second.state_import(groups, saved_state)
    assert second.state_export()[0] == groups
    for step in range(2, 5):
        for ps, opt in ((straight_p, straight), (new_p, second)):
            _set_grads(ps, step)
            opt.step(step)
    _, a = straight.state_export()
    _, b = second.state_export()
    for n in straight_p:
        assert torch.equal(straight_p[n], new_p[n])
        assert torch.equal(a[n]["exp_avg"], b[n]["exp_avg"]) and torch.equal(a[n]["exp_avg_sq"], b[n]["exp_avg_sq"])
        assert a[n]["age"] == b[n]["age"] == 5


def _exported() -> tuple[AdamW, dict, dict]:
    params = _params()
    opt = AdamW(params.items(), GROUPS)
    _set_grads(params, 0)
    opt.step(0)
    groups, state = opt.state_export()
    return opt, groups, state


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda g, s: s.pop("w"), r"missing \['w'\]"),
        (lambda g, s: s.update(extra=dict(s["w"])), r"unexpected \['extra'\]"),
        (lambda g, s: s["w"].update(group="nope"), "group 'nope' is not among the imported groups"),
        (lambda g, s: s["w"].update(age=-1), "Adam age must be an int >= 0"),
        (lambda g, s: s["w"].update(age=True), "Adam age must be an int >= 0"),
        (lambda g, s: s["w"].update(age=0), "age 0 but moments are present"),
        (lambda g, s: s["w"].update(exp_avg=torch.zeros(5, 6)), "exp_avg must be a torch.float32 tensor of shape"),
        (lambda g, s: s["w"].update(exp_avg_sq=None), "exp_avg_sq must be"),
        (lambda g, s: s["w"].update(exp_avg=torch.zeros(6, 5, dtype=torch.float64)), "exp_avg must be"),
        (lambda g, s: g["decay"].update(beta1=1.5), "invalid optimizer group"),
        (lambda g, s: g["decay"].pop("eps"), "invalid optimizer group"),
    ],
)
def test_invalid_imports_are_rejected_without_change(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    opt, groups, state = _exported()
    groups = {k: dict(v) for k, v in groups.items()}
    state = {k: dict(v) for k, v in state.items()}
    before = opt.state_export()
    mutate(groups, state)
    with pytest.raises(OptimizerStateError, match=message):
        opt.state_import(groups, state)
    after = opt.state_export()
    assert after[0] == before[0] and all(after[1][n]["exp_avg"] is before[1][n]["exp_avg"] for n in after[1])


@pytest.mark.parametrize("field", ["lr", "beta1", "beta2", "eps", "weight_decay"])
def test_group_hyperparameters_are_validated(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        GroupConfig(**{"lr": 1e-3, field: -1.0})
    with pytest.raises(ConfigError, match=field):
        GroupConfig(**{"lr": 1e-3, field: float("nan")})
