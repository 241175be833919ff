"""A whole trainer's state (issue 13): buffers, any torch optimizer, schedulers, scalers, user objects.

Each round trip trains a tiny BatchNorm model a few steps, saves, keeps training, then
rebuilds everything fresh, restores and trains the same steps: losses, parameters,
buffers, optimizer state and every extra's state must match bitwise.
"""

from __future__ import annotations

import enum
import uuid
from typing import Any

import numpy as np
import pytest
import torch

import shardstore as ss
from shardstore.store import object_key


class _Mode(enum.IntEnum):
    TRAIN = 1


class Counter:
    """A user's own stateful object with nested dict/list state and a tensor inside."""

    def __init__(self) -> None:
        self.seen = 0
        self.history: list[Any] = []
        self.best = torch.zeros(2)

    def update(self, loss: float) -> None:
        self.seen += 1
        self.history.append({"step": self.seen, "loss": loss, "flags": [True, None, "ok"]})
        self.best = torch.minimum(self.best, torch.tensor([loss, -loss]))

    def state_dict(self) -> dict[str, Any]:
        return {
            "seen": self.seen,
            "history": self.history,
            "nested": {"best": self.best, "depth": [[1, 2.5], {"x": -0.0}]},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen, self.history, self.best = sd["seen"], sd["history"], sd["nested"]["best"].clone()


class Warmup:
    """A callable lr_lambda object: its __dict__ is in LambdaLR's state_dict (a plain function is not)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, epoch: int) -> float:
        return min(1.0, (epoch + 1) / self.n)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def _sgd_commit(**save_kw: Any) -> tuple[ss.Store, torch.nn.Module, torch.optim.SGD, str]:
    """A memory store holding one commit of ``_model()`` after one SGD(momentum) step."""
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    return store, model, opt, ss.save(store, model, opt, step=1, **save_kw)


def _sched(kind: str, opt: torch.optim.Optimizer) -> Any:
    S = torch.optim.lr_scheduler
    if kind == "cosine":
        return S.CosineAnnealingLR(opt, T_max=7)
    if kind == "onecycle":
        return S.OneCycleLR(opt, max_lr=0.05, total_steps=10)
    if kind == "sequential":
        return S.SequentialLR(
            opt, [S.LinearLR(opt, start_factor=0.5, total_iters=2), S.ExponentialLR(opt, gamma=0.9)], milestones=[2]
        )
    return S.LambdaLR(opt, Warmup(4))


CASES = {
    "batchnorm-adamw-cosine": (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), "cosine"),
    "sgd-nesterov-onecycle": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True), "onecycle"),
    "adam-amsgrad-sequential": (lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True), "sequential"),
    "adagrad-lambda": (lambda p: torch.optim.Adagrad(p, lr=0.05), "lambda"),
    "rmsprop-centered-cosine": (lambda p: torch.optim.RMSprop(p, lr=0.01, centered=True, momentum=0.5), "cosine"),
    # Adafactor: state tensors of other shapes than the parameter (row and column factors), eps a tuple holding None
    "adafactor-sequential": (lambda p: torch.optim.Adafactor(p, lr=0.01), "sequential"),
}


def _build(case: str) -> tuple[torch.nn.Module, Any, Any, Any, Counter]:
    make_opt, kind = CASES[case]
    model = _model()
    opt = make_opt(model.parameters())
    return model, opt, _sched(kind, opt), torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2), Counter()


def _train(parts: tuple, batches: list[torch.Tensor]) -> list[float]:
    model, opt, sched, scaler, counter = parts
    losses = []
    for x in batches:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        counter.update(loss.item())
        losses.append(loss.item())
    return losses


def _assert_same_state(a: tuple, b: tuple) -> None:
    for (n, x), (_, y) in zip(a[0].state_dict().items(), b[0].state_dict().items()):
        assert torch.equal(x, y), n
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]) and v.dtype == sb["state"][i][k].dtype, (i, k)
    assert a[2].state_dict() == b[2].state_dict()
    assert a[3].state_dict() == b[3].state_dict()
    assert a[4].seen == b[4].seen and a[4].history == b[4].history and torch.equal(a[4].best, b[4].best)


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_continues_bitwise(case):
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 4, generator=g) for _ in range(5)]
    run = _build(case)
    _train(run, batches[:3])
    extra = {"scheduler": run[2], "scaler": run[3], "counter": run[4]}
    cid = ss.save(store, run[0], run[1], step=3, extra=extra)
    after = _train(run, batches[3:])

    fresh = _build(case)
    _train(fresh, batches[:1])  # a fresh run that has moved on: restore must overwrite all of it
    info = ss.restore(
        store, cid, fresh[0], fresh[1], extra={"scheduler": fresh[2], "scaler": fresh[3], "counter": fresh[4]}
    )
    assert info.extras == ["counter", "scaler", "scheduler"]
    assert _train(fresh, batches[3:]) == after
    _assert_same_state(run, fresh)
    assert ss.verify(store).ok


def test_buffers_are_restored_bitwise():
    """Failed before issue 13: running statistics came back at their initial values, silently."""
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    model = _model()
    model.register_buffer("scratch", torch.ones(3), persistent=False)
    model.train()
    for _ in range(3):
        model(torch.randn(8, 4))  # forward passes move the running statistics
    cid = ss.save(store, model, step=0)
    fresh = _model()
    ss.restore(store, cid, fresh)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(fresh[1], name), getattr(model[1], name)), name
    assert int(fresh[1].num_batches_tracked) == 3
    entries = ss.load_commit(store, cid).entries()
    assert {n for n, e in entries.items() if e.kind == "buffer"} == {
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    }
    assert "scratch" not in entries  # not in state_dict(), so not saved


def test_buffers_enter_the_learned_state_root():
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    model = _model()
    a = ss.save(store, model, step=0, rng=False)
    model(torch.randn(8, 4))  # only buffers change
    b = ss.save(store, model, step=0, rng=False, parent=a)
    assert store.commit(a).learned_root != store.commit(b).learned_root


def test_state_dict_entry_that_is_neither_parameter_nor_buffer_is_refused():
    class WithExtraState(torch.nn.Linear):
        def get_extra_state(self) -> Any:
            return {"calibrated": True}

        def set_extra_state(self, state: Any) -> None:
            pass

    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    model = torch.nn.Sequential(WithExtraState(2, 2))
    with pytest.raises(ss.UnsupportedState, match=r"'0\._extra_state'"):
        ss.save(store, model, step=0)
    assert store.refs() == {}


def test_tied_weights_are_saved_once():
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    cid = ss.save(store, model, step=0)
    assert sorted(ss.load_commit(store, cid).entries()) == ["0.weight"]


@pytest.mark.parametrize(
    "bad, path",
    [
        ({"fn": len}, r"\$\.fn"),
        ({"deep": [{"obj": Counter()}]}, r"\$\.deep\[0\]\.obj"),
        ({"gen": (i for i in range(2))}, r"\$\.gen"),
        ({1: "int key"}, r"key 1"),
        # these came back as something else: 1/3 rounded to a float64, an IntEnum as a plain int
        ({"x": [np.longdouble(1) / 3]}, r"\$\.x\[0\]"),
        ({"mode": _Mode.TRAIN}, r"\$\.mode: a .*_Mode"),
    ],
)
def test_extras_that_pickle_would_need_are_refused_by_key_path(bad, path):
    class Holder:
        def state_dict(self) -> dict:
            return bad

        def load_state_dict(self, sd: dict) -> None:
            pass

    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    with pytest.raises(ss.UnsupportedState, match=r"extra 'holder'.*" + path):
        ss.save(store, _model(), step=0, extra={"holder": Holder()})
    assert store.refs() == {}


def test_sgd_state_into_adamw_is_refused_before_anything_is_written():
    store, model, opt, cid = _sgd_commit()
    other = _model()
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(
        ss.StateMismatch, match=r"torch\.optim\.sgd\.SGD state but the optimizer is torch\.optim\.adamw\.AdamW"
    ):
        ss.restore(store, cid, other, torch.optim.AdamW(other.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(before, other.parameters()))  # nothing written
    with pytest.raises(ss.StateMismatch, match="adamw optimizer state but the optimizer is torch.optim.sgd.SGD"):
        adam_cid = ss.save(store, other, torch.optim.AdamW(other.parameters()), step=0, parent=None, ref=None)
        ss.restore(store, adam_cid, model, opt)


def test_optimizer_state_that_is_not_tensors_or_numbers_is_refused_by_key():
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model[0].weight]["history"] = [1, 2]
    with pytest.raises(ss.UnsupportedOptimizer, match=r"tensor '0\.weight', key 'history'"):
        ss.save(store, model, opt, step=0)


def test_slot_extras_async_saver_and_copy_of_one_slot():
    """A per-slot extra, a snapshot that later changes, and a slot-0 closure copied alone."""
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    model = _model()
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01)
    loader, counter = Counter(), Counter()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    loader.update(1.0)
    with ss.AsyncSaver(store) as saver:
        saver.save(model, opt, step=1, extra={"counter": counter}, slot_extra={"loader": loader})
        loader.update(2.0)  # after the snapshot: not in the commit
        with torch.no_grad():
            next(iter(opt.state.values()))["square_avg"].add_(1.0)
    cid = store.ref("main")
    dst = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    ss.copy_commit(store, dst, cid, slot=0)
    fresh, fresh_loader, fresh_counter = _model(), Counter(), Counter()
    fresh_opt = torch.optim.RMSprop(fresh.parameters(), lr=0.01)
    info = ss.restore(dst, cid, fresh, fresh_opt, extra={"counter": fresh_counter}, slot_extra={"loader": fresh_loader})
    assert info.slot_extras == ["loader"] and fresh_loader.seen == 1 and fresh_loader.history[0]["loss"] == 1.0
    assert torch.equal(fresh[1].running_var, model[1].running_var)  # buffers travel through the arena too
    w = model[0].weight
    assert not torch.equal(fresh_opt.state[fresh[0].weight]["square_avg"], opt.state[w]["square_avg"])
    assert torch.equal(fresh_opt.state[fresh[0].weight]["square_avg"] + 1.0, opt.state[w]["square_avg"])
    assert ss.verify(dst).ok
    with pytest.raises(ss.StateMismatch, match="no extra 'scheduler'"):
        ss.restore(dst, cid, fresh, extra={"scheduler": Counter()})


def test_verify_and_gc_see_the_new_objects():
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    run = _build("sgd-nesterov-onecycle")
    _train(run, [torch.randn(8, 4)])
    cid = ss.save(store, run[0], run[1], step=1, extra={"counter": run[4]})
    lc = ss.load_commit(store, cid)
    doc, tensor = lc.commit.extras[0].state, lc.commit.extras[0].tensors[0].object
    momentum = lc.entries()["0.weight"].state.tensors[0].object
    assert ss.gc(store, grace_seconds=0, dry_run=True).deleted == {}  # everything is reachable
    for oid in (doc, tensor, momentum):
        store.storage.delete(object_key(oid))
    report = ss.verify(store)
    missing = {p.object for p in report.problems if p.kind == "ObjectNotFound"}
    assert {doc, tensor, momentum} <= missing, report.problems


def test_cli_show_and_diff_report_buffers_optimizer_class_and_extras(tmp_path, capsys):
    from shardstore_cli import shardstore_cli

    path = str(tmp_path / "store")
    store = ss.open_store(path)
    run = _build("adagrad-lambda")
    _train(run, [torch.randn(8, 4)])
    a = ss.save(store, run[0], run[1], step=1, extra={"scheduler": run[2]}, slot_extra={"counter": run[4]})
    _train(run, [torch.randn(8, 4)])
    b = ss.save(store, run[0], run[1], step=2, extra={"scheduler": run[2]}, slot_extra={"counter": run[4]})
    capsys.readouterr()
    assert shardstore_cli.main(["show", path, b]) == 0
    out = capsys.readouterr().out
    assert "torch (torch.optim.adagrad.Adagrad)" in out and "per-parameter state: step, sum" in out
    assert (
        "1.running_mean float32[6] slot 0" in out and "scheduler (commit-wide): " in out and "counter (slot 0): " in out
    )
    assert shardstore_cli.main(["diff", path, a, b]) == 0
    out = capsys.readouterr().out
    assert "changed  1.running_var  values" in out and "state step 1 -> 2; state sum" in out
    assert "extra.scheduler.last_epoch: 1 -> 2" in out and "slot_extra.0.counter.seen: 1 -> 2" in out
    from shardstore.ops.diff import diff

    assert diff(store, b, a) == diff(store, a, b).mirrored()
    stats = {t.name: t.stats for t in diff(store, a, b, stats=True).tensors}
    assert stats["0.weight"]["state sum"].diff_l2 > 0 and stats["1.running_mean"]["param"].diff_l2 > 0
    assert shardstore_cli.main(["show", path, b, "--json"]) == 0
    doc = __import__("json").loads(capsys.readouterr().out)
    assert doc["optimizer"]["class"] == "torch.optim.adagrad.Adagrad" and [x["key"] for x in doc["extras"]] == [
        "scheduler",
        "counter",
    ]


def test_export_with_optimizer_keeps_torch_state_and_extras(tmp_path):
    import json

    from safetensors.torch import load_file

    from shardstore.ops.interchange import export_commit

    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    run = _build("sgd-nesterov-onecycle")
    _train(run, [torch.randn(8, 4)])
    ss.save(store, run[0], run[1], step=1, extra={"counter": run[4]})
    out = tmp_path / "out"
    export_commit(store, "main", str(out), with_optimizer=True, weights_only=True)  # no model config: the files
    model = load_file(str(out / "model.safetensors"))
    assert torch.equal(model["1.running_mean"], run[0][1].running_mean)  # buffers are model tensors
    momentum = load_file(str(out / "optimizer.state.momentum_buffer.safetensors"))
    assert torch.equal(momentum["0.weight"], run[1].state[run[0][0].weight]["momentum_buffer"])
    assert torch.equal(load_file(str(out / "extras.safetensors"))["counter.0"], run[4].best)
    doc = json.loads((out / "optimizer.json").read_text())
    assert doc["class"] == "torch.optim.sgd.SGD" and doc["extras"]["counter"]["seen"] == 1


def test_forged_manifests_and_state_documents_are_refused():
    import msgspec

    from shardstore.format.manifest import ExtraEntry
    from shardstore.verification.commits import shard_problems

    store, model, opt, cid = _sgd_commit()
    lc = ss.load_commit(store, cid)
    shard = lc.shards[0]
    entries = list(shard.entries)
    i = next(k for k, e in enumerate(entries) if e.kind == "buffer")
    j = next(k for k, e in enumerate(entries) if e.state is not None)
    forged = {
        "a buffer has optimizer state": {i: msgspec.structs.replace(entries[i], state=entries[j].state)},
        "not among the shard's torch optimizer groups": {
            j: msgspec.structs.replace(entries[j], state=msgspec.structs.replace(entries[j].state, group="other"))
        },
    }
    for message, change in forged.items():
        bad = msgspec.structs.replace(shard, entries=tuple(change.get(k, e) for k, e in enumerate(entries)))
        assert any(message in str(p) and p.kind == "ManifestError" for p in shard_problems(bad, "x" * 64)), message
    bad = msgspec.structs.replace(shard, torch_optimizer=None)
    assert any("torch_optimizer must be present" in str(p) for p in shard_problems(bad, "x" * 64))
    # A state document that hashes correctly but is not canonical (a plain JSON real) is refused on restore.
    sid = lc.shard_ids[0]
    planted = ExtraEntry(key="sched", state=store.put(b'{"lr":0.5}'), tensors=())
    forged_cid = ss.write_commit(store, [sid], info=ss.CommitInfo(step=1), parent=None, extras=(planted,))
    target = _model()
    before = [t.clone() for t in target.state_dict().values()]
    with pytest.raises(ss.ManifestError, match="plain JSON real"):
        ss.restore(store, forged_cid, target, extra={"sched": Counter()})
    assert all(torch.equal(a, b) for a, b in zip(before, target.state_dict().values()))  # refused before writing
    problems = ss.verify(store, [forged_cid]).problems
    assert any(
        p.kind == "ManifestError" and "plain JSON real" in str(p) and p.object == planted.state for p in problems
    ), problems


def test_lambda_lr_with_a_plain_function_keeps_no_state_for_it():
    """torch's LambdaLR.state_dict() holds None for a plain function: the restoring program supplies it."""
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
    opt.step()
    sched.step()
    ss.save(store, model, opt, step=1, extra={"scheduler": sched})
    doc = ss.load_commit(store, "main").commit.extras[0]
    assert b'"lr_lambdas":[null]' in bytes(store.get(doc.state))
    opt2 = torch.optim.SGD(_model().parameters(), lr=0.1)
    fn = lambda e: 0.5**e  # noqa: E731
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, fn)
    ss.restore(store, "main", _model(), extra={"scheduler": sched2})
    assert sched2.lr_lambdas == [fn] and sched2.last_epoch == 1


def test_one_learned_root_for_any_split_and_any_slot_extras():
    """Buffers, the torch form and commit-wide extras are in the learned-state root; the split and slot extras are not."""
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    run = _build("rmsprop-centered-cosine")
    _train(run, [torch.randn(8, 4)])
    model, opt = run[0], run[1]
    names = sorted(n for n, _ in model.state_dict().items())
    info = ss.CommitInfo(step=1)
    extra = {"scheduler": run[2], "counter": run[4]}
    one = ss.save_slots(store, [ss.capture(model, opt, rng=False)], info=info, ref=None, extra=extra)
    halves = [
        ss.capture(model, opt, names=names[:4], rng=False, extra={"loader": Counter()}),
        ss.capture(model, opt, names=names[4:], rng=False),
    ]
    two = ss.save_slots(store, halves, info=info, ref=None, extra=extra)
    roots = {store.commit(c).learned_root for c in (one, two)}
    assert one != two and len(roots) == 1
    run[4].update(0.5)  # only a commit-wide extra changes: the learned-state root changes
    three = ss.save_slots(store, [ss.capture(model, opt, rng=False)], info=info, ref=None, extra=extra)
    assert store.commit(three).learned_root not in roots


def test_optional_fields_have_one_spelling_and_unknown_fields_stay_refused():
    from shardstore.format.manifest import decode

    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    raw = bytes(store.get(ss.save(store, {"w": torch.ones(2)}, step=0)))
    assert b'"extras"' not in raw and decode(raw)
    for spelled in (b'{"extras":[],', b'{"surprise":1,'):
        forged = raw.replace(b'{"config"', spelled + b'"config"', 1)
        with pytest.raises(ss.ManifestError, match="canonical encoding|unknown field"):
            decode(forged)


def test_buffers_on_the_meta_device_are_not_owned():
    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    model = _model()
    model(torch.randn(8, 4))
    cid = ss.save(store, model, step=0)
    part = _model()
    part[1] = torch.nn.BatchNorm1d(6, device="meta")  # another process owns the norm: params and buffers
    info = ss.restore(store, cid, part)
    assert info.tensors == ["0.bias", "0.weight", "3.bias", "3.weight"] and part[1].running_mean.is_meta
    assert sorted(ss.load_commit(store, ss.save(store, part, step=0, ref=None)).entries()) == info.tensors


def test_an_optimizer_class_defined_in_a_function_is_refused_before_writing():
    class LocalSGD(torch.optim.SGD):
        pass

    store = ss.open_store(f"memory://trainer-state/{uuid.uuid4().hex}")
    model = _model()
    with pytest.raises(ss.UnsupportedOptimizer, match="LocalSGD' is not a label"):
        ss.save(store, model, LocalSGD(model.parameters(), lr=0.1), step=0)
    assert list(store.objects()) == []


def test_state_documents_round_trip_and_have_one_spelling():
    """Any storable state comes back equal, and key insertion order never changes the document (Hypothesis)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from shardstore.state.extras import capture_extras, read_extra_state

    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats(allow_nan=False)
        | st.text("abf64:tensor", max_size=8).filter(lambda s: not s.startswith(("f64:", "tensor:")))
    )
    values = st.recursive(
        scalars,
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text("abcé", max_size=4), kids, max_size=3),
        max_leaves=12,
    )

    class Holder:
        def __init__(self, sd: dict) -> None:
            self.sd = sd

        def state_dict(self) -> dict:
            return self.sd

    @settings(max_examples=25, deadline=None)
    @given(st.dictionaries(st.text("xyzé", max_size=4), values, max_size=4))
    def check(sd: dict) -> None:
        sd = {**sd, "t": torch.arange(3, dtype=torch.int16)}
        doc = capture_extras({"x": Holder(sd)})["x"]
        back = read_extra_state(doc.document, doc.tensors, "test")
        assert torch.equal(back.pop("t"), sd["t"]) and back == {k: v for k, v in sd.items() if k != "t"}
        reversed_sd = dict(reversed(list(sd.items())))
        assert capture_extras({"x": Holder(reversed_sd)})["x"].document == doc.document

    check()


@pytest.mark.parametrize("shape", [(2**21, 2**20), (1 << 14, 1 << 14)], ids=["8TiB", "1GiB"])
def test_a_forged_state_or_extra_shape_is_refused_before_allocating(shape, monkeypatch):
    """Regression: a state tensor's (or an extra tensor's) shape comes from the manifest only;
    restore allocated it before any size check (8 TiB: an untyped RuntimeError from the
    allocator; 1 GiB: allocated, then refused). Now the objects' sizes bound it first."""
    import msgspec

    from shardstore.format.manifest import ExtraEntry

    counter = Counter()
    store, model, opt, cid = _sgd_commit(extra={"counter": counter})
    lc = ss.load_commit(store, cid)
    shard = lc.shards[0]
    j, e = next((k, e) for k, e in enumerate(shard.entries) if e.state is not None)
    key = e.state.tensors[0].key
    big = msgspec.structs.replace(e.state.tensors[0], shape=shape)
    entries = list(shard.entries)
    entries[j] = msgspec.structs.replace(e, state=msgspec.structs.replace(e.state, tensors=(big, *e.state.tensors[1:])))
    sid = store.put_manifest(msgspec.structs.replace(shard, entries=tuple(entries)))
    forged_state = ss.write_commit(store, [sid], info=ss.CommitInfo(step=1), parent=None, extras=lc.commit.extras)
    x = lc.commit.extras[0]
    forged_extra = ss.write_commit(
        store, [lc.shard_ids[0]], info=ss.CommitInfo(step=1), parent=None,
        extras=(ExtraEntry(key=x.key, state=x.state, tensors=(msgspec.structs.replace(x.tensors[0], shape=shape),)),),
    )  # fmt: skip
    ss.load_commit(store, forged_state)  # structurally valid: only the objects' sizes tell
    ss.load_commit(store, forged_extra)

    sizes: list[int] = []
    real_empty = torch.empty

    def counted(*size: Any, **kw: Any) -> torch.Tensor:
        dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        sizes.append(int(torch.tensor(dims, dtype=torch.float64).prod().item()) if dims else 1)
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", counted)
    n = shape[0] * shape[1]
    for target, match in (
        (forged_state, f"optimizer state {key!r} of {e.name!r}"),
        (forged_extra, "tensor 0 of extra 'counter'"),
    ):
        fresh = _model()
        before = [t.clone() for t in fresh.state_dict().values()]
        fopt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        with pytest.raises(ss.TensorMismatch, match=f"{match}.*needs {n * 4}; refused before allocating"):
            ss.restore(store, target, fresh, fopt, extra={"counter": Counter()})
        assert all(torch.equal(a, b) for a, b in zip(before, fresh.state_dict().values()))
    assert max(sizes, default=0) < 1 << 20, "a manifest-sized tensor was allocated"


def test_state_sizes_are_queried_together_before_any_allocation():
    """The size check of torch-form state runs one query per object (a HEAD request on S3):
    they go out together, not one after another, and the restore is still bitwise."""
    import threading
    import time

    store, model, opt, cid = _sgd_commit()
    lock, now, peak = threading.Lock(), [0], [0]
    real = store.object_size

    def slow_size(oid: str) -> int | None:
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.02)  # a round trip
        with lock:
            now[0] -= 1
        return real(oid)

    store.object_size = slow_size  # type: ignore[method-assign]
    fresh = _model()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    ss.restore(store, cid, fresh, fopt)
    assert peak[0] > 1, "the state objects' sizes were queried one at a time"
    for p, q in zip(opt.state.values(), fopt.state.values()):
        assert torch.equal(p["momentum_buffer"], q["momentum_buffer"])
