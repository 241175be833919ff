"""Wrapper optimizers are saved as what they wrap, and no optimizer is saved holding less than
its own ``state_dict()`` (SPEC.md §9.5; ``shardstore/state/wrapped.py``).

The frameworks' own classes, really imported: torchtitan's ``OptimizersContainer`` (several
inner optimizers), accelerate's ``AcceleratedOptimizer``, ``AcceleratedScheduler`` and
``DataLoaderShard``, Lightning's ``LightningOptimizer``.
"""

from __future__ import annotations

import pytest
import torch

import shardstore
from shardstore.errors import UnsupportedOptimizer


def _step(parts, opt, n=2):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(4, 3, generator=g)
        for p in parts:
            x = p(x)
        x.square().sum().backward()
        opt.step()
        opt.zero_grad()


def _parts(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)]


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    """Bitwise: every state tensor and number, and every hyperparameter but the parameters' identities."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]) and v.dtype == sb["state"][i][k].dtype, (i, k)
    for ga, gb in zip(sa["param_groups"], sb["param_groups"]):
        for k in {"lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov"} & set(ga):
            assert ga[k] == gb[k], k


def _commits(store):
    return store.ref("main")


# -- torchtitan: OptimizersContainer, one AdamW per model part ----------------------------------


def _container(parts):
    oc = pytest.importorskip("torchtitan.components.optimizer", reason="torchtitan's OptimizersContainer under test")
    cfg = oc.OptimizersContainer.Config(
        implementation="for-loop",  # fused is CUDA-only
        param_groups=[
            oc.ParamGroupConfig(
                pattern=r".*",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
            )
        ],
    )
    return oc.OptimizersContainer(cfg, model_parts=parts)


def test_torchtitan_container_is_captured_whole_and_restores_into_both_forms(tmp_path):
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    parts = _parts()
    container = _container(parts)
    assert len(container.optimizers) == 2  # one per model part
    schedulers = LRSchedulersContainer(container, lambda step: 1.0 / (step + 1))
    for _ in range(2):
        _step(parts, container, n=1)
        schedulers.step()
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save(store, torch.nn.ModuleList(parts), container, step=2, rng=False, extra={"lr": schedulers})
    entries = shardstore.load_commit(store, cid).entries()
    # every parameter's Adam state is in the commit (before: the container's own empty state, none of it)
    assert sorted(entries) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert all(e.optim is not None and e.optim.exp_avg is not None and e.optim.age == 2 for e in entries.values())

    fresh = _parts(seed=5)  # wrapped form: a new container over new parts
    wrapped = _container(fresh)
    fresh_schedulers = LRSchedulersContainer(wrapped, lambda step: 1.0 / (step + 1))
    shardstore.restore(store, cid, torch.nn.ModuleList(fresh), wrapped, extra={"lr": fresh_schedulers})
    for a, b in zip(container.optimizers, wrapped.optimizers):
        _same_state(a, b)
    assert fresh_schedulers.state_dict() == schedulers.state_dict() == {"last_epoch": 2}
    plain_parts = _parts(seed=6)  # plain form: one AdamW whose groups are the container's, in order
    plain = torch.optim.AdamW([{"params": p.parameters()} for p in plain_parts], lr=0.5)
    shardstore.restore(store, cid, torch.nn.ModuleList(plain_parts), plain)
    reference = torch.optim.AdamW([{"params": p.parameters()} for p in parts])
    reference.load_state_dict(
        {
            "state": {**container.optimizers[0].state_dict()["state"], **_shift(container.optimizers[1], 2)},
            "param_groups": [
                {**container.optimizers[0].param_groups[0], "params": [0, 1]},
                {**container.optimizers[1].param_groups[0], "params": [2, 3]},
            ],
        }
    )
    _same_state(reference, plain)
    # and the plain form's save is the same commit: the container was saved as what it wraps
    again = shardstore.save(
        store, torch.nn.ModuleList(plain_parts), plain, step=2, rng=False, ref=None, extra={"lr": schedulers}
    )
    assert again == cid


def _shift(opt, by):
    return {i + by: st for i, st in opt.state_dict()["state"].items()}


# -- accelerate: AcceleratedOptimizer, AcceleratedScheduler, DataLoaderShard ----------------------


@pytest.fixture
def accelerator():
    accelerate = pytest.importorskip("accelerate", reason="accelerate's prepared objects under test")
    return accelerate.Accelerator(cpu=True)


def test_accelerated_optimizer_is_saved_as_what_it_wraps(tmp_path, accelerator):
    parts = _parts()
    model = torch.nn.Sequential(*parts)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, wrapped = accelerator.prepare(model, plain)
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    _step([model], wrapped)
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save(store, model, wrapped, step=2, rng=False)
    assert shardstore.save(store, model, plain, step=2, rng=False, ref=None) == cid  # the same commit, byte for byte

    again = torch.nn.Sequential(*_parts(seed=3))
    into_plain = torch.optim.AdamW(again.parameters(), lr=0.5)
    shardstore.restore(store, cid, again, into_plain)
    _same_state(plain, into_plain)
    model2 = torch.nn.Sequential(*_parts(seed=4))
    model2, into_wrapped = accelerator.prepare(model2, torch.optim.AdamW(model2.parameters(), lr=0.5))
    shardstore.restore(store, cid, model2, into_wrapped)
    _same_state(plain, into_wrapped.optimizer)


def test_accelerated_scheduler_and_prepared_loader_round_trip(tmp_path, accelerator):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.arange(12.0))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    assert type(loader).__name__ == "DataLoaderShard"
    with pytest.raises(AttributeError, match="dl_state_dict"):  # accelerate's own state_dict() cannot work here
        loader.state_dict()
    for _ in range(2):
        list(loader)  # one epoch
        opt.step()
        sched.step()
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save(store, model, opt, step=2, extra={"sched": sched}, slot_extra={"loader": loader})
    expected = [b[0].tolist() for b in loader]  # the next epoch's order
    expected_lr = sched.get_last_lr()

    m2 = torch.nn.Linear(3, 2)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=1, gamma=0.5)
    l2 = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(99))
    m2, o2, l2, s2 = accelerator.prepare(m2, o2, l2, s2)
    shardstore.restore(store, cid, m2, o2, extra={"sched": s2}, slot_extra={"loader": l2})
    assert s2.get_last_lr() == expected_lr and s2.state_dict() == sched.state_dict()
    assert l2.iteration == 2
    assert [b[0].tolist() for b in l2] == expected
    # a loader that skips its first batches (accelerate's skip_first_batches, to resume mid-epoch) too
    skipping = accelerator.skip_first_batches(loader, 1)
    cid = shardstore.save(store, model, opt, step=3, slot_extra={"loader": skipping})
    rest = [b[0].tolist() for b in skipping]
    into = accelerator.skip_first_batches(l2, 1)
    list(into)  # one epoch further on: without the restore its order would be another
    assert [b[0].tolist() for b in accelerator.skip_first_batches(l2, 1)] != rest
    shardstore.restore(store, cid, m2, o2, slot_extra={"loader": into})
    assert [b[0].tolist() for b in into] == rest and len(rest) == 2


# -- Lightning: LightningOptimizer ----------------------------------------------------------------


def test_lightning_optimizer_is_saved_as_what_it_wraps(tmp_path):
    core = pytest.importorskip("lightning.pytorch.core.optimizer", reason="Lightning's LightningOptimizer under test")
    parts = _parts()
    model = torch.nn.Sequential(*parts)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # the torch form, by class name
    wrapped = core.LightningOptimizer(plain)
    _step([model], plain)
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save(store, model, wrapped, step=2, rng=False)
    assert shardstore.load_commit(store, cid).commit.optimizer.torch_optimizer.class_name == "torch.optim.sgd.SGD"
    assert shardstore.save(store, model, plain, step=2, rng=False, ref=None) == cid
    again = torch.nn.Sequential(*_parts(seed=2))
    into = core.LightningOptimizer(torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9))
    shardstore.restore(store, cid, again, into)
    _same_state(plain, into.optimizer)


# -- the general rule: never less than the optimizer's state_dict() holds --------------------------


class HiddenInner(torch.optim.Optimizer):
    """A hand-written wrapper of a shape shardstore does not know: its inner optimizer is ``self.inner``,
    its own ``state`` stays empty, its ``state_dict()`` is the inner one's."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd):
        self.inner.load_state_dict(sd)


class AdamWithExtra(torch.optim.AdamW):
    """An AdamW that keeps one more state tensor per parameter than Adam's canonical form holds."""

    def step(self, closure=None):
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["ema"] = p.detach().clone()
        return out


def test_a_wrapper_with_empty_state_is_refused_and_nothing_is_committed(tmp_path):
    parts = _parts()
    model = torch.nn.Sequential(*parts)
    wrapper = HiddenInner(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _step([model], wrapper)
    assert not wrapper.state and wrapper.state_dict()["state"]
    store = shardstore.open_store(tmp_path / "s")
    before = sorted(p for p in (tmp_path / "s").rglob("*") if p.is_file())
    with pytest.raises(
        UnsupportedOptimizer, match=r"test_wrapped_optim\.HiddenInner: .*'exp_avg' of parameter '0\.weight'"
    ):
        shardstore.save(store, model, wrapper, step=2)
    assert store.ref("main") is None
    assert sorted(p for p in (tmp_path / "s").rglob("*") if p.is_file()) == before  # not an object written


def test_adam_state_the_canonical_form_cannot_hold_is_refused(tmp_path):
    model = torch.nn.Sequential(*_parts())
    opt = AdamWithExtra(model.parameters(), lr=1e-2)
    _step([model], opt)
    store = shardstore.open_store(tmp_path / "s")
    with pytest.raises(UnsupportedOptimizer, match=r"AdamWithExtra: .*state 'ema' of parameter '0\.weight'"):
        shardstore.save(store, model, opt, step=2)
    assert store.ref("main") is None


def test_a_wrapper_holding_state_of_its_own_is_refused(tmp_path):
    model = torch.nn.Sequential(*_parts())

    class Own(torch.optim.SGD):
        pass

    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = Own(model.parameters(), lr=0.1, momentum=0.9)
    outer.optimizer = inner  # an `optimizer` attribute, but the wrapper keeps momentum of its own
    _step([model], outer)
    with pytest.raises(UnsupportedOptimizer, match="holds per-parameter state of its own"):
        shardstore.save(shardstore.open_store(tmp_path / "s"), model, outer, step=2)
