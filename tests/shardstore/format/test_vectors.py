"""Test vectors pinning object ids and both roots of a small fixed state (SPEC.md §Test vectors).

If one of these changes, the format changed: bump FORMAT_VERSION and update SPEC.md.
"""

from __future__ import annotations

import json
import uuid

import blake3
from vectors import vector_state

import shardstore as ss

COMMIT = "7aefa805a1d63548eef4513d9fa55a9d83cc1ffc93634f6c7c0eba2cd6da378c"
LEARNED_ROOT = "2466421de564caf942d6275c2ebeb18e75200cd57be15d898c107aefa26d5361"
ONE_SLOT_COMMIT = "f77174ad964edf9e9feada42095b373f70b7613ec996c323170c00e3915ef574"
CONFIG = "ffc26198224bb870acf1d9a960442b14021b3122cbdf4e85af615a341d319ae4"
SHARDS = {
    0: "c29b86da152f84b28116fa8ab59da98c48dabc83f040d0bb6781a4df0831ba75",
    1: "06ea75245bfbb8cd331678e5b3bc453f83bc64646ecdeb51968fe281f1f28bcf",
}
TENSORS = {
    "layer.weight": (
        "8eda9d89b70474cef7735b8d312688fe78131031beee7cda4f022b4f1e9c4559",
        "175606933a1bb40126bfe646a5a5994c92a21306b5ea73735e50e69a3996322c",
        "56e163346a4938949e5dc70d3eb1e98d80edac8fec617091912312f4305947ca",
    ),
    "layer.bias": (
        "2289f11e7346cf789fa7f35974d30ed0420e97ec8527c2314adee1030be1fef4",
        "8cd6577c6625c0ac665d39a0817e9a25c34be0850a389b9f4c85dc8612c4b0cd",
        "0d2aa81b5fe8de5f3a0aaa9cc45c620219e6d7cef8f806cde875662964e1a417",
    ),
    "positions": ("13e70fcfc33f841ea898a5fc2e5d42e45abb3477d26f152a4cabbec2b99c88f8", None, None),
}


def _commit(slots: int = 2):
    store = ss.open_store(f"memory://vectors-{uuid.uuid4().hex}")
    states, info = vector_state()
    if slots == 1:
        merged = ss.SlotState(
            {**states[0].tensors, **states[1].tensors},
            ss.state.optim.OptimState(
                "adamw",
                {**states[0].optim.groups, **states[1].optim.groups},
                {**states[0].optim.params, **states[1].optim.params},
            ),
            {},
        )
        states = [merged]
    return store, ss.save_slots(store, states, info=info, ref=None, parent=None)


def test_pinned_ids_and_roots():
    store, cid = _commit()
    assert cid == COMMIT
    lc = ss.load_commit(store, cid)
    assert lc.commit.learned_root == LEARNED_ROOT
    assert lc.commit.config == CONFIG
    assert lc.shard_ids == SHARDS
    for name, e in lc.entries().items():
        ids = (e.param, e.optim.exp_avg if e.optim else None, e.optim.exp_avg_sq if e.optim else None)
        assert ids == TENSORS[name], name


def test_one_slot_has_the_same_learned_root_and_another_full_root():
    store, cid = _commit(slots=1)
    assert cid == ONE_SLOT_COMMIT
    assert store.commit(cid).learned_root == LEARNED_ROOT


def test_vector_bytes_independently():
    """Recompute the ids from the SPEC's rules with json + blake3 only (not msgspec)."""
    store, cid = _commit()
    w = bytes(store.get(TENSORS["layer.weight"][0]))
    import struct

    assert w == struct.pack("<6f", 0, 0.25, 0.5, 0.75, 1.0, 1.25)
    assert blake3.blake3(w).hexdigest() == TENSORS["layer.weight"][0]
    config = json.dumps(
        {"hidden_size": 3, "rms_norm_eps": "f64:" + struct.pack(">d", 1e-06).hex()},
        sort_keys=True,
        separators=(",", ":"),
    )
    assert blake3.blake3(config.encode()).hexdigest() == CONFIG
    commit = json.loads(bytes(store.get(cid)))
    entries = []
    for lay in commit["layout"]:
        entries += json.loads(bytes(store.get(lay["shard"])))["entries"]
    learned = {
        "type": "learned",
        "version": 1,
        "step": commit["step"],
        "data_cursor": commit["data_cursor"],
        "config": commit["config"],
        "optimizer": commit["optimizer"],
        "tensors": sorted(entries, key=lambda e: e["name"]),
    }
    doc = json.dumps(learned, sort_keys=True, separators=(",", ":")).encode()
    assert blake3.blake3(doc).hexdigest() == LEARNED_ROOT
    assert blake3.blake3(json.dumps(commit, sort_keys=True, separators=(",", ":")).encode()).hexdigest() == COMMIT


# -- issue 13: the torch form with a buffer, and commit-wide extras (SPEC.md §Test vectors) --------

SGD_COMMIT = "1bbbef1464d38f48b43e79fd725201bcf740f1086b6a1046bc5826e70d846e41"
SGD_LEARNED_ROOT = "02b2db54d70e99bf74b20e87b81fba0cfcd3b3da0d0666b66b7d2e318293df42"
SGD_SHARD = "f9100881c5f2cac0fa7e2cbdc9ba4471862c8a50f0c230382c2dd57430b2b77e"
EXTRAS_COMMIT = "1dfe0178487d00fe6b2caaa6ccb6637dfc3b699b6adb2c8004d280a18056148f"
EXTRAS_LEARNED_ROOT = "aa804599eb4ebc0fc007040af03e41368a22d1356565dcb226a526d157eb64cc"
EXTRAS_DOCUMENT = "da8b263743ad4f47791413ba333ed2feb9af3788f9adce8c8e906b5465d9e49c"


def _learned_doc(store, commit: dict) -> bytes:
    entries = []
    for lay in commit["layout"]:
        entries += json.loads(bytes(store.get(lay["shard"])))["entries"]
    learned = {
        "type": "learned", "version": 1, "step": commit["step"], "data_cursor": commit["data_cursor"],
        "config": commit["config"], "optimizer": commit["optimizer"], "tensors": sorted(entries, key=lambda e: e["name"]),
    }  # fmt: skip
    if "extras" in commit:
        learned["extras"] = commit["extras"]
    return json.dumps(learned, sort_keys=True, separators=(",", ":")).encode()


def _f64(x: float) -> str:
    import struct

    return "f64:" + struct.pack(">d", x).hex()


def test_sgd_momentum_vector_independently():
    """The torch form's bytes, spelled out by hand from SPEC.md §8.2 and §9 and hashed with json + blake3."""
    import struct

    from vectors import sgd_vector_state

    store = ss.open_store(f"memory://vectors-{uuid.uuid4().hex}")
    states, info = sgd_vector_state()
    cid = ss.save_slots(store, states, info=info, ref=None, parent=None)
    assert cid == SGD_COMMIT
    w = struct.pack("<6f", 0, 0.25, 0.5, 0.75, 1.0, 1.25)
    momentum = struct.pack("<6f", *(x / 8 for x in (0, 0.25, 0.5, 0.75, 1.0, 1.25)))
    mean = struct.pack("<2f", 0.5, 1.0)
    h = lambda b: blake3.blake3(b).hexdigest()  # noqa: E731
    shard = {
        "algorithm": "torch", "config": None, "groups": [], "job": "vector-job", "parent": None, "rng": [],
        "slot": 0, "slots": 1, "step": 2, "type": "shard", "version": 1,
        "entries": [
            {"dtype": "float32", "name": "layer.weight", "optim": None, "param": h(w), "shape": [2, 3],
             "state": {"group": "g0", "scalars": [], "tensors": [{"dtype": "float32", "key": "momentum_buffer", "object": h(momentum), "shape": [2, 3]}]}},
            {"dtype": "float32", "kind": "buffer", "name": "norm.running_mean", "optim": None, "param": h(mean), "shape": [2]},
        ],
        "torch_optimizer": {"class_name": "torch.optim.sgd.SGD", "groups": [{"name": "g0", "hyper": {
            "dampening": 0, "foreach": None, "lr": _f64(0.1), "maximize": False, "momentum": _f64(0.9), "nesterov": True, "weight_decay": 0}}]},
    }  # fmt: skip
    shard_bytes = json.dumps(shard, sort_keys=True, separators=(",", ":")).encode()
    assert bytes(store.get(SGD_SHARD)) == shard_bytes and h(shard_bytes) == SGD_SHARD
    commit = json.loads(bytes(store.get(cid)))
    assert commit["optimizer"] == {"algorithm": "torch", "groups": [], "torch_optimizer": shard["torch_optimizer"]}
    assert "extras" not in commit
    assert h(_learned_doc(store, commit)) == SGD_LEARNED_ROOT == commit["learned_root"]
    assert h(json.dumps(commit, sort_keys=True, separators=(",", ":")).encode()) == SGD_COMMIT


def test_extras_vector_independently():
    """Commit-wide extras enter the commit and the learned-state root, and leave the shard manifest alone."""
    import struct

    from vectors import FixedScheduler

    store, one_slot = _commit(slots=1)
    states, info = vector_state()
    merged = ss.SlotState(
        {**states[0].tensors, **states[1].tensors},
        ss.state.optim.OptimState(
            "adamw",
            {**states[0].optim.groups, **states[1].optim.groups},
            {**states[0].optim.params, **states[1].optim.params},
        ),
        {},
    )
    cid = ss.save_slots(store, [merged], info=info, ref=None, parent=None, extra={"scheduler": FixedScheduler()})
    assert cid == EXTRAS_COMMIT
    commit = json.loads(bytes(store.get(cid)))
    assert commit["layout"] == json.loads(bytes(store.get(one_slot)))["layout"]  # the same shard manifest
    best = struct.pack("<2f", 1.5, -2.0)
    doc = json.dumps(
        {"base_lrs": [_f64(0.001)], "best": "tensor:0", "last_epoch": 2}, sort_keys=True, separators=(",", ":")
    ).encode()
    assert blake3.blake3(doc).hexdigest() == EXTRAS_DOCUMENT and bytes(store.get(EXTRAS_DOCUMENT)) == doc
    assert commit["extras"] == [
        {
            "key": "scheduler",
            "state": EXTRAS_DOCUMENT,
            "tensors": [{"dtype": "float32", "key": "0", "object": blake3.blake3(best).hexdigest(), "shape": [2]}],
        }
    ]
    root = blake3.blake3(_learned_doc(store, commit)).hexdigest()
    assert root == EXTRAS_LEARNED_ROOT == commit["learned_root"] != LEARNED_ROOT
    assert (
        blake3.blake3(json.dumps(commit, sort_keys=True, separators=(",", ":")).encode()).hexdigest() == EXTRAS_COMMIT
    )


# -- every value SPEC.md §24 states, and nothing read back from a store (issue 26, Build 6) --------------


def _enc(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def _h(b: bytes) -> str:
    return blake3.blake3(b).hexdigest()


def _stated_vector_1():
    """Vector 1's shard manifests, learned-state document and commit manifests built from the
    values SPEC.md §24 lists (moments, births, hyperparameters, profile, transition, nulls),
    with struct + json + blake3 only."""
    import struct

    f32 = lambda *xs: struct.pack(f"<{len(xs)}f", *xs)  # noqa: E731
    weight = f32(0, 0.25, 0.5, 0.75, 1.0, 1.25)
    m1w, m2w = (
        f32(0, 0.03125, 0.0625, 0.09375, 0.125, 0.15625),
        f32(0, 0.0009765625, 0.00390625, 0.0087890625, 0.015625, 0.0244140625),
    )
    bias, m1b, m2b = f32(0.5, -1.0), f32(0.0625, -0.125), f32(0.00390625, 0.015625)
    positions = struct.pack("<4q", 0, 1, 2, 3)
    f64 = lambda x: struct.pack(">d", x).hex()  # noqa: E731
    group = lambda name, wd: {
        "beta1": f64(0.9),
        "beta2": f64(0.999),
        "eps": f64(1e-08),
        "lr": f64(0.001),
        "name": name,
        "weight_decay": f64(wd),
    }  # noqa: E731
    groups = {"decay": group("decay", 0.1), "no_decay": group("no_decay", 0.0)}
    config = _h(_enc({"hidden_size": 3, "rms_norm_eps": "f64:" + f64(1e-06)}))
    optim = lambda g, birth, age, m1, m2: {
        "age": age,
        "birth": birth,
        "exp_avg": _h(m1),
        "exp_avg_sq": _h(m2),
        "group": g,
        "moment_dtype": "float32",
    }  # noqa: E731
    entries = {
        "layer.weight": {
            "dtype": "float32",
            "name": "layer.weight",
            "optim": optim("decay", 0, 2, m1w, m2w),
            "param": _h(weight),
            "shape": [2, 3],
        },
        "layer.bias": {
            "dtype": "float32",
            "name": "layer.bias",
            "optim": optim("no_decay", 1, 1, m1b, m2b),
            "param": _h(bias),
            "shape": [2],
        },
        "positions": {"dtype": "int64", "name": "positions", "optim": None, "param": _h(positions), "shape": [4]},
    }

    def shard(slot: int, slots: int, names: list[str], gnames: list[str], rng: bytes | None) -> bytes:
        return _enc({"algorithm": "adamw", "config": config, "entries": [entries[n] for n in sorted(names)], "groups": [groups[g] for g in gnames],
                     "job": "vector-job", "parent": None, "rng": [] if rng is None else [{"kind": "torch", "object": _h(rng)}],
                     "slot": slot, "slots": slots, "step": 2, "type": "shard", "version": 1})  # fmt: skip

    optimizer = {"algorithm": "adamw", "groups": [groups["decay"], groups["no_decay"]]}
    learned = {"config": config, "data_cursor": 8, "optimizer": optimizer, "step": 2, "tensors": [entries[n] for n in sorted(entries)],
               "type": "learned", "version": 1}  # fmt: skip

    def commit(layout: list[dict], extras: list | None = None) -> dict:
        doc = learned | ({"extras": extras} if extras else {})
        c = {"config": config, "data_cursor": 8, "job": "vector-job", "layout": layout, "learned_root": _h(_enc(doc)), "optimizer": optimizer,
             "parent": None, "profile": "fp32", "schedule": "sched-1", "step": 2, "transition": "train", "type": "commit", "version": 1}  # fmt: skip
        return c | ({"extras": extras} if extras else {})

    s0 = shard(0, 2, ["layer.weight"], ["decay"], bytes(range(16)))
    s1 = shard(1, 2, ["layer.bias", "positions"], ["no_decay"], bytes(range(16, 32)))
    one = shard(0, 1, list(entries), ["decay", "no_decay"], None)
    two_slots = commit(
        [
            {"shard": _h(s0), "slot": 0, "tensors": ["layer.weight"]},
            {"shard": _h(s1), "slot": 1, "tensors": ["layer.bias", "positions"]},
        ]
    )
    one_layout = [{"shard": _h(one), "slot": 0, "tensors": sorted(entries)}]
    document = _enc({"base_lrs": ["f64:" + f64(0.001)], "best": "tensor:0", "last_epoch": 2})
    extras = [
        {
            "key": "scheduler",
            "state": _h(document),
            "tensors": [{"dtype": "float32", "key": "0", "object": _h(f32(1.5, -2.0)), "shape": [2]}],
        }
    ]
    return {"weight": _h(weight), "config": config, "shards": {0: _h(s0), 1: _h(s1)}, "learned": _h(_enc(learned)), "commit": _h(_enc(two_slots)),
            "one_slot": _h(_enc(commit(one_layout))), "document": _h(document), "extras_learned": commit(one_layout, extras)["learned_root"],
            "extras_commit": _h(_enc(commit(one_layout, extras)))}  # fmt: skip


def test_vector_1_and_its_extras_from_the_values_spec_states():
    """Every id of vector 1 and of the extras vector from SPEC.md §24's values alone: if a
    value the ids hash drifts from the text, this fails (no store, no shardstore code)."""
    v = _stated_vector_1()
    assert v["weight"] == TENSORS["layer.weight"][0] and v["config"] == CONFIG and v["shards"] == SHARDS
    assert (v["learned"], v["commit"], v["one_slot"]) == (LEARNED_ROOT, COMMIT, ONE_SLOT_COMMIT)
    assert (v["document"], v["extras_learned"], v["extras_commit"]) == (
        EXTRAS_DOCUMENT,
        EXTRAS_LEARNED_ROOT,
        EXTRAS_COMMIT,
    )


def test_torch_form_vector_from_the_values_spec_states():
    """The torch-form vector's shard manifest, learned-state root and commit manifest (profile,
    transition, nulls) from SPEC.md §24 alone."""
    import struct

    f32 = lambda *xs: struct.pack(f"<{len(xs)}f", *xs)  # noqa: E731
    f64 = lambda x: struct.pack(">d", x).hex()  # noqa: E731
    torch_optimizer = {"class_name": "torch.optim.sgd.SGD", "groups": [{"hyper": {
        "dampening": 0, "foreach": None, "lr": "f64:" + f64(0.1), "maximize": False, "momentum": "f64:" + f64(0.9), "nesterov": True,
        "weight_decay": 0}, "name": "g0"}]}  # fmt: skip
    state = {"group": "g0", "scalars": [], "tensors": [{"dtype": "float32", "key": "momentum_buffer", "object": _h(f32(0, 0.03125, 0.0625, 0.09375, 0.125, 0.15625)),
                                                        "shape": [2, 3]}]}  # fmt: skip
    entries = [{"dtype": "float32", "name": "layer.weight", "optim": None, "param": _h(f32(0, 0.25, 0.5, 0.75, 1.0, 1.25)), "shape": [2, 3], "state": state},
               {"dtype": "float32", "kind": "buffer", "name": "norm.running_mean", "optim": None, "param": _h(f32(0.5, 1.0)), "shape": [2]}]  # fmt: skip
    shard = {"algorithm": "torch", "config": None, "entries": entries, "groups": [], "job": "vector-job", "parent": None, "rng": [], "slot": 0,
             "slots": 1, "step": 2, "torch_optimizer": torch_optimizer, "type": "shard", "version": 1}  # fmt: skip
    optimizer = {"algorithm": "torch", "groups": [], "torch_optimizer": torch_optimizer}
    learned = {
        "config": None,
        "data_cursor": None,
        "optimizer": optimizer,
        "step": 2,
        "tensors": entries,
        "type": "learned",
        "version": 1,
    }
    commit = {"config": None, "data_cursor": None, "job": "vector-job", "layout": [{"shard": _h(_enc(shard)), "slot": 0, "tensors": ["layer.weight", "norm.running_mean"]}],
              "learned_root": _h(_enc(learned)), "optimizer": optimizer, "parent": None, "profile": "fp32", "schedule": None, "step": 2,
              "transition": "train", "type": "commit", "version": 1}  # fmt: skip
    assert (_h(_enc(shard)), _h(_enc(learned)), _h(_enc(commit))) == (SGD_SHARD, SGD_LEARNED_ROOT, SGD_COMMIT)
