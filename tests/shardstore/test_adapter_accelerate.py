"""accelerate's prepared objects in shardstore (issue 31, item 3): ``shardstore.accelerate``'s
``save_accelerator_state`` / ``load_accelerator_state``, and ``save`` / ``restore`` /
``save_state_dict`` taking ``Accelerator.prepare``d objects as they come.

The resume test runs a tiny loop (gradient accumulation, dropout, a shuffled torchdata
``StatefulDataLoader``, a scheduler, a registered counter) three ways in fresh processes:
uninterrupted; stopped mid-epoch (in its second epoch) with ``save_accelerator_state``; and
resumed from that commit with ``load_accelerator_state``. Every parameter and optimizer state
tensor, the counters, the next batches and the next random numbers must be equal bit for bit.
This file is also the script those processes run (``python tests/shardstore/test_adapter_accelerate.py``).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import shardstore
from shardstore.errors import StateMismatch, UnsupportedState

ROOT = Path(__file__).resolve().parents[2]
#: What the trainer's workers pin (shardtrain.run.lifecycle.DETERMINISTIC_ENV): the CPU vendor must not matter.
DETERMINISTIC_ENV = {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

MICRO_STEPS = 13  # batches; 5 an epoch: into the third epoch
STOP_AT = 9  # the second epoch's fourth batch, right after an optimizer step (accumulation of 2, restarted by epoch)


# -- the script the fresh processes run -----------------------------------------------------------


class Seen:
    """A user's own counter, given to ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.batches = sd["batches"]


def build(*, stateful: bool = True, shuffle: bool = True, torchdata_loader: bool = True, seedable: bool = False):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    set_seed(0)
    config = DataLoaderConfiguration(use_stateful_dataloader=stateful, use_seedable_sampler=seedable)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=config)
    data = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    if torchdata_loader:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(data, batch_size=4, shuffle=shuffle)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=shuffle)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    seen = Seen()
    acc.register_for_checkpointing(seen)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched, seen


def train(acc, model, opt, loader, sched, seen, *, until: int, opt_steps: int = 0, stop=None) -> int:
    """Batches until ``seen.batches == until`` (or ``stop(opt_steps)`` at ``STOP_AT``); return the optimizer steps.
    (``acc.step`` counts batches within an accumulation window, and restarts at each epoch's end.)"""
    while seen.batches < until:
        for x, y in loader:
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                sched.step()
                opt.zero_grad()
            seen.batches += 1
            opt_steps += acc.sync_gradients
            if stop is not None and seen.batches == STOP_AT:
                stop(opt_steps)
                return opt_steps
            if seen.batches == until:
                break
    return opt_steps


def dump(out: Path, acc, model, opt, loader, sched, seen, opt_steps: int, commit: str) -> None:
    """Every tensor of the model and the optimizer, and every counter, then the next batches and draws."""
    from safetensors.torch import save_file

    tensors = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, st in opt.state_dict()["state"].items():
        tensors.update({f"optim/{i}/{k}": v.clone() for k, v in st.items()})
    save_file(tensors, str(out.with_suffix(".safetensors")))
    batch = next(iter(loader))[0]
    facts = {
        "accelerator_step": acc.step,
        "optimizer_steps": opt_steps,
        "loader_iteration": loader.iteration,
        "scheduler": {k: repr(v) for k, v in sched.state_dict().items()},
        "seen": seen.batches,
        "next_batch": [float(v).hex() for v in batch.flatten().tolist()],
        "torch": [float(v).hex() for v in torch.rand(3).tolist()],
        "python": random.random().hex(),
        "numpy": float(np.random.rand()).hex(),
        "learned_root": shardstore.open_store(str(out.parent / "final")).commit(commit).learned_root,
    }
    out.write_text(json.dumps(facts, indent=1))


def main(mode: str, out: Path) -> None:
    from shardstore.accelerate import load_accelerator_state, save_accelerator_state

    torch.set_num_threads(1)
    objs = build()
    acc, seen = objs[0], objs[-1]
    opt_steps = 0
    if mode == "stop":
        mid = shardstore.open_store(str(out.parent / "mid"))
        train(*objs, until=MICRO_STEPS, stop=lambda n: save_accelerator_state(acc, mid, step=n))
        return
    if mode == "resume":
        restored = load_accelerator_state(acc, shardstore.open_store(str(out.parent / "mid")))
        assert seen.batches == STOP_AT and acc.step == 4 and restored.rng_restored, (seen.batches, acc.step, restored)
        opt_steps = restored.step
    opt_steps = train(*objs, until=MICRO_STEPS, opt_steps=opt_steps)
    commit = save_accelerator_state(acc, shardstore.open_store(str(out.parent / "final")), step=opt_steps)
    dump(out, *objs, opt_steps, commit)


def _run(mode: str, where: Path) -> subprocess.Popen:
    where.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **DETERMINISTIC_ENV, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, __file__, mode, str(where / "result.json")]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(p: subprocess.Popen) -> None:
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]


# -- resume through accelerate's own loop, in a fresh process --------------------------------------


@pytest.mark.long  # fresh processes: .ci/run's second step, for the test command's 8 minutes
def test_resumes_bitwise_mid_epoch_in_a_fresh_process(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("torchdata.stateful_dataloader")
    from safetensors.torch import load_file

    a, b = tmp_path / "uninterrupted", tmp_path / "interrupted"
    runs = [_run("full", a), _run("stop", b)]  # two cores: both at once
    for p in runs:
        _wait(p)
    mid = shardstore.open_store(str(b / "mid"))
    assert mid.commit(mid.ref("main")).step == 5  # optimizer steps after batches 2, 4, 5 (the end of an epoch), 7 and 9
    _wait(_run("resume", b))

    ta, tb = load_file(str(a / "result.safetensors")), load_file(str(b / "result.safetensors"))
    assert sorted(ta) == sorted(tb) and any(k.endswith("exp_avg_sq") for k in ta)
    for k in ta:  # bit for bit
        assert ta[k].dtype == tb[k].dtype and torch.equal(
            ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8)
        ), k
    fa, fb = json.loads((a / "result.json").read_text()), json.loads((b / "result.json").read_text())
    assert fa == fb
    assert (
        fa["accelerator_step"] == 3
        and fa["optimizer_steps"] == 7
        and fa["loader_iteration"] == 2
        and fa["seen"] == MICRO_STEPS
    )


# -- prepared objects passed to save / restore / save_state_dict directly -------------------------


def _continue(model, opt, loader, sched, steps: int) -> list[torch.Tensor]:
    """The next ``steps`` steps of the loop (no accumulation): the batches seen and the weights after."""
    out = []
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append(x)
        if len(out) == steps:
            break
    return out + [p.detach().clone() for p in model.parameters()]


def _same(xs, ys) -> bool:
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


@pytest.fixture
def prepared():
    pytest.importorskip("accelerate")
    pytest.importorskip("torchdata.stateful_dataloader")
    return build


def test_save_and_restore_take_prepared_objects_as_they_come(tmp_path, prepared):
    acc, model, opt, loader, sched, _ = prepared()
    assert type(opt).__name__ == "AcceleratedOptimizer" and type(sched).__name__ == "AcceleratedScheduler"
    it = iter(loader)
    for _ in range(3):  # mid-epoch
        x, y = next(it)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save(store, model, opt, step=3, extra={"sched": sched}, slot_extra={"loader": loader})
    expected = []
    for x, y in it:  # the rest of this epoch, as the live loop goes on
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        expected.append(x)
    expected += [p.detach().clone() for p in model.parameters()]

    _, m2, o2, l2, s2, _ = prepared()  # fresh objects, as a new process builds them (and reseeds)
    shardstore.restore(store, cid, m2, o2, extra={"sched": s2}, slot_extra={"loader": l2})
    assert l2.state_dict()["_num_yielded"] == 3  # accelerate's copy of the state is the restored one
    assert _same(_continue(m2, o2, l2, s2, 2), expected)

    # save_state_dict: the state dicts the prepared objects hand over, whole and back
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    sd["loader"] = l2.state_dict()
    shardstore.save_state_dict(store, sd, ref="dict")
    back = shardstore.read_state_dict(store, "dict")
    assert back["loader"]["_num_yielded"] == 5 and back["scheduler"] == sched.state_dict()
    _, m3, o3, _, s3, _ = prepared()
    m3.load_state_dict(back["model"])
    o3.load_state_dict(back["optimizer"])
    s3.load_state_dict(back["scheduler"])
    assert all(torch.equal(p, q) for p, q in zip(m3.parameters(), model.parameters()))
    assert s3.get_last_lr() == sched.get_last_lr()


def test_several_models_and_optimizers_round_trip(tmp_path, prepared):
    from accelerate import Accelerator

    from shardstore.accelerate import load_accelerator_state, save_accelerator_state

    def two():
        torch.manual_seed(0)
        acc = Accelerator(cpu=True)
        a, b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
        return acc, *acc.prepare(a, b, torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters(), lr=0.1))

    acc, a, b, oa, ob = two()
    b(a(torch.randn(4, 3))).sum().backward()
    oa.step()
    ob.step()
    store = shardstore.open_store(tmp_path / "s")
    cid = save_accelerator_state(acc, store, step=1)
    assert sorted(shardstore.load_commit(store, cid).entries()) == [
        "model_0.bias", "model_0.weight", "model_1.bias", "model_1.weight"
    ]  # fmt: skip
    acc2, a2, b2, oa2, ob2 = two()
    load_accelerator_state(acc2, store)
    for x, y in ((a, a2), (b, b2)):
        assert all(torch.equal(p, q) for p, q in zip(x.state_dict().values(), y.state_dict().values()))
    for x, y in ((oa, oa2), (ob, ob2)):
        sx, sy = x.state_dict(), y.state_dict()
        assert sx["param_groups"] == sy["param_groups"] and sorted(sx["state"]) == sorted(sy["state"]) == [0, 1]
        assert all(torch.equal(v, sy["state"][i][k]) for i, st in sx["state"].items() for k, v in st.items())


def test_a_data_parallel_wrapper_is_saved_as_the_module_it_wraps(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(5, 3))  # running statistics
    wrapped = torch.nn.DataParallel(model)  # what prepare hands a multi-device run (DDP: the same rule)
    assert next(iter(wrapped.state_dict())).startswith("module.")
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save(store, wrapped, step=0, rng=False)
    assert shardstore.save(store, model, step=0, rng=False, ref=None) == cid  # one commit, no "module." names
    assert "0.weight" in shardstore.load_commit(store, cid).entries()
    again = torch.nn.DataParallel(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
    shardstore.restore(store, cid, again)
    assert all(torch.equal(a, b) for a, b in zip(again.module.state_dict().values(), model.state_dict().values()))


# -- what cannot be taken whole is refused, naming it --------------------------------------------


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_a_plain_prepared_loader_mid_epoch_is_refused(tmp_path, prepared):
    acc, model, opt, loader, sched, _ = prepared(stateful=False, torchdata_loader=False)
    assert type(loader).__name__ == "DataLoaderShard"
    it = iter(loader)
    next(it)
    store = shardstore.open_store(tmp_path / "s")
    before = _files(tmp_path / "s")
    with pytest.raises(
        UnsupportedState,
        match=r"extra 'loader': accelerate\.data_loader\.DataLoaderShard around a plain DataLoader is being iterated",
    ):
        shardstore.save(store, model, opt, step=0, slot_extra={"loader": loader})
    assert store.ref("main") is None and _files(tmp_path / "s") == before  # nothing written
    list(it)  # the epoch ends: between epochs the loader is whole again (its generators and epoch counter)
    shardstore.save(store, model, opt, step=0, slot_extra={"loader": loader})
    # accelerate's SkipDataLoader (skip_first_batches of a loader over an iterable dataset) alike
    from accelerate.data_loader import skip_first_batches

    class Numbers(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.arange(8.0))

    skipping = skip_first_batches(torch.utils.data.DataLoader(Numbers(), batch_size=2), 1)
    assert type(skipping).__name__ == "SkipDataLoader"
    it = iter(skipping)
    next(it)
    with pytest.raises(UnsupportedState, match=r"extra 'loader': accelerate\.data_loader\.SkipDataLoader around a"):
        shardstore.save(store, model, opt, step=0, slot_extra={"loader": skipping})


def test_a_stateful_loader_whose_sampler_keeps_no_state_is_refused_mid_epoch(tmp_path, prepared):
    from shardstore.accelerate import load_accelerator_state, save_accelerator_state

    acc, model, opt, loader, sched, _ = prepared(torchdata_loader=False)  # torch's RandomSampler: no state
    it = iter(loader)
    next(it)
    store = shardstore.open_store(tmp_path / "s")
    with pytest.raises(UnsupportedState, match=r"extra 'dataloader_0': .*holds no state of its sampler"):
        save_accelerator_state(acc, store, step=0)
    assert store.ref("main") is None
    # a sampler that replays its order is taken, and resumed where it was: sequential, or accelerate's
    # SeedableRandomSampler (seeded by the epoch), here in the second epoch
    for options in ({"shuffle": False}, {"seedable": True}):
        acc, model, opt, loader, sched, _ = prepared(torchdata_loader=False, **options)
        first = [x for x, _ in loader]
        it = iter(loader)
        next(it)
        cid = save_accelerator_state(acc, store, step=0)
        rest = [x for x, _ in it]
        acc2, _, _, l2, _, _ = prepared(torchdata_loader=False, **options)
        load_accelerator_state(acc2, store, cid)
        assert l2.iteration == 1 and _same([x for x, _ in l2], rest) and len(rest) == 4
        assert options.get("shuffle") is False or not _same(first[1:], rest)  # the second epoch's own order


def test_a_commit_that_does_not_fit_the_accelerator_is_refused(tmp_path, prepared):
    from shardstore.accelerate import load_accelerator_state, save_accelerator_state

    acc, *_ = prepared()
    store = shardstore.open_store(tmp_path / "s")
    save_accelerator_state(acc, store, step=0)
    with pytest.raises(StateMismatch, match=r"extra keys \['scheduler_0'\] are the accelerator's own"):
        save_accelerator_state(acc, store, step=0, extra={"scheduler_0": Seen()})
    acc.register_for_checkpointing(Seen())  # one more object than the commit holds
    weights = [p.detach().clone() for m in acc._models for p in m.parameters()]
    with pytest.raises(StateMismatch, match=r"holds commit-wide extras \['accelerator', 'custom_0', 'scheduler_0'\]"):
        load_accelerator_state(acc, store)
    assert all(torch.equal(a, p) for a, p in zip(weights, (p for m in acc._models for p in m.parameters())))


def test_state_hooks_the_recipe_cannot_run_are_refused_not_skipped(tmp_path, prepared):
    """accelerate's ``save_state`` runs ``register_save_state_pre_hook`` hooks on its output directory
    (a training script's EMA model, never prepared, is saved by one); the recipe has no directory and
    skipped them without a word, so the EMA model was silently not in the commit. Such hooks are
    refused by name, at save and at load, before anything is written or read."""
    from shardstore.accelerate import load_accelerator_state, save_accelerator_state

    acc, *_ = prepared()
    store = shardstore.open_store(tmp_path / "s")
    ema = torch.nn.Linear(3, 1)

    def save_ema(models, weights, output_dir):
        torch.save(ema.state_dict(), os.path.join(output_dir, "ema.pt"))

    handle = acc.register_save_state_pre_hook(save_ema)
    with pytest.raises(UnsupportedState, match=r"register_save_state_pre_hook hooks \[.*save_ema'\]"):
        save_accelerator_state(acc, store, step=0)
    assert list(store.objects()) == [] and store.refs() == {}
    handle.remove()
    cid = save_accelerator_state(acc, store, step=0, extra={"ema": ema})  # the object handed over instead
    handle = acc.register_load_state_pre_hook(lambda models, input_dir: None)
    weights = [p.detach().clone() for m in acc._models for p in m.parameters()]
    with pytest.raises(UnsupportedState, match="register_load_state_pre_hook hooks"):
        load_accelerator_state(acc, store, cid, extra={"ema": ema})
    assert all(torch.equal(a, p) for a, p in zip(weights, (p for m in acc._models for p in m.parameters())))
    handle.remove()
    assert load_accelerator_state(acc, store, cid, extra={"ema": ema}).step == 0


# -- packaging: no framework import; the README example runs --------------------------------------


def test_readme_accelerate_example_runs(tmp_path, capsys):
    """Run in this process (the example starts no process of its own): a torch import saved."""
    pytest.importorskip("accelerate")
    pytest.importorskip("torchdata.stateful_dataloader")
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"### Using shardstore from accelerate\s.*?```python\n(.*?)```", readme, re.S).group(1)
    code = block.replace("/tmp/accelerate-store", str(tmp_path / "store"))
    exec(compile(code, "README.md (Using shardstore from accelerate)", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert re.fullmatch(r"commit [0-9a-f]{64} step 3 resumed at batch 3 of epoch 0\n", out), out


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
