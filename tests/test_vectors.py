"""Test vectors pinning object ids and both roots of a small fixed state (SPEC.md §Test vectors).

If one of these changes, the format changed: bump FORMAT_VERSION and update SPEC.md.
"""
from __future__ import annotations

import json
import uuid

import blake3

import shardstore as ss
from vectors import vector_state

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
            ss.optim.OptimState("adamw", {**states[0].optim.groups, **states[1].optim.groups}, {**states[0].optim.params, **states[1].optim.params}),
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
    config = json.dumps({"hidden_size": 3, "rms_norm_eps": "f64:" + struct.pack(">d", 1e-06).hex()}, sort_keys=True, separators=(",", ":"))
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
