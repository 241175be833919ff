"""The dict-level API (SPEC.md §9.6; ``shardstore/checkpoint/state_dict.py``, ``state/documents.py``):
a nested state dict as frameworks hand it over, saved without pickle and read back type-exact,
into fresh tensors or into a caller's own (DTensors: their share only)."""

from __future__ import annotations

import pathlib
import re
from collections import OrderedDict, defaultdict, namedtuple

import blake3
import msgspec
import numpy as np
import pytest
import torch
from gloo_group import run_group

import shardstore
from shardstore.checkpoint import state_dict as state_dict_module
from shardstore.errors import StateMismatch, TensorMismatch, UnsupportedState
from shardstore.format.roots import learned_root
from shardstore.ops.diff import diff
from shardstore_cli.shardstore_cli import main as shardstore_main


def same(a, b, path="$"):
    """Type-exact equality: every container and leaf of the same type, tensors bitwise with their dtype."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b) if isinstance(a, OrderedDict) else a.keys() == b.keys(), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def lightning_checkpoint() -> dict:
    """The dict Lightning's ``CheckpointIO.save_checkpoint`` is handed (its keys and value types)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    adam = torch.optim.AdamW(model[0].parameters(), lr=1e-3, betas=(0.9, 0.95))
    sgd = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.5)
    for _ in range(2):
        model(torch.randn(5, 3)).square().sum().backward()
        adam.step(), sgd.step(), sched.step()
    return {
        "epoch": 1,
        "global_step": 8,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),  # an OrderedDict, BatchNorm's int64 counter included
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2, "completed": 1}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}": {
                "best_model_score": torch.tensor(0.25),
                "best_k_models": {"/tmp/run/epoch=0-step=8.ckpt": torch.tensor(0.25)},
                "dirpath": "/tmp/run",
                "kth_value": torch.tensor(float("inf")),
            }
        },
        "optimizer_states": [adam.state_dict(), sgd.state_dict()],  # integer keys, tuples, 0-d step tensors
        "lr_schedulers": [sched.state_dict()],
        "hyper_parameters": {
            "root": pathlib.Path("/data/shards"),
            "dtype": torch.bfloat16,
            "device": torch.device("cpu"),
            "shape": torch.Size([4, 2]),
            "betas": (0.9, 0.95),
            "layers": [3, 4, 2],
            "note": "f64:not a real",  # a string with a reserved prefix
            "warmup": None,
            "lr": 1e-3,
            "flag": True,
        },
    }


def test_a_lightning_checkpoint_round_trips_type_exact(tmp_path):
    ck = lightning_checkpoint()
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save_state_dict(store, ck, step=ck["global_step"])
    back = shardstore.read_state_dict(store, "main")
    same(ck, back)
    assert not any(back["state_dict"][k] is ck["state_dict"][k] for k in ck["state_dict"])  # fresh tensors
    lc = shardstore.load_commit(store, cid)
    assert lc.commit.step == 8
    # every tensor is a tensor entry named by its key path; the rest is the commit's tree
    entries = lc.entries()
    assert "state_dict/0.weight" in entries and "optimizer_states/0/state/0/exp_avg" in entries
    assert "optimizer_states/1/state/0/momentum_buffer" in entries
    assert shardstore.verify(store).ok
    # loading it the frameworks' way: torch's own load_state_dict takes what came back
    torch.optim.AdamW(torch.nn.Linear(3, 4).parameters()).load_state_dict(back["optimizer_states"][0])


def test_read_state_dict_asks_each_objects_size_once(tmp_path, monkeypatch):
    """The sizes bound the fresh tensors' allocation, checked once: not again before the reads
    (on S3 each check is a HEAD request, one round trip per object)."""
    store = shardstore.open_store(tmp_path / "s")
    shardstore.save_state_dict(store, lightning_checkpoint())
    asked: defaultdict[str, int] = defaultdict(int)
    size = store.object_size

    def counted(oid):
        asked[oid] += 1
        return size(oid)

    monkeypatch.setattr(store, "object_size", counted)
    back = shardstore.read_state_dict(store, "main")
    payloads = {e.param for e in shardstore.load_commit(store, "main").entries().values()}
    assert payloads <= set(asked) and max(asked.values()) == 1, dict(asked)
    same(lightning_checkpoint(), back)


def test_a_checkpoint_lightning_itself_dumps_round_trips_type_exact(tmp_path):
    pl = pytest.importorskip("lightning.pytorch", reason="Lightning's own checkpoint dict under test")

    class Tiny(pl.LightningModule):
        def __init__(self, root: pathlib.Path = pathlib.Path("/data"), dtype: torch.dtype = torch.bfloat16) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch, i):
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        default_root_dir=str(tmp_path / "run"),
    )  # fmt: skip
    trainer.fit(Tiny(), data)
    ck = trainer._checkpoint_connector.dump_checkpoint()  # what CheckpointIO.save_checkpoint is handed
    store = shardstore.open_store(tmp_path / "s")
    shardstore.save_state_dict(store, ck, step=ck["global_step"])
    back = shardstore.read_state_dict(store, "main")
    same(ck, back)
    assert back["hyper_parameters"] == {"root": pathlib.Path("/data"), "dtype": torch.bfloat16}


def test_saving_the_same_dict_twice_gives_the_same_commit(tmp_path):
    store = shardstore.open_store(tmp_path / "s")
    ck = lightning_checkpoint()
    a = shardstore.save_state_dict(store, ck, step=8, ref=None)
    reordered = dict(reversed(list(ck.items())))  # a dict's order is not its value; an OrderedDict's is
    assert shardstore.save_state_dict(store, reordered, step=8, ref=None) == a
    flipped = {**ck, "state_dict": OrderedDict(reversed(list(ck["state_dict"].items())))}
    assert shardstore.save_state_dict(store, flipped, step=8, ref=None) != a


Point = namedtuple("Point", "x y")


class Custom:
    pass


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"a": {"b": {1, 2}}}, r"\$\.a\.b: a builtins\.set"),
        ({"a": [np.float32(1.0)]}, r"\$\.a\[0\]: a numpy\.float32"),
        ({"a": Point(1, 2)}, r"\$\.a: a test_state_dict\.Point"),
        ({"a": defaultdict(int)}, r"\$\.a: a collections\.defaultdict"),
        ({"opt": {True: 1}}, r"\$\.opt: key True is a bool"),
        ({"fn": Custom()}, r"\$\.fn: a test_state_dict\.Custom"),
        ({"big": 2**64}, r"\$\.big: integer"),
        ({"s": "\ud800"}, r"state dict: a string is not valid Unicode"),
    ],
)
def test_what_cannot_be_held_is_refused_by_key_path_before_a_write(tmp_path, value, path):
    store = shardstore.open_store(tmp_path / "s")
    value["w"] = torch.ones(2)
    before = sorted(p for p in (tmp_path / "s").rglob("*") if p.is_file())
    with pytest.raises(UnsupportedState, match=path):
        shardstore.save_state_dict(store, value)
    assert sorted(p for p in (tmp_path / "s").rglob("*") if p.is_file()) == before


def test_in_place_load_fills_the_callers_tensors_after_checking_everything(tmp_path):
    ck = lightning_checkpoint()
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save_state_dict(store, ck)
    target = {
        "state_dict": OrderedDict((k, torch.zeros_like(v)) for k, v in ck["state_dict"].items()),
        "optimizer_states": [
            {
                "state": {i: {k: torch.zeros_like(v) for k, v in st.items()} for i, st in o["state"].items()},
                "param_groups": [{}],
            }
            for o in ck["optimizer_states"]
        ],
        "callbacks": {k: {"best_k_models": {}} for k in ck["callbacks"]},
    }
    weight = target["state_dict"]["0.weight"]
    target["callbacks"][next(iter(ck["callbacks"]))]["best_k_models"] = {
        "/tmp/run/epoch=0-step=8.ckpt": torch.zeros(())
    }
    target["callbacks"][next(iter(ck["callbacks"]))].update(best_model_score=torch.zeros(()), kth_value=torch.zeros(()))
    # a destination of the wrong shape is refused before any tensor is written
    wrong = {**target, "state_dict": OrderedDict(target["state_dict"], **{"2.bias": torch.zeros(3)})}
    with pytest.raises(TensorMismatch, match=r"\$\.state_dict\.2\.bias: the commit holds float32\[2\]"):
        shardstore.load_state_dict_into(store, wrong, cid)
    assert not weight.any()
    extra = {**target, "stray": torch.zeros(2)}  # a tensor the commit does not hold
    with pytest.raises(StateMismatch, match=r"holds no value at \$\.stray"):
        shardstore.load_state_dict_into(store, extra, cid)
    assert not weight.any()
    assert shardstore.load_state_dict_into(store, target, cid) == cid
    assert target["state_dict"]["0.weight"] is weight  # in place
    same(ck["state_dict"], target["state_dict"])
    same(ck["optimizer_states"], target["optimizer_states"])  # tensors filled, param_groups replaced
    key = next(iter(ck["callbacks"]))
    assert set(target["callbacks"][key]) == {"best_k_models", "best_model_score", "kth_value"}  # what it asked for
    same({k: ck["callbacks"][key][k] for k in target["callbacks"][key]}, target["callbacks"][key])


def test_in_place_load_refuses_a_non_tensor_where_the_commit_holds_a_tensor(tmp_path):
    # The caller's value was replaced by the tree's TensorRef (a name, no bytes) and the tensor
    # never read; a dict holding no tensor at all was refused as "an item of a tuple".
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save_state_dict(store, {"w": torch.ones(2), "step": 3, "sub": {"t": torch.zeros(1)}})
    for target, where in (
        ({"w": None, "step": 0, "sub": {"t": torch.full((1,), 7.0)}}, r"\$\.w: a NoneType"),
        ({"w": torch.full((2,), 7.0), "step": 0, "sub": {}}, r"\$\.sub: a dict.*'sub/t'"),
        ({"w": torch.full((2,), 7.0), "step": 0, "sub": None}, r"\$\.sub: a NoneType"),
    ):
        before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in target.items()}
        with pytest.raises(StateMismatch, match=where):
            shardstore.load_state_dict_into(store, target, cid)
        assert target.keys() == before.keys() and target["step"] == 0  # nothing written, nothing replaced
        assert all(torch.equal(v, before[k]) for k, v in target.items() if isinstance(v, torch.Tensor))
    only_values = {"step": 0}  # no tensor to fill: its values are still loaded
    assert shardstore.load_state_dict_into(store, only_values, cid) == cid and only_values == {"step": 3}


def test_read_state_dict_reads_the_callers_tensors_in_place_and_the_rest_fresh(tmp_path, monkeypatch):
    """``into``: a model's own tensors receive their bytes (a tied weight read once) and stand in the
    dict returned; everything else comes back fresh; a wrong destination is refused before any write."""
    ck = lightning_checkpoint()
    tied = torch.nn.Linear(4, 4, bias=False)
    ck["tied"] = {"a": tied.weight.detach(), "b": tied.weight.detach()}  # one tensor under two key paths
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save_state_dict(store, ck)
    model = OrderedDict((k, torch.zeros_like(v)) for k, v in ck["state_dict"].items())
    weight = model["0.weight"]
    wrong = OrderedDict(model, **{"2.bias": torch.zeros(3)})
    with pytest.raises(TensorMismatch, match=r"\$\.state_dict\.2\.bias: the commit holds float32\[2\]"):
        shardstore.read_state_dict(store, cid, into={"state_dict": wrong})
    assert not weight.any()  # nothing written
    one = torch.zeros(4, 4)
    reads: list[str] = []
    read_into = store.read_into
    monkeypatch.setattr(store, "read_into", lambda oid, dest, **kw: (reads.append(oid), read_into(oid, dest, **kw)))
    back = shardstore.read_state_dict(store, cid, into={"state_dict": model, "tied": {"a": one, "b": one.view(4, 4)}})
    same(ck, back)
    assert all(back["state_dict"][k] is model[k] for k in model) and back["tied"]["a"] is one  # in place
    assert back["tied"]["b"].data_ptr() == one.data_ptr()
    assert torch.equal(one, tied.weight)
    assert reads.count(shardstore.load_commit(store, cid).entries()["tied/a"].param) == 1  # read once, not per path
    assert back["optimizer_states"][0]["state"][0]["exp_avg"] is not ck["optimizer_states"][0]["state"][0]["exp_avg"]
    # tensors=False: the tree alone, each tensor named by its entry, no tensor read
    reads.clear()
    refs = shardstore.read_state_dict(store, cid, tensors=False)
    assert not reads and refs["epoch"] == 1 and refs["state_dict"]["0.weight"].name == "state_dict/0.weight"


def test_an_opened_state_dict_reads_its_commit_once_however_often_it_is_read(tmp_path, monkeypatch):
    """``open_state_dict``: the commit resolved, checked and its tree decoded once; each ``read`` then
    reads tensors only (in place or fresh), returns containers of its own and leaves ``tree`` as it was."""
    ck = lightning_checkpoint()
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save_state_dict(store, ck)
    opened_commits: list[str] = []
    load_commit = state_dict_module.load_commit
    monkeypatch.setattr(
        state_dict_module, "load_commit", lambda st, t: (opened_commits.append(t), load_commit(st, t))[1]
    )
    opened = shardstore.open_state_dict(store, "main")
    assert opened.commit == cid and opened_commits == ["main"]
    assert opened.tree["state_dict"]["0.weight"].name == "state_dict/0.weight"  # a TensorRef: nothing read yet
    model = OrderedDict((k, torch.zeros_like(v)) for k, v in ck["state_dict"].items())
    back = opened.read(into={"state_dict": model})
    same(ck, back)
    assert all(back["state_dict"][k] is model[k] for k in model)  # in place
    fresh = opened.read()
    same(ck, fresh)
    assert fresh["state_dict"]["0.weight"] is not model["0.weight"] and fresh is not back
    assert opened_commits == ["main"]  # two reads, one opening
    assert opened.tree["state_dict"]["0.weight"].name == "state_dict/0.weight"  # the opened tree left alone
    with pytest.raises(StateMismatch, match="holds no state dict tree"):
        shardstore.open_state_dict(store, shardstore.save(store, {"w": torch.ones(2)}, step=0, rng=False, ref=None))


def test_an_opened_state_dicts_reads_are_its_commits_whatever_the_caller_did_to_its_tree(tmp_path):
    """``StoredStateDict.tree`` is the caller's to look at and change (a resume picking what to
    load); ``read`` reads the commit as opened: a value changed, a tensor dropped or re-pointed at
    another entry in ``tree`` changes nothing it returns."""
    ck = lightning_checkpoint()
    store = shardstore.open_store(tmp_path / "s")
    shardstore.save_state_dict(store, ck)
    opened = shardstore.open_state_dict(store, "main")
    tree = opened.tree
    tree["epoch"] = -1
    weights = tree["state_dict"]
    first, second = list(weights)[:2]
    weights[first] = weights.pop(second)  # the second weight's entry at the first's key path
    tree["state_dict"] = {first: weights[first]}
    same(ck, opened.read())
    same(ck, opened.read(into={"state_dict": {first: torch.zeros_like(ck["state_dict"][first])}}))
    assert opened.tree is tree and tree["epoch"] == -1  # the caller's changes stay the caller's


def test_references_of_an_opened_tree_in_into_are_no_destinations(tmp_path):
    """A ``TensorRef`` in ``into`` (the opened ``tree`` passed back, whole or with some references
    replaced by the caller's tensors) raised an untyped TypeError. It is no destination: that tensor
    is read fresh. One placed where the commit holds another value is refused by its key path
    before any write; ``load_state_dict_into``, which has no fresh tensor to put there, refuses one."""
    ck = lightning_checkpoint()
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save_state_dict(store, ck)
    opened = shardstore.open_state_dict(store, cid)
    same(ck, opened.read(into=opened.tree))
    same(ck, shardstore.read_state_dict(store, cid, into=opened.tree))
    into = shardstore.read_state_dict(store, cid, tensors=False)
    mine = into["state_dict"]["0.weight"] = torch.zeros_like(ck["state_dict"]["0.weight"])
    back = opened.read(into=into)
    same(ck, back)
    assert back["state_dict"]["0.weight"] is mine and back["state_dict"]["0.bias"] is not ck["state_dict"]["0.bias"]
    moved = shardstore.read_state_dict(store, cid, tensors=False)
    sd = moved["state_dict"]
    sd["0.bias"], sd["2.bias"] = sd["2.bias"], torch.zeros_like(ck["state_dict"]["2.bias"])
    with pytest.raises(StateMismatch, match=r"\$\.state_dict\.0\.bias: .*'state_dict/2\.bias'"):
        opened.read(into=moved)
    assert not sd["2.bias"].any(), "nothing written before the refusal"
    with pytest.raises(StateMismatch, match=r"\$\.epoch: a TensorRef"):
        shardstore.read_state_dict(store, cid, into={"epoch": sd["0.bias"]})
    tree = opened.tree
    with pytest.raises(StateMismatch, match=r"state dict at \$\..+: a TensorRef .*in place"):
        shardstore.load_state_dict_into(store, tree, cid)
    assert tree == shardstore.read_state_dict(store, cid, tensors=False)  # nothing replaced
    with pytest.raises(StateMismatch, match=r"state dict at \$\.state_dict\.0\.bias: a TensorRef .*in place"):
        shardstore.load_state_dict_into(store, {"state_dict": {"0.bias": tree["state_dict"]["0.bias"]}}, cid)


def _load(how, store, cid, into, threads):
    if how == "read_state_dict":
        return shardstore.read_state_dict(store, cid, into=into, threads=threads)
    return shardstore.load_state_dict_into(store, into, cid, threads=threads)


@pytest.mark.parametrize("how", ["read_state_dict", "load_state_dict_into"])
@pytest.mark.parametrize("threads", [1, 8])
def test_destinations_sharing_memory_with_different_stored_tensors_are_refused_before_any_write(tmp_path, how, threads):
    """Two key paths whose destinations are one memory (a tied weight) but whose stored tensors
    differ (a checkpoint of an untied model, or a forged one) cannot both land: read one after the
    other, the second silently replaced the first (the dict returned claimed the first's value at its
    path); read at once, a chunked tensor's blocks from both mixed into bytes neither object holds.
    Refused, naming both, before any byte lands; one memory with one stored tensor is still read once."""
    g = torch.Generator().manual_seed(5)
    a, b, z = torch.randn(1100, 1000, generator=g), torch.randn(1100, 1000, generator=g), torch.randn(8, generator=g)
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save_state_dict(store, {"m": {"a": a, "b": b, "v": b.reshape(-1)[:1000].clone(), "z": z}})
    t, v, other = torch.zeros(1100, 1000), torch.zeros(1000), torch.zeros(8)
    for into in (
        {"m": {"a": t, "b": t, "z": other}},  # one tensor under two paths, two stored tensors
        {"m": {"a": t, "b": t.view(1100, 1000), "z": other}},  # the same memory viewed alike
        {"m": {"a": t, "v": t.reshape(-1)[:1000], "z": other}},  # overlapping views of one memory
    ):
        with pytest.raises(StateMismatch, match=r"'m/a'.*'m/[bv]'.*share memory"):
            _load(how, store, cid, into, threads)
        assert not t.any() and not other.any(), "nothing written before the refusal"
    # a tensor under two paths whose stored tensors are equal (one payload) is read once, as before
    cid = shardstore.save_state_dict(store, {"m": {"a": a, "b": a, "v": v, "z": z}})
    back = _load(how, store, cid, {"m": {"a": t, "b": t, "z": other}}, threads)
    assert torch.equal(t, a) and torch.equal(other, z)
    if how == "read_state_dict":
        assert back["m"]["a"] is t and back["m"]["b"] is t


@pytest.mark.parametrize("how", ["read_state_dict", "load_state_dict_into"])
def test_a_destination_that_cannot_hold_the_bytes_is_refused_before_any_write(tmp_path, how):
    """A destination on the meta device has no memory (the read wrote nothing and the dict returned
    held it as if loaded), and one whose elements overlap (an expanded tensor) cannot take distinct
    bytes (the read failed part way with torch's untyped RuntimeError after the tensors before it had
    landed): each is refused by its key path before any byte is written into the caller's tensors."""
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save_state_dict(store, {"m": {"a": torch.full((8,), 7.0), "z": torch.arange(4.0)}})
    for bad, says in ((torch.empty(4, device="meta"), "meta device"), (torch.zeros(1).expand(4), "overlap")):
        first = torch.zeros(8)  # sorts before the bad one: read first, were it not checked
        with pytest.raises(TensorMismatch, match=rf"\$\.m\.z: .*{says}"):
            _load(how, store, cid, {"m": {"a": first, "z": bad}}, 1)
        assert not first.any()


def _forge_shape(store, cid: str, name: str, shape: tuple[int, ...]) -> str:
    """Commit ``cid`` again with tensor ``name``'s shape replaced in its shard manifest (its object and
    the tree unchanged), the learned-state root recomputed: a forged manifest that binds correctly."""
    lc = shardstore.load_commit(store, cid)
    shard, commit = lc.shards[0], lc.commit
    entries = tuple(msgspec.structs.replace(e, shape=shape) if e.name == name else e for e in shard.entries)
    sid = store.put_manifest(msgspec.structs.replace(shard, entries=entries))
    root = learned_root(
        step=commit.step,
        data_cursor=commit.data_cursor,
        config=commit.config,
        optimizer=commit.optimizer,
        entries=entries,
        extras=commit.extras,
    )
    layout = tuple(msgspec.structs.replace(slot, shard=sid) for slot in commit.layout)
    return store.put_manifest(msgspec.structs.replace(commit, layout=layout, learned_root=root))


@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("shape", [(1 << 20, 1 << 20), (64 << 20,), (32,)])
def test_a_forged_shape_is_refused_before_its_tensor_is_allocated(tmp_path, monkeypatch, threads, shape):
    """A shard manifest whose tensor claims a shape its object's size disagrees with (4 TiB, 256 MiB,
    twice its 64 bytes): refused naming the tensor and the object before a fresh tensor of that shape
    is allocated and before any byte lands in the caller's tensors, on one thread (all sizes first) and
    on eight (each size just before its own allocation)."""
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save_state_dict(
        store, {"m": {"a": torch.ones(16), "b": torch.full((16,), 2.0), "c": torch.full((1000,), 3.0)}}
    )
    forged = _forge_shape(store, cid, "m/b", shape)
    allocated: list[tuple[int, ...]] = []
    empty = state_dict_module._empty
    monkeypatch.setattr(state_dict_module, "_empty", lambda e: (allocated.append(tuple(e.shape)), empty(e))[1])
    with pytest.raises(TensorMismatch, match=r"tensor 'm/b': object \w+ holds 64 bytes, .*refused before allocating"):
        shardstore.read_state_dict(store, forged, threads=threads)
    assert shape not in allocated and (1000,) not in allocated  # nothing at or after it
    a = torch.zeros(16)
    with pytest.raises(TensorMismatch, match="tensor 'm/b'"):
        shardstore.read_state_dict(store, forged, threads=threads, into={"m": {"a": a}})
    assert not a.any()
    assert shape not in allocated


def test_diff_by_key_path_log_gc_and_copy(tmp_path, capsys):
    store = shardstore.open_store(tmp_path / "s")
    ck = lightning_checkpoint()
    a = shardstore.save_state_dict(store, ck, step=8)
    ck["epoch"] = 2
    ck["optimizer_states"][0]["param_groups"][0]["lr"] = 2.5e-4
    ck["hyper_parameters"]["root"] = pathlib.Path("/data/other")
    with torch.no_grad():
        ck["state_dict"]["2.bias"].add_(1)
    b = shardstore.save_state_dict(store, ck, step=9)
    d = diff(store, a, b)
    fields = {f.name: (f.before, f.after) for f in d.fields}
    assert fields["state_dict.epoch"] == (1, 2)
    assert fields["state_dict.optimizer_states[0].param_groups[0].lr"] == (5e-4, 2.5e-4)
    assert fields["state_dict.hyper_parameters.root"] == ("/data/shards", "/data/other")
    assert [t.name for t in d.tensors] == ["state_dict/2.bias"]
    assert {f.name for f in diff(store, b, a).fields} == set(fields)
    capsys.readouterr()
    assert shardstore_main(["diff", str(tmp_path / "s"), a, b]) == 0
    shown = capsys.readouterr().out
    assert "state_dict.epoch" in shown and "state_dict/2.bias" in shown, shown
    assert shardstore_main(["log", str(tmp_path / "s"), "main"]) == 0
    assert a in capsys.readouterr().out
    shardstore.gc(store, grace_seconds=0, dry_run=False)
    assert shardstore.verify(store).ok
    same(shardstore.read_state_dict(store, b), ck)
    assert shardstore.read_state_dict(store, a)["epoch"] == 1
    other = shardstore.open_store(tmp_path / "copy")
    shardstore.copy_commit(store, other, b, ref="main")  # the tree travels with the commit's closure
    same(shardstore.read_state_dict(other, "main"), ck)


def test_a_commit_without_a_tree_is_not_read_as_one(tmp_path):
    store = shardstore.open_store(tmp_path / "s")
    model = torch.nn.Linear(2, 2)
    cid = shardstore.save(store, model, step=0)
    with pytest.raises(StateMismatch, match="not made by save_state_dict"):
        shardstore.read_state_dict(store, cid)
    with pytest.raises(UnsupportedState, match="reserved"):  # the tree's key is not an extra's
        shardstore.save(store, model, step=0, extra={"state_dict": torch.optim.SGD(model.parameters(), lr=0.1)})


# -- the encoding, pinned (SPEC.md §9.6, §24) ----------------------------------------------------------

VECTOR_TREE = (
    b'{"tree":{"betas":["type:tuple","f64:3feccccccccccccd","f64:3feff7ced916872b"],'
    b'"dtype":["type:dtype","bfloat16"],"note":["type:str","747970653a"],'
    b'"root":["type:path","PosixPath","/data"],'
    b'"state":["type:dict",[0,{"exp_avg":["type:tensor","state/0/exp_avg"],"step":3}]],'
    b'"w":["type:tensor","w"]}}'
)


def vector_state() -> dict:
    return {
        "w": torch.tensor([0.5, -1.0]),
        "state": {0: {"exp_avg": torch.tensor([0.0625, -0.125]), "step": 3}},
        "betas": (0.9, 0.999),
        "root": pathlib.PosixPath("/data"),
        "dtype": torch.bfloat16,
        "note": "type:",
    }


def test_the_tree_vector(tmp_path):
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save_state_dict(store, vector_state(), ref=None)
    tree = next(x for x in store.commit(cid).extras if x.key == "state_dict")
    assert store.get(tree.state) == VECTOR_TREE
    assert tree.state == blake3.blake3(VECTOR_TREE).hexdigest() == VECTOR_TREE_ID
    assert cid == VECTOR_COMMIT_ID
    assert shardstore.read_state_dict(store, cid, map_location="meta")["w"].device.type == "meta"
    # the tensors are the §24 vector's objects: layer.bias [0.5, -1.0] and its exp_avg
    entries = shardstore.load_commit(store, cid).entries()
    assert entries["w"].param == "2289f11e7346cf789fa7f35974d30ed0420e97ec8527c2314adee1030be1fef4"
    assert entries["state/0/exp_avg"].param == "8cd6577c6625c0ac665d39a0817e9a25c34be0850a389b9f4c85dc8612c4b0cd"


#: SPEC.md §24 ("state dict tree"): the tree document's id and the commit's (job default, step 0, one slot, no RNG)
VECTOR_TREE_ID = "71621f43379dea5184816399980d492fc7d0103bb940d26ec9039f3fe78f0873"
VECTOR_COMMIT_ID = "304be9ac342277526efeb94c630f256e0abd292c40016f10a555a9a7fc35c473"


# -- in a process group: DTensors through the block exchange -----------------------------------------


def _group_body(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(12.0).reshape(6, 2)
    moment = full / 8
    sd = {
        "model": {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.tensor([1.0, 2.0])},
        "optim": {"state": {0: {"exp_avg": distribute_tensor(moment, mesh, [Shard(0)]), "step": torch.tensor(3.0)}}},
        "epoch": 4,
    }
    store = shardstore.open_store(root)
    cid = shardstore.save_state_dict(store, sd, step=4)
    out = {"cid": cid}
    if rank == 0:
        back = shardstore.read_state_dict(store, cid)
        out["full"] = torch.equal(back["model"]["w"], full) and torch.equal(
            back["optim"]["state"][0]["exp_avg"], moment
        )
        out["types"] = [type(back["optim"]["state"]).__name__, type(back["model"]["w"]).__name__, back["epoch"]]
        out["verify"] = shardstore.verify(store).ok
    dst = {
        "model": {"w": distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)]), "b": torch.zeros(2)},
        "optim": {
            "state": {0: {"exp_avg": distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)]), "step": torch.zeros(())}}
        },
        "epoch": 0,
    }
    shardstore.load_state_dict_into(store, dst, cid)
    local = dst["model"]["w"].to_local()
    out["share"] = torch.equal(local, full[rank * 3 : rank * 3 + 3]) and dst["epoch"] == 4
    try:
        shardstore.save_state_dict(store, {**sd, "epoch": rank}, step=5)  # ranks disagree on a value
        out["disagree"] = "saved"
    except shardstore.CommitProtocolError as e:
        out["disagree"] = str(e)
    out["head"] = store.ref("main")
    return out


def test_dtensors_in_a_process_group_go_through_the_block_exchange(tmp_path):
    got = run_group(_group_body, 2, tmp_path, str(tmp_path / "s"))
    assert got[0]["cid"] == got[1]["cid"]
    assert got[0]["full"] and got[0]["types"] == ["dict", "Tensor", 4] and got[0]["verify"]
    assert got[0]["share"] and got[1]["share"]
    assert all("phase 'acknowledge' failed on rank(s) [1]" in g["disagree"] for g in got), got
    assert "commit-wide extras ['state_dict'] differ from rank 0's" in got[1]["disagree"]
    assert got[0]["head"] == got[0]["cid"]  # the ref stayed where it was


def test_verify_refuses_a_tree_that_does_not_match_its_commit(tmp_path):
    from shardstore.format.manifest import ExtraEntry

    store = shardstore.open_store(tmp_path / "s")
    base = shardstore.load_commit(store, shardstore.save(store, {"w": torch.ones(2)}, step=0, rng=False, ref=None))
    info = shardstore.CommitInfo(step=0, profile="fp32")
    forged = {
        "ghost": b'{"tree":{"ghost":["type:tensor","ghost"]}}',  # names a tensor the commit lacks
        "uncanonical": b'{"tree":{"w":["type:tensor","w"],"x":["type:dict",["a",1]]}}',  # str keys: an object
    }
    for what, doc in forged.items():
        tree = ExtraEntry(key="state_dict", state=store.put(doc), tensors=())
        cid = shardstore.write_commit(store, list(base.shard_ids.values()), info=info, parent=None, extras=(tree,))
        report = shardstore.verify(store, [cid])
        assert not report.ok and any("state dict tree" in str(p.error) for p in report.problems), (what, report)
        with pytest.raises((StateMismatch, shardstore.ManifestError)):
            shardstore.read_state_dict(store, cid)


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        (b'{"tree":{"p":["type:path","WindowsPath","x"]}}', "a WindowsPath cannot be made here"),
        (b'{"tree":{"p":["type:path","PosixPath","a//b"]}}', "not the canonical tree"),
        (b'{"tree":{"d":["type:dtype","__class__"]}}', "is not a torch dtype"),
        (b'{"tree":{"d":["type:device","foo"]}}', "is not a device"),
        (b'{"tree":{"t":["type:bogus"]}}', "unknown kind"),
        (b'{"tree":{"s":"type:x"}}', "reserved prefix outside a typed value"),
        (b'{"tree":{"s":["type:dict",[1,2],[0,3]]}}', "not the canonical tree"),  # pairs out of order
        (b'{"tree":{"w":["type:tensor","v"]}}', "names tensor 'v', its path gives 'w'"),
        (b'{"tree":{"x":1.5}}', "plain JSON real"),
        (b'{"other":{}}', "a tree document is"),
    ],
)
def test_a_hostile_tree_is_refused_with_a_typed_error(doc, says):
    from shardstore.state.documents import read_tree

    with pytest.raises(shardstore.ManifestError, match=re.escape(says)):
        read_tree(doc, "tree")
