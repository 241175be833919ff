"""``shardstore.lightning`` (issue 31, item 1): Lightning's checkpoints in a store through Lightning's
own paths — ``Trainer(plugins=[ShardstoreCheckpointIO(url)])``, ``ModelCheckpoint``'s retention,
``fit(ckpt_path=...)`` in a fresh process resuming bitwise, ``load_from_checkpoint`` — with the
checkpoint-name ↔ ref mapping, the values refused by key path, and the import isolation."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import re
import sys
import traceback
import warnings
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.parsing import AttributeDict as PlAttributeDict

import shardstore as ss
from shardstore.checkpoint import state_dict as state_dict_module
from shardstore.errors import InvalidName, ManifestError, StorageError, TargetNotFound, UnsupportedState
from shardstore.format.names import check_ref_name
from shardstore.lightning import TYPES_KEY, ShardstoreCheckpointIO, decode_segment, encode_segment
from shardstore.ops.transfer import commit_closure
from shardstore_cli.shardstore_cli import main as shardstore_main
from shardtrain.run.lifecycle import DETERMINISTIC_ENV
from shardtrain.workers import forkserver

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
EPOCHS = 3  # of 4 steps each


class Net(pl.LightningModule):
    """49 weights, AdamW, a per-epoch StepLR; hyperparameters holding a Namespace and an AttributeDict."""

    def __init__(self, lr: float = 0.05, cfg: Any = None, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def hparams() -> dict[str, Any]:
    return {"cfg": argparse.Namespace(depth=2, names=["a", "b"]), "extra": AttributeDict(seed=3, sizes=(4, 8))}


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


def make_trainer(epochs: int, dirpath: str, io: ShardstoreCheckpointIO, callbacks: tuple = (), **ck: Any) -> pl.Trainer:
    """Checkpoints every epoch; the 2 latest and ``last.ckpt`` kept (``monitor="step"``: deterministic)."""
    checkpoint = ModelCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=2, save_last=True, **ck)
    return pl.Trainer(
        max_epochs=epochs,
        plugins=[io],
        callbacks=[checkpoint, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=dirpath,
    )


def same(a: Any, b: Any, path: str = "$") -> None:
    """Type-exact equality; tensors bitwise, with their dtype."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, argparse.Namespace):
        same(vars(a), vars(b), path)
    elif isinstance(a, dict):
        assert list(a) == list(b) if isinstance(a, OrderedDict) else a.keys() == b.keys(), (path, a.keys(), b.keys())
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def replace_text(v: Any, old: str, new: str) -> Any:
    """``v`` with ``old`` replaced by ``new`` in every string, keys included (checkpoint paths of another run)."""
    if isinstance(v, str):
        return v.replace(old, new)
    if isinstance(v, dict):
        return type(v)((replace_text(k, old, new), replace_text(x, old, new)) for k, x in v.items())
    if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
        return type(v)(replace_text(x, old, new) for x in v)
    return v


# -- fresh processes -------------------------------------------------------------------------------


def _child(runs: tuple[tuple[Any, tuple[Any, ...]], ...], env: dict[str, str], streams: forkserver.StdStreams) -> None:
    """Import Lightning once, then run each of ``runs`` in a process of its own, forked from this one
    before it trained anything, one after the other: each starts as fresh as a new interpreter."""
    forkserver.adopt(env, streams)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and loggers
    for fn, args in runs:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fn(*args)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"{fn.__name__} failed: its traceback is above")


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def in_fresh_processes(*runs: tuple[Any, tuple[Any, ...]], timeout: float = 300) -> None:
    """Each ``fn(*args)`` of ``runs``, in turn, in a new process under ``DETERMINISTIC_ENV`` (torch
    imported under it by the suite's forkserver, else spawned), holding nothing of this test's state
    or of the runs before it: both sides of a bitwise comparison."""
    ctx = forkserver.context(DETERMINISTIC_ENV)
    env = forkserver.child_environment(DETERMINISTIC_ENV)
    p = ctx.Process(target=_child, args=(runs, env, forkserver.StdStreams()))
    with _environ(DETERMINISTIC_ENV):
        p.start()
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join()
    assert p.exitcode == 0, f"exit code {p.exitcode}: the traceback is in the captured stderr"


class Progress(Callback):
    """Where training started and how many batches it trained, written to a JSON file at the end."""

    def __init__(self, out: str) -> None:
        self.out, self.start, self.batches = out, None, 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = trainer.global_step

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        Path(self.out).write_text(json.dumps({"start": self.start, "batches": self.batches}))


def _uninterrupted_and_interrupted(tmp: str) -> None:
    """Run A: all epochs, then its final state saved. Run B: one epoch, then the process ends."""
    a = make_trainer(EPOCHS, f"{tmp}/a", ShardstoreCheckpointIO(f"{tmp}/store-a"))
    a.fit(Net(**hparams()), loader())
    a.save_checkpoint(f"{tmp}/a/final.ckpt")
    make_trainer(1, f"{tmp}/b", ShardstoreCheckpointIO(f"{tmp}/store-b")).fit(Net(**hparams()), loader())


def _resumed(tmp: str) -> None:
    """Run B, resumed: a new process, a new module, Lightning's own ``ckpt_path="last"``."""
    progress = Progress(f"{tmp}/progress.json")
    c = make_trainer(EPOCHS, f"{tmp}/b", ShardstoreCheckpointIO(f"{tmp}/store-b"), callbacks=(progress,))
    c.fit(Net(**hparams()), loader(), ckpt_path="last")
    c.save_checkpoint(f"{tmp}/b/final.ckpt")


@pytest.mark.long  # fresh processes: .ci/run's second step, for the test command's 8 minutes
def test_interrupted_and_resumed_in_a_fresh_process_is_bitwise_the_uninterrupted_run(tmp_path: Path) -> None:
    tmp = str(tmp_path)
    in_fresh_processes((_uninterrupted_and_interrupted, (tmp,)), (_resumed, (tmp,)))
    # C resumed at B's step 4 and trained only the rest (a run from scratch would end equal too)
    assert json.loads((tmp_path / "progress.json").read_text()) == {"start": 4, "batches": 4 * (EPOCHS - 1)}
    # the final states Lightning dumped: weights, AdamW's moments and steps, StepLR, loops, callbacks,
    # epoch, global step, hyperparameters (Namespace and AttributeDict as themselves) — A's and C's
    a = ShardstoreCheckpointIO(tmp_path / "store-a").load_checkpoint(tmp_path / "a" / "final.ckpt")
    c = ShardstoreCheckpointIO(tmp_path / "store-b").load_checkpoint(tmp_path / "b" / "final.ckpt")
    assert c["global_step"] == 4 * EPOCHS and c["epoch"] == EPOCHS
    assert c["optimizer_states"][0]["state"][0]["step"] == torch.tensor(4.0 * EPOCHS)
    assert type(c["hyper_parameters"]["cfg"]) is argparse.Namespace
    same(replace_text(a, f"{tmp}/a", f"{tmp}/b"), c)


# -- one trained run, shared by the in-process tests -----------------------------------------------


class RecordingIO(ShardstoreCheckpointIO):
    """Notes the commit each save made, so that a test can follow a checkpoint Lightning removed."""

    saved: list[tuple[str, str]]

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saved.append((os.path.basename(path), self.store.ref(self.ref_for(path))))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("lightning")
    io = RecordingIO(tmp / "store")
    io.saved = []
    model = Net(**hparams())
    trainer = make_trainer(EPOCHS, str(tmp / "ckpts"), io)
    trainer.fit(model, loader())
    return SimpleNamespace(io=io, dir=tmp / "ckpts", store=io.store, trainer=trainer, model=model, tmp=tmp)


def test_top_k_and_last_are_refs_and_gc_reclaims_what_only_a_removed_checkpoint_held(
    trained: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    io, store = trained.io, trained.store
    kept = ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"]
    assert sorted(os.listdir(trained.dir)) == kept  # Lightning's retention, on its own files
    refs = store.refs()
    assert sorted(refs) == sorted(io.ref_for(trained.dir / n) for n in kept)
    assert "lightning/epoch_3d1-step_3d8.ckpt" in refs
    assert all(json.loads((trained.dir / n).read_text())["commit"] == refs[io.ref_for(n)] for n in kept)
    # epoch 0's checkpoint was saved, then removed by ModelCheckpoint (save_top_k=2): its ref is gone
    removed = dict(trained.io.saved)["epoch=0-step=4.ckpt"]
    assert removed not in refs.values() and store.has(removed)
    live = set().union(*(commit_closure(ss.load_commit(store, c)).ids() for c in set(refs.values())))
    only_removed = commit_closure(ss.load_commit(store, removed)).ids() - live
    assert len(only_removed) > 5  # its manifests, its weights and moments
    assert shardstore_main(["gc", str(store.url), "--grace", "0"]) == 0
    capsys.readouterr()
    assert not any(store.has(o) for o in only_removed)
    assert all(store.has(o) for o in live)
    assert ss.verify(store, sorted(refs)).ok


@pytest.mark.parametrize("form", ["path", "last", "ref", "commit", "prefix", "name-without-marker"])
def test_fit_restores_every_form_of_ckpt_path(trained: SimpleNamespace, form: str, tmp_path: Path) -> None:
    io, last = trained.io, trained.dir / "last.ckpt"
    commit = trained.store.ref("lightning/last.ckpt")
    ckpt_path, callbacks, enable = {
        "path": (str(last), [], False),
        "last": ("last", [ModelCheckpoint(dirpath=trained.dir, save_top_k=0)], True),  # Lightning lists the dir
        "ref": ("lightning/last.ckpt", [], False),
        "commit": (commit, [], False),
        "prefix": (commit[:12], [], False),
        "name-without-marker": (str(tmp_path / "elsewhere" / "last.ckpt"), [], False),  # no file: the name's ref
    }[form]
    model = Net()  # default hyperparameters: the checkpoint's weights and state replace these
    trainer = pl.Trainer(
        max_epochs=EPOCHS,  # reached: fit restores everything, then has nothing left to train
        plugins=[io],
        callbacks=callbacks,
        enable_checkpointing=enable,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    saved = io.load_checkpoint(last)
    assert trainer.global_step == saved["global_step"] == 4 * EPOCHS and trainer.current_epoch == EPOCHS
    same(model.state_dict(), saved["state_dict"])
    same(model.state_dict(), trained.model.state_dict())
    restored = trainer.optimizers[0].state_dict()
    for i, state in saved["optimizer_states"][0]["state"].items():
        for k, t in state.items():
            assert torch.equal(restored["state"][i][k], t), (i, k)
    assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == saved["lr_schedulers"][0]


def test_load_from_checkpoint_builds_the_module_from_the_store(trained: SimpleNamespace) -> None:
    io, commit = trained.io, trained.store.ref("lightning/last.ckpt")
    for target in (trained.dir / "last.ckpt", "lightning/last.ckpt", commit):
        model = io.load_from_checkpoint(Net, target)
        assert type(model) is Net
        same(model.state_dict(), trained.model.state_dict())
        assert model.hparams.cfg == hparams()["cfg"] and type(model.hparams.cfg) is argparse.Namespace
        assert model.hparams.extra == hparams()["extra"] and type(model.hparams.extra) is AttributeDict
        assert model.hparams.lr == 0.05
    assert io.load_from_checkpoint(Net, commit, lr=0.5).hparams.lr == 0.5  # kwargs override, as Lightning's do


# -- module=: a resume reads the weights into the module -------------------------------------------


class LoadedIO(ShardstoreCheckpointIO):
    """Keeps what each load_checkpoint returned, to see where its weights live."""

    loaded: list[dict[str, Any]]

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        got = super().load_checkpoint(path, map_location, weights_only)
        self.loaded.append(got)
        return got


class CopyingNet(Net):
    """A module whose state_dict() hands out copies of its tensors, not views of them."""

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return OrderedDict((k, v.clone()) for k, v in super().state_dict(*args, **kwargs).items())


def resume(store: ss.Store, ckpt: Path, model: pl.LightningModule, epochs: int, tmp: Path, **io: Any) -> pl.Trainer:
    plugin = LoadedIO(store, **io)
    plugin.loaded = []
    trainer = pl.Trainer(
        max_epochs=epochs,
        plugins=[plugin],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(tmp),
    )
    trainer.fit(model, loader(), ckpt_path=str(ckpt))
    return trainer


def test_with_module_a_resume_reads_the_weights_into_the_modules_own_tensors(
    trained: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    last = trained.dir / "last.ckpt"
    stored = trained.io.load_checkpoint(last)["state_dict"]
    model = Net()
    before = {k: (t.data_ptr(), t.clone()) for k, t in model.state_dict().items()}
    assert all(not torch.equal(t, stored[k]) for k, (_, t) in before.items())  # the bytes must land
    opened: list[str] = []
    load_commit = state_dict_module.load_commit
    monkeypatch.setattr(state_dict_module, "load_commit", lambda st, t: (opened.append(t), load_commit(st, t))[1])
    trainer = resume(trained.store, last, model, EPOCHS, tmp_path, module=model)
    assert len(opened) == 1  # the commit's manifests and tree read once: to choose what to read into, then to read
    (got,) = trainer.strategy.checkpoint_io.loaded
    live = model.state_dict()
    for k, (ptr, _) in before.items():
        assert live[k].data_ptr() == ptr  # the module's own storage, never replaced
        assert got["state_dict"][k].data_ptr() == ptr  # the checkpoint's weight is the module's tensor
        assert torch.equal(live[k], stored[k]) and live[k].dtype == stored[k].dtype
    same(model.state_dict(), trained.model.state_dict())
    # the optimizer's state is read fresh, and restored as ever
    restored = trainer.optimizers[0].state_dict()["state"]
    for i, state in trained.io.load_checkpoint(last)["optimizer_states"][0]["state"].items():
        assert all(torch.equal(restored[i][k], t) for k, t in state.items())


def test_with_module_training_on_from_a_resume_is_bitwise_the_resume_without_it(
    trained: SimpleNamespace, tmp_path: Path
) -> None:
    last, runs = trained.dir / "last.ckpt", {}
    for how in ("fresh", "in place"):
        model = Net()
        extra = {"module": model} if how == "in place" else {}
        trainer = resume(trained.store, last, model, EPOCHS + 1, tmp_path / how.replace(" ", "-"), **extra)
        assert trainer.global_step == 4 * (EPOCHS + 1)
        runs[how] = (model.state_dict(), trainer.optimizers[0].state_dict())
    same(runs["in place"][0], runs["fresh"][0])
    assert not torch.equal(runs["fresh"][0]["net.0.weight"], trained.model.state_dict()["net.0.weight"])  # it trained
    for i, state in runs["fresh"][1]["state"].items():
        assert all(torch.equal(runs["in place"][1]["state"][i][k], t) for k, t in state.items())


@pytest.mark.parametrize("kind", ["copies", "float64"])
def test_with_module_a_module_that_cannot_be_read_into_still_resumes(
    trained: SimpleNamespace, tmp_path: Path, kind: str
) -> None:
    """state_dict() handing out copies: read into them, Lightning copies them in. Another dtype:
    refused before any byte landed, so read fresh, and torch's load_state_dict converts as ever."""
    last = trained.dir / "last.ckpt"
    model = CopyingNet() if kind == "copies" else Net().double()
    trainer = resume(trained.store, last, model, EPOCHS, tmp_path, module=model)
    (got,) = trainer.strategy.checkpoint_io.loaded
    want = trained.model.state_dict()
    for k, t in model.state_dict().items():
        assert torch.equal(t, want[k].to(t.dtype)) and t.dtype == (torch.float32 if kind == "copies" else torch.float64)
        assert got["state_dict"][k].dtype == torch.float32  # as stored
    params = {p.data_ptr() for p in model.parameters()}
    assert not any(t.data_ptr() in params for t in got["state_dict"].values())  # the module's own were not read into


def test_with_module_load_from_checkpoint_never_reads_into_the_attached_module(
    trained: SimpleNamespace, tmp_path: Path
) -> None:
    first = trained.dir / "epoch=1-step=8.ckpt"
    model = Net()
    trainer = resume(trained.store, first, model, 2, tmp_path, module=model)  # attached, loading through the plugin
    io = trainer.strategy.checkpoint_io
    before = OrderedDict((k, t.clone()) for k, t in model.state_dict().items())
    built = io.load_from_checkpoint(Net, trained.dir / "last.ckpt")
    same(built.state_dict(), trained.model.state_dict())
    same(model.state_dict(), before)
    assert not torch.equal(before["net.0.weight"], trained.model.state_dict()["net.0.weight"])  # it would show


def test_with_module_a_load_outside_the_modules_trainer_leaves_the_module_alone(trained: SimpleNamespace) -> None:
    model = Net()
    before = OrderedDict((k, t.clone()) for k, t in model.state_dict().items())
    io = ShardstoreCheckpointIO(trained.store, module=model)
    got = io.load_checkpoint(trained.dir / "last.ckpt")  # not attached to a Trainer: read fresh
    same(got["state_dict"], trained.model.state_dict())
    same(model.state_dict(), before)
    built = io.load_from_checkpoint(Net, trained.dir / "last.ckpt")  # another module: never read into this one
    same(built.state_dict(), trained.model.state_dict())
    same(model.state_dict(), before)
    with pytest.raises(TypeError, match="LightningModule"):
        ShardstoreCheckpointIO(trained.store, module=torch.nn.Linear(2, 2))


# -- names ------------------------------------------------------------------------------------------

NAMES = [
    ("epoch=0-step=8.ckpt", "epoch_3d0-step_3d8.ckpt"),
    ("last.ckpt", "last.ckpt"),
    ("last-v1.ckpt", "last-v1.ckpt"),
    ("epoch=2-val_loss=0.12.ckpt", "epoch_3d2-val__loss_3d0.12.ckpt"),
    ("_3d", "__3d"),
    ("__", "____"),
    (".hidden", "_2ehidden"),
    ("-x", "_2dx"),
    ("x.lock", "x_2elock"),
    ("a b%/c"[:4], "a_20b_25"),
    ("é", "_c3_a9"),
]


@pytest.mark.parametrize("name,segment", NAMES)
def test_a_checkpoint_name_maps_to_a_ref_and_back(name: str, segment: str, tmp_path: Path) -> None:
    assert encode_segment(name) == segment and decode_segment(segment) == name
    io = ShardstoreCheckpointIO(tmp_path / "store", prefix="runs/exp1")
    ref = io.ref_for(tmp_path / "ckpts" / name)
    assert ref == f"runs/exp1/{segment}" and check_ref_name(ref) == ref
    assert io.path_for(ref) == name


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=24).filter(lambda s: "/" not in s and s not in (".", "..")))
def test_every_name_that_fits_round_trips_through_a_valid_ref_segment(name: str) -> None:
    try:
        segment = encode_segment(name)
    except InvalidName as e:  # too long once escaped, or not encodable text (a lone surrogate)
        assert "64" in str(e) or "Unicode" in str(e)
        return
    assert check_ref_name(segment) == segment and decode_segment(segment) == name


def test_with_root_the_directories_under_it_are_ref_segments(tmp_path: Path) -> None:
    io = ShardstoreCheckpointIO(tmp_path / "store", root=tmp_path / "ckpts")
    path = tmp_path / "ckpts" / "epoch=0" / "model.ckpt"  # ModelCheckpoint(filename="{epoch}/model")
    assert io.ref_for(path) == "lightning/epoch_3d0/model.ckpt"
    assert io.path_for("lightning/epoch_3d0/model.ckpt") == str(path)
    with pytest.raises(InvalidName, match="not under root"):
        io.ref_for(tmp_path / "elsewhere" / "model.ckpt")
    with pytest.raises(InvalidName, match="at most 3"):
        io.ref_for(tmp_path / "ckpts" / "a" / "b" / "c" / "d.ckpt")


@pytest.mark.parametrize(
    "bad", ["", "..", "e" * 62 + "=", "x" * 65], ids=["empty", "dotdot", "too-long-escaped", "too-long"]
)
def test_a_name_no_ref_can_hold_is_refused_before_anything_is_written(bad: str, tmp_path: Path) -> None:
    io = ShardstoreCheckpointIO(tmp_path / "store")
    with pytest.raises(InvalidName):
        io.save_checkpoint({"global_step": 0, "w": torch.ones(2)}, str(tmp_path / "ckpts") + "/" + bad)
    assert io.store.refs() == {} and not list(io.store.objects())


@pytest.mark.parametrize("segment", ["_41", "_3D", "_5f", "a_", "-x", ".x", "x.lock", "a_zz", ""])
def test_a_segment_that_is_no_names_canonical_encoding_is_refused(segment: str) -> None:
    with pytest.raises(InvalidName):
        decode_segment(segment)


# -- values -----------------------------------------------------------------------------------------


def test_attribute_dicts_and_namespaces_come_back_as_themselves_anywhere(tmp_path: Path) -> None:
    io = ShardstoreCheckpointIO(tmp_path / "store")
    checkpoint = {
        "global_step": 3,
        "state_dict": OrderedDict(w=torch.arange(3.0)),
        "hyper_parameters": {
            "cfg": argparse.Namespace(a=1, nested=AttributeDict(b=(1, 2), t=torch.ones(2))),
            "runs": [PlAttributeDict(x=1), (argparse.Namespace(), 2)],
            "plain": {"c": 1},
        },
    }
    io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    back = io.load_checkpoint(tmp_path / "x.ckpt")
    assert TYPES_KEY not in back
    same(back, checkpoint)
    assert back["hyper_parameters"]["cfg"].nested.b == (1, 2)
    tree = ss.read_state_dict(io.store, "lightning/x.ckpt")  # the stored form: plain dicts, and the list of types
    assert type(tree["hyper_parameters"]["cfg"]) is dict
    assert sorted(tuple(m[1]) for m in tree[TYPES_KEY]) == [
        ("hyper_parameters", "cfg"),
        ("hyper_parameters", "cfg", "nested"),
        ("hyper_parameters", "runs", 0),
        ("hyper_parameters", "runs", 1, 0),
    ]


@pytest.mark.parametrize(
    "checkpoint,says",
    [
        ({"hyper_parameters": {"ids": {1, 2}}}, r"\$\.hyper_parameters\.ids: a builtins\.set"),
        (
            {"hyper_parameters": {"cfg": argparse.Namespace(ids={1})}},
            r"\$\.hyper_parameters\.cfg\.ids: a builtins\.set",
        ),
        ({"hparams_type": AttributeDict}, r"\$\.hparams_type: a builtins\.type"),  # what omegaconf hparams add
        ({"callbacks": {"Timer": {"f": lambda: 0}}}, r"\$\.callbacks\.Timer\.f: a builtins\.function"),
        ({TYPES_KEY: []}, re.escape(f"$.{TYPES_KEY}: a key ShardstoreCheckpointIO keeps")),
    ],
)
def test_what_cannot_be_stored_exactly_is_refused_by_key_path_before_a_write(
    checkpoint: dict[str, Any], says: str, tmp_path: Path
) -> None:
    io = ShardstoreCheckpointIO(tmp_path / "store")
    with pytest.raises(UnsupportedState, match=says):
        io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(2)}, **checkpoint}, tmp_path / "x.ckpt")
    assert io.store.refs() == {} and not list(io.store.objects()) and not (tmp_path / "x.ckpt").exists()


def test_a_forged_types_list_is_refused_on_load(tmp_path: Path) -> None:
    io = ShardstoreCheckpointIO(tmp_path / "store")
    for i, (marks, says) in enumerate(
        [
            ([["namespace", ["x"]]], r"names \$\.x as a namespace, but the state dict holds a int"),
            ([["namespace", ["nope", 0]]], r"names \$\[.nope.\], which the state dict does not hold"),
            ([["pickle", ["x"]]], r"holds \['pickle', \['x'\]\], not \[type, key path\]"),
        ]
    ):
        ss.save_state_dict(io.store, {"x": 3, TYPES_KEY: marks}, ref=f"lightning/forged{i}")
        with pytest.raises(ManifestError, match=says):
            io.load_checkpoint(f"lightning/forged{i}")


def test_with_module_a_forged_types_list_is_refused_before_a_byte_lands_in_the_module(tmp_path: Path) -> None:
    # The types list was checked after the weights were read into the attached module: the resume
    # was refused (ManifestError) with the module already holding the commit's weights.
    model = Net()
    io = ShardstoreCheckpointIO(tmp_path / "store", module=model)
    stored = {k: t + 1 for k, t in model.state_dict().items()}
    ss.save_state_dict(io.store, {"state_dict": stored, TYPES_KEY: [["namespace", ["nope"]]]}, ref="lightning/forged")
    before = {k: t.clone() for k, t in model.state_dict().items()}
    trainer = pl.Trainer(
        max_epochs=1,
        plugins=[io],
        enable_checkpointing=False,
        logger=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    with pytest.raises(ManifestError, match=r"names \$\[.nope.\], which the state dict does not hold"):
        trainer.fit(model, loader(), ckpt_path="lightning/forged")
    same(model.state_dict(), OrderedDict(before))


# -- resolving, removing ----------------------------------------------------------------------------


def test_resolve_names_what_it_cannot_find_and_never_unpickles(tmp_path: Path) -> None:
    io = ShardstoreCheckpointIO(tmp_path / "store")
    io.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, tmp_path / "a.ckpt")
    with pytest.raises(TargetNotFound, match="names no checkpoint"):
        io.resolve(tmp_path / "b.ckpt")
    torch.save({"w": torch.ones(2)}, tmp_path / "torch.ckpt")  # TorchCheckpointIO's file: not ours, not unpickled
    with pytest.raises(ManifestError, match="not a shardstore checkpoint marker"):
        io.load_checkpoint(tmp_path / "torch.ckpt")
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(ManifestError, match="is a directory"):
        io.load_checkpoint(tmp_path / "dir.ckpt")
    marker = json.loads((tmp_path / "a.ckpt").read_text())
    other = ShardstoreCheckpointIO(tmp_path / "other-store")
    with pytest.raises(TargetNotFound, match=f"names commit {marker['commit']}"):
        other.load_checkpoint(tmp_path / "a.ckpt")


def test_a_marker_loads_its_own_commit_and_removing_it_keeps_a_ref_that_moved(tmp_path: Path) -> None:
    io = ShardstoreCheckpointIO(tmp_path / "store")
    io.save_checkpoint({"global_step": 1, "w": torch.zeros(2)}, tmp_path / "a" / "last.ckpt")
    io.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, tmp_path / "b" / "last.ckpt")  # same name: same ref
    with pytest.warns(UserWarning, match="has moved"):
        assert io.load_checkpoint(tmp_path / "a" / "last.ckpt")["global_step"] == 1  # the file's own commit
    io.remove_checkpoint(tmp_path / "a" / "last.ckpt")
    assert not (tmp_path / "a" / "last.ckpt").exists()
    assert io.load_checkpoint(tmp_path / "b" / "last.ckpt")["global_step"] == 2  # b's ref was not a's to delete
    io.remove_checkpoint(tmp_path / "b" / "last.ckpt")
    assert io.store.refs() == {}
    io.remove_checkpoint(tmp_path / "b" / "last.ckpt")  # gone already: nothing to do, as TorchCheckpointIO


def test_a_link_save_last_made_is_only_unlinked_and_loads_what_it_points_at(tmp_path: Path) -> None:
    io = ShardstoreCheckpointIO(tmp_path / "store")
    io.save_checkpoint({"global_step": 4, "w": torch.ones(2)}, tmp_path / "epoch=0-step=4.ckpt")
    os.symlink("epoch=0-step=4.ckpt", tmp_path / "last.ckpt")  # ModelCheckpoint(save_last="link")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 4
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert not os.path.lexists(tmp_path / "last.ckpt") and list(io.store.refs()) == [
        "lightning/epoch_3d0-step_3d4.ckpt"
    ]
    (tmp_path / "foreign.ckpt").write_bytes(b"\x80\x02}q\x00.")  # a pickle someone left: refused, kept
    with pytest.raises(ManifestError, match="not a shardstore checkpoint marker"):
        io.remove_checkpoint(tmp_path / "foreign.ckpt")
    assert (tmp_path / "foreign.ckpt").exists()


def test_storage_options_at_save_are_refused_as_lightning_does(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="storage_options"):
        ShardstoreCheckpointIO(tmp_path / "store").save_checkpoint({}, tmp_path / "x.ckpt", storage_options={})
    (tmp_path / "file").write_text("")
    with pytest.raises(StorageError, match="marker file could not be written"):
        ShardstoreCheckpointIO(tmp_path / "store").save_checkpoint({"w": torch.ones(1)}, tmp_path / "file" / "x.ckpt")


def test_the_plugin_crosses_to_another_process_as_its_url(tmp_path: Path) -> None:
    """Spawning strategies copy the Trainer and its plugins: the store goes as its URL and opens there."""
    io = ShardstoreCheckpointIO(tmp_path / "store", prefix="runs/a")
    io.save_checkpoint({"global_step": 5, "w": torch.ones(2)}, tmp_path / "x.ckpt")
    clone = copy.deepcopy(io)  # what pickling for a spawned process does: __getstate__ / __setstate__
    assert clone.load_checkpoint(tmp_path / "x.ckpt")["global_step"] == 5 and clone.ref_for("x.ckpt") == "runs/a/x.ckpt"


# -- packaging ---------------------------------------------------------------------------------------


def test_the_plugin_is_lightnings_checkpoint_io() -> None:
    # that importing shardstore imports no Lightning: tests/shardstore/test_adapters_layer.py
    assert pl.Trainer(plugins=[ShardstoreCheckpointIO("memory://x")], logger=False).strategy.checkpoint_io


def test_readme_lightning_example_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    block = re.search(r"### Using shardstore from Lightning\s.*?```python\n(.*?)```", README, re.S).group(1)
    code = block.replace("/tmp/lightning-store", str(tmp_path / "store")).replace(
        "/tmp/lightning-run", str(tmp_path / "run")
    )
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})  # in this process: it compares nothing across
    assert f"Restored all states from the checkpoint at {tmp_path / 'run' / 'last.ckpt'}" in caplog.text
    out = capsys.readouterr().out
    assert "step 16, lr 0.01, refs ['lightning/epoch_3d3-step_3d16.ckpt', 'lightning/last.ckpt']" in out, out
