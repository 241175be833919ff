"""Review findings: state a save accepted but a later path dropped, and a race in the selection record."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

import shardstore as ss
from shardstore.ops.interchange import export_commit


class _Box:
    def __init__(self, v: int, with_tensor: bool) -> None:
        self.v, self.with_tensor = v, with_tensor

    def state_dict(self) -> dict:
        return {"v": self.v, **({"t": torch.full((2,), float(self.v))} if self.with_tensor else {})}

    def load_state_dict(self, s: dict) -> None:
        self.v = s["v"]


def _store() -> ss.Store:
    return ss.open_store(f"memory://review/{uuid.uuid4().hex}")


@pytest.mark.parametrize("with_tensor", [False, True])
def test_export_keeps_a_slot_extra_and_a_commit_extra_whose_names_look_alike(tmp_path, with_tensor):
    # A commit-wide extra 'slot0.s' and slot 0's own extra 's' were both exported as 'slot0.s':
    # optimizer.json silently kept one, extras.safetensors failed to read back.
    store = _store()
    cid = ss.save(
        store,
        torch.nn.Linear(2, 2),
        None,
        step=1,
        extra={"slot0.s": _Box(1, with_tensor)},
        slot_extra={"s": _Box(2, with_tensor)},
    )
    export_commit(store, cid, str(tmp_path), with_optimizer=True, weights_only=True)  # no model config
    extras = json.loads((tmp_path / "optimizer.json").read_text())["extras"]
    assert len(extras) == 2 and sorted(x["v"] for x in extras.values()) == [1, 2]
    if with_tensor:
        from safetensors.torch import load_file

        assert len(load_file(str(tmp_path / "extras.safetensors"))) == 2


@pytest.mark.parametrize(
    "make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.AdamW(ps, lr=0.1)]
)
def test_optimizer_state_of_a_tensor_the_model_does_not_hold_is_refused_not_dropped(make):
    # An optimizer over the model's parameters and one more tensor: save committed without that
    # tensor or its state (exit 0), and restore into the same setup then failed.
    model, scale = torch.nn.Linear(2, 2), torch.nn.Parameter(torch.ones(2))
    opt = make([*model.parameters(), scale])
    (model(torch.ones(1, 2)) * scale).sum().backward()
    opt.step()
    store = _store()
    with pytest.raises(ss.StateMismatch, match="not among the model"):
        ss.save(store, model, opt, step=1)
    assert store.ref("main") is None
    ss.save(store, {**dict(model.named_parameters()), "scale": scale}, opt, step=1)  # named: stored
    assert "scale" in ss.load_commit(store, "main").entries()


def test_a_selection_racing_with_the_opening_of_finals_is_refused():
    # select checked 'finals opened?' before replacing the selection; an opening that completed
    # in between left the finals opened for commit A and the selection naming commit B.
    from shardtrain.errors import RoleError
    from shardtrain.job import roles

    store, job = _store(), "c" * 64
    a, b = "a" * 64, "b" * 64
    roles.select(store, job, a)
    real_pin = store.pin

    def pin_after_an_opening(name, objects, *, expected):
        store.pin = real_pin
        roles.open_finals(store, job, a)  # completes between select's check and its pin
        real_pin(name, objects, expected=expected)

    store.pin = pin_after_an_opening
    with pytest.raises(RoleError):
        roles.select(store, job, b)
    assert roles.selection(store, job).commit == a
    with pytest.raises(RoleError):
        roles.open_finals(store, job, b)


@pytest.mark.parametrize(
    "tensor",
    [torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,)), torch.empty(2, device="meta")],
    ids=["sparse", "meta"],
)
def test_a_tensor_without_dense_bytes_is_refused_typed(tensor):
    # A sparse or meta tensor in an extra (or a model mapping) raised torch's RuntimeError /
    # NotImplementedError from deep inside the write.
    store = _store()
    with pytest.raises(ss.TensorMismatch, match="dense"):
        ss.save(store, torch.nn.Linear(1, 1), None, step=0, extra={"x": _Fixed({"t": tensor})})
    if tensor.device.type != "meta":  # a meta entry of a mapping is 'not owned' and skipped by design
        with pytest.raises(ss.TensorMismatch, match="dense"):
            ss.save(store, {"w": tensor}, None, step=0)
    assert store.ref("main") is None


class _Fixed:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def test_select_refuses_ids_it_could_not_read_back():
    # select('job-1', ...) wrote and pinned a record that selection() then refused as malformed.
    from shardtrain.errors import RoleError
    from shardtrain.job import roles

    store = _store()
    with pytest.raises(RoleError, match="64 hex"):
        roles.select(store, "job-1", "a" * 64)
    assert roles.selection(store, "job-1") is None and not store.pin_names()


def _two_layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.AdamW(ps, lr=0.1)]
)
def test_optimizer_state_of_a_tensor_the_live_optimizer_does_not_hold_is_refused_not_dropped(make):
    # Saved with a second param group (add_param_group), restored into an optimizer without it:
    # restore returned normally, the momentum of that group's parameters silently dropped (SGD), or
    # installed into optimizer.state for tensors in none of its groups (AdamW), after which the
    # optimizer's own state_dict() raised KeyError. torch's load_state_dict refuses this.
    model = _two_layers()
    opt = make(list(model[0].parameters()))
    opt.add_param_group({"params": list(model[1].parameters())})
    model(torch.ones(3, 2)).sum().backward()
    opt.step()
    store = _store()
    cid = ss.save(store, model, opt, step=1)
    model2 = _two_layers()
    opt2 = make(list(model2[0].parameters()))
    before = [p.detach().clone() for p in model2.parameters()]
    with pytest.raises(ss.StateMismatch, match="0.weight|1.weight|1.bias"):
        ss.restore(store, cid, model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))  # refused before any write
    assert not opt2.state
    opt2.state_dict()
    # the same setup takes it
    opt2.add_param_group({"params": list(model2[1].parameters())})
    ss.restore(store, cid, model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert len(opt2.state_dict()["state"]) == 4


def test_a_frozen_parameter_without_optimizer_state_still_restores():
    # the refusal above is of state that would be lost, not of a parameter the optimizer never held
    model = _two_layers()
    model[1].requires_grad_(False)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(3, 2)).sum().backward()
    opt.step()
    store = _store()
    cid = ss.save(store, model, opt, step=1)
    model2 = _two_layers()
    opt2 = torch.optim.SGD(model2[0].parameters(), lr=0.1, momentum=0.9)
    ss.restore(store, cid, model2, opt2)
    assert torch.equal(
        opt2.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"]
    )


def _stepped(lr_mult: float) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW([{"params": model.parameters(), "lr_mult": lr_mult}], lr=0.5)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def _same_adam(opt, opt2, params, params2) -> None:
    """Each parameter of ``params2`` equals its counterpart of ``params``, and so does its Adam state."""
    for p, q in zip(params, params2):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def _round_trip(build):
    """(the store, what ``build(0.25)`` made and was saved, what ``build(0.5)`` made and the commit was
    restored into): a model and optimizer whose group key ``lr_mult`` is held in the torch form."""
    store = _store()
    saved = build(0.25)
    cid = ss.save(store, *saved, step=1, rng=False)
    assert ss.load_commit(store, cid).commit.optimizer.algorithm == "torch"
    into = build(0.5)
    ss.restore(store, cid, *into, rng=False)
    return store, saved, into


def test_an_adam_group_key_of_its_own_is_kept_not_dropped() -> None:
    """An AdamW param group's own key (a user's ``lr_mult``, timm's ``lr_scale``) was dropped by the
    Adam form, which holds five numbers a group: saved as 0.25, restored as the live 0.5, without a
    word. Such an optimizer is now held in the torch form, which holds every key (SPEC.md §9); one
    whose extra keys are torch's and its schedulers' own keeps the Adam form and its ids; and an
    Adam-form commit restores into an optimizer with such a key, leaving the key as it is."""
    store, (model, opt), (model2, opt2) = _round_trip(_stepped)
    assert opt2.param_groups[0]["lr_mult"] == 0.25
    _same_adam(opt, opt2, model.parameters(), model2.parameters())

    plain = torch.nn.Linear(3, 2)
    adamw = torch.optim.AdamW(plain.named_parameters(), lr=0.5)  # param_names: torch's own key
    torch.optim.lr_scheduler.OneCycleLR(adamw, max_lr=1.0, total_steps=10)  # initial_lr, max_lr, ...: the scheduler's
    old = ss.save(store, plain, adamw, step=0, rng=False)
    assert ss.load_commit(store, old).commit.optimizer.algorithm == "adamw"
    model3, opt3 = _stepped(0.5)
    ss.restore(store, old, model3, opt3, rng=False)  # an Adam-form commit, into an optimizer with lr_mult
    assert opt3.param_groups[0]["lr_mult"] == 0.5 and opt3.param_groups[0]["lr"] == adamw.param_groups[0]["lr"]


class _Optimizers:
    """A container of optimizers (the shape of torchtitan's ``OptimizersContainer``)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers


def _two_adamw(lr_mult: float) -> tuple[torch.nn.Sequential, _Optimizers]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    backbone = torch.optim.AdamW([{"params": model[0].parameters(), "lr_mult": lr_mult}], lr=0.5)
    head = torch.optim.AdamW(model[1].parameters(), lr=0.5)
    model(torch.ones(1, 3)).sum().backward()
    backbone.step()
    head.step()
    return model, _Optimizers([backbone, head])


def test_a_wrapper_of_adams_one_with_a_group_key_of_its_own_is_saved_whole() -> None:
    """Two AdamW in one wrapper, one with a group key of its own (``lr_mult``): that one went to the
    torch form and the other to the Adam form, and the save was refused as optimizers "of different
    kinds", where it had saved before. Both are held in the torch form, and restore as they were."""
    _, (model, opts), (model2, opts2) = _round_trip(_two_adamw)
    assert opts2.optimizers[0].param_groups[0]["lr_mult"] == 0.25
    for o, o2 in zip(opts.optimizers, opts2.optimizers):
        _same_adam(o, o2, o.param_groups[0]["params"], o2.param_groups[0]["params"])
