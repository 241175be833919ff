"""Chunked torch-form optimizer state (format 3) and large extras/buffers (SPEC.md §5.1, §9.1-§9.3).

Pure tests, no processes: the format-3 vector recomputed from SPEC.md with ``json``,
``array`` and ``blake3`` only; a version-2 store whose large state tensor is one object
stays readable; forged payloads are refused naming tensor and state key; a large extra's
tensor is stored whole and a large buffer chunked, each restored bitwise.
"""

from __future__ import annotations

import functools
import json
import uuid
from array import array

import blake3
import msgspec
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import shardstore as ss
from shardstore.format.manifest import HyperGroup, encode
from shardstore.state.optim import OptimState, ParamOpt, TorchParam

MiB = 1 << 20
ROWS, COLS = (
    3,
    524288,
)  # float32 rows of 2 MiB: tiles of columns 0-262143 and the rest (row bands 0-1 and 2 in version 3)
TILES = [((0, 0), (ROWS, COLS // 2)), ((0, COLS // 2), (ROWS, COLS // 2))]  # SPEC.md §5.1, version 4
BANDS = [((0, 0), (2, COLS)), ((2, 0), (1, COLS))]  # versions 2 and 3
N = 4096  # the slot-K selection's uint8 [N, N]: 2 x 2 tiles
HYPER = {"dampening": 0, "foreach": None, "lr": "f64:3fb999999999999a", "maximize": False, "momentum": "f64:3feccccccccccccd",
         "nesterov": True, "weight_decay": 0}  # fmt: skip


def _state() -> tuple[ss.SlotState, ss.CommitInfo]:
    """``w`` (float32 [3, 524288], element i = i) with SGD state ``momentum_buffer`` = w / 8 (exact)."""
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    optim = OptimState("torch", {}, {"w": ParamOpt("g0", 0, None, None, TorchParam("g0", {"momentum_buffer": w / 8}, {}))},
                       "torch.optim.sgd.SGD", {"g0": HyperGroup(name="g0", hyper=HYPER)})  # fmt: skip
    return ss.SlotState({"w": w}, optim), ss.CommitInfo(step=0, job="vector-job", transition="init")


@functools.lru_cache(maxsize=2)
def _values(divisor: int) -> array:
    """The float32 elements ``i / divisor`` of the vectors' ``[ROWS, COLS]`` tensors (read-only: shared between tests)."""
    return array("f", range(ROWS * COLS)) if divisor == 1 else array("f", (i / divisor for i in range(ROWS * COLS)))


def _blocks(values: array, boxes=TILES) -> list[dict]:
    """The payload of a float32 [ROWS, COLS] tensor on ``boxes``: each block's object is its
    box's elements in C order (each row of the box one byte range of the tensor)."""
    raw, row = values.tobytes(), COLS * 4
    out = []
    for (r0, c0), (nr, nc) in boxes:
        data = b"".join(raw[(r0 + i) * row + c0 * 4 : (r0 + i) * row + (c0 + nc) * 4] for i in range(nr))
        out.append({"object": blake3.blake3(data).hexdigest(), "shape": [nr, nc], "start": [r0, c0]})
    return out


def _independent(boxes=TILES, version: int = 4) -> tuple[str, str]:
    """Shard manifest id and learned-state root of ``_state`` from SPEC.md's rules, without shardstore."""
    w = _blocks(_values(1), boxes)
    m = _blocks(_values(8), boxes)
    entry = {"dtype": "float32", "name": "w", "optim": None, "param": w, "shape": [ROWS, COLS],
             "state": {"group": "g0", "scalars": [], "tensors": [{"dtype": "float32", "key": "momentum_buffer", "object": m, "shape": [ROWS, COLS]}]}}  # fmt: skip
    torch_optimizer = {"class_name": "torch.optim.sgd.SGD", "groups": [{"hyper": HYPER, "name": "g0"}]}
    enc = lambda d: json.dumps(d, sort_keys=True, separators=(",", ":")).encode()  # noqa: E731
    shard = {"algorithm": "torch", "config": None, "entries": [entry], "groups": [], "job": "vector-job", "parent": None,
             "rng": [], "slot": 0, "slots": 1, "step": 0, "torch_optimizer": torch_optimizer, "type": "shard", "version": version}  # fmt: skip
    learned = {"config": None, "data_cursor": None, "step": 0, "tensors": [entry], "type": "learned", "version": version,
               "optimizer": {"algorithm": "torch", "groups": [], "torch_optimizer": torch_optimizer}}  # fmt: skip
    return blake3.blake3(enc(shard)).hexdigest(), blake3.blake3(enc(learned)).hexdigest()


#: Format 3's vector (the row-band grid), recomputed from SPEC.md alone: unchanged.
STATE_VECTORS_V3 = (
    "7d56a1b28f0dfa6ae9fe06b748af6a0b655a813337a3498696a15a96fa15724d",  # shard manifest (version 3)
    "14696d4b117ba7a50dbc4a0186cffd5580416c27e4b8db6d79fb70f4f1fdf1f1",  # learned-state root (version 3)
)

STATE_VECTORS = (
    "0f738decaf7a7f4a418fa4d4cde52a6e7a4697f6cd1317ead64c6136be43f11d",  # shard manifest (version 4)
    "8b05ca497fa59425c5f75099aeb6a23a7cabc118d631025fb981ee307ee03d9b",  # learned-state root (version 4)
    "72f418b96d3c67208d01080e19ade2fb0cc0c019dd1264feb2526301e1f15e9c",  # full root
)


def test_the_version_3_state_vector_is_unchanged():
    assert _independent(BANDS, 3) == STATE_VECTORS_V3


def _saved(store: ss.Store) -> str:
    state, info = _state()
    return ss.save_slots(store, [state], info=info, ref=None, parent=None)


def test_chunked_state_vector_matches_an_independent_encoder():
    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    cid = _saved(store)
    lc = ss.load_commit(store, cid)
    (st,) = lc.entries()["w"].state.tensors
    assert [(b.start, b.shape) for b in st.object] == TILES
    shard_id, root = _independent()
    assert lc.commit.version == 4 and lc.shards[0].version == 4
    assert (lc.shard_ids[0], lc.commit.learned_root) == (shard_id, root)
    assert (shard_id, root, cid) == STATE_VECTORS
    assert ss.verify(store).ok


def _legacy_v2(store: ss.Store) -> tuple[str, torch.Tensor]:
    """A commit as format 2 wrote it: the parameter chunked on the row-band grid, its large state tensor one object."""
    from shardstore.format.grid import box_slices, make_payload

    state, info = _state()
    m = state.optim.params["w"].torch_state.tensors["momentum_buffer"]
    w = state.tensors["w"]
    cid = _saved(store)
    lc = ss.load_commit(store, cid)
    (e,) = lc.shards[0].entries
    (oid,) = store.put_tensors([m])
    bands = make_payload(
        "float32", (ROWS, COLS), store.put_tensors([w[box_slices(b, (0, 0))].contiguous() for b in BANDS]), bands=True
    )
    st = msgspec.structs.replace(e.state.tensors[0], object=oid)
    e = msgspec.structs.replace(e, param=bands)
    old = msgspec.structs.replace(
        lc.shards[0],
        version=2,
        entries=(msgspec.structs.replace(e, state=msgspec.structs.replace(e.state, tensors=(st,))),),
    )
    store.sync()
    sid = store.put_manifest(old)
    return ss.write_commit(store, [sid], info=info, parent=None), m


def test_a_version_2_store_with_a_large_state_tensor_in_one_object_stays_readable():
    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    cid, momentum = _legacy_v2(store)
    lc = ss.load_commit(store, cid)
    assert lc.commit.version == 2 and isinstance(lc.entries()["w"].state.tensors[0].object, str)
    assert ss.verify(store, [cid]).ok
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(ROWS, COLS))
    opt = torch.optim.SGD([model.w], lr=0.1, momentum=0.9, nesterov=True)
    ss.restore(store, cid, model, opt)
    assert torch.equal(opt.state[model.w]["momentum_buffer"], momentum)


def _forge(store: ss.Store, cid: str, version: int, payload) -> str:
    lc = ss.load_commit(store, cid)
    (e,) = lc.shards[0].entries
    st = msgspec.structs.replace(e.state.tensors[0], object=payload)
    bad = msgspec.structs.replace(
        lc.shards[0],
        version=version,
        entries=(msgspec.structs.replace(e, state=msgspec.structs.replace(e.state, tensors=(st,))),),
    )
    sid = store.put_manifest(bad)
    c = store.commit(cid)
    return store.put_manifest(
        msgspec.structs.replace(c, version=version, layout=(msgspec.structs.replace(c.layout[0], shard=sid),))
    )


def test_forged_state_payloads_are_refused_naming_tensor_and_state_key():
    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    cid = _saved(store)
    blocks = ss.load_commit(store, cid).entries()["w"].state.tensors[0].object
    # a large state tensor as one object is format 2's spelling, never format 3's or 4's
    with pytest.raises(ss.ManifestError, match="version 3 must be version 2 or 4"):
        ss.load_commit(store, _forge(store, cid, 3, blocks[0].object))
    overlapping = (blocks[0], msgspec.structs.replace(blocks[1], start=(0, 1)))
    with pytest.raises(ss.GridError, match=r"'w'.*optimizer state 'momentum_buffer' payload: blocks 0 and 1 .*overlap"):
        ss.load_commit(store, _forge(store, cid, 4, overlapping))
    # a tile-grid payload in a version 3 manifest is checked against version 3's row bands
    with pytest.raises(ss.GridError, match=r"'w'.*the canonical grid's block 0 is at \[0, 0\] of extent \[2, 524288\]"):
        ss.load_commit(store, _forge(store, cid, 3, blocks))
    with pytest.raises(ss.ManifestError, match="must be version 3 or 4"):
        ss.manifest.decode(
            encode(msgspec.structs.replace(store.shard(ss.load_commit(store, cid).shard_ids[0]), version=2))
        )
    victim = blocks[1].object
    key = f"objects/{victim[:2]}/{victim}"
    data = bytearray(store.storage.read(key))
    data[7] ^= 1
    store.storage.delete(key)
    store.storage.write_once(key, bytes(data))  # a flipped bit in block 1 of the momentum
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(ROWS, COLS))
    opt = torch.optim.SGD([model.w], lr=0.1, momentum=0.9, nesterov=True)
    with pytest.raises(ss.CorruptObject, match=r"optimizer state 'momentum_buffer' of 'w', block 1.*" + victim):
        ss.restore(store, cid, model, opt, threads=1)
    missing = victim
    store.storage.delete(key)
    report = ss.verify(store, [cid])
    assert [(p.kind, p.tensor, p.object) for p in report.problems] == [("ObjectNotFound", "w", missing)]
    assert "optimizer state 'momentum_buffer' block 1" in str(report.problems[0])


class Holder:
    """An extra whose state is one tensor bigger than a block."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.t = sd["t"]


def test_a_large_extra_tensor_is_one_object_and_a_large_buffer_is_chunked():
    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    model = torch.nn.Linear(4, 2)
    model.register_buffer("table", torch.arange(3 * COLS, dtype=torch.float32).reshape(3, COLS))  # 6 MiB
    big = torch.arange(2 * COLS * 3, dtype=torch.float32)  # 12 MiB
    cid = ss.save(store, model, step=0, rng=False, extra={"holder": Holder(big)})
    lc = ss.load_commit(store, cid)
    assert lc.entries()["table"].kind == "buffer" and len(lc.entries()["table"].param) == 2
    (x,) = lc.commit.extras
    assert (
        isinstance(x.tensors[0].object, str) and lc.commit.version == 4
    )  # extras' tensors are one object; the buffer is on tiles
    back, holder = torch.nn.Linear(4, 2), Holder(torch.empty(0))
    back.register_buffer("table", torch.zeros(3, COLS))
    ss.restore(store, cid, back, extra={"holder": holder})
    assert torch.equal(back.table, model.table) and torch.equal(holder.t, big)
    # an extra's tensor listed as blocks is refused: that form is the torch form's state only
    c = store.commit(cid)
    forged = (msgspec.structs.replace(x.tensors[0], object=lc.entries()["table"].param),)
    bad = store.put_manifest(msgspec.structs.replace(c, extras=(msgspec.structs.replace(x, tensors=forged),)))
    with pytest.raises(ss.ManifestError, match="extra 'holder': tensor 0 has a chunked payload"):
        ss.load_commit(store, bad)


# -- slices (format 3, SPEC.md §15.5): the chunked vector's w held by two slots, rows 0-1 and row 2 ---------


def _slice_manifests(boxes, version: int) -> list[bytes]:
    """The two shard manifests of the slices vector, from SPEC.md's rules alone."""
    enc = lambda d: json.dumps(d, sort_keys=True, separators=(",", ":")).encode()  # noqa: E731
    entry = {"dtype": "float32", "name": "w", "optim": None, "param": _blocks(_values(1), boxes), "shape": [ROWS, COLS]}
    base = {"algorithm": "none", "config": None, "groups": [], "job": "vector-job", "parent": None, "rng": [], "slots": 2,
            "step": 0, "type": "shard", "version": version}  # fmt: skip
    s0 = base | {"slot": 0, "entries": [entry], "slices": [{"name": "w", "shape": [2, COLS], "start": [0, 0]}]}
    s1 = base | {
        "slot": 1,
        "entries": [],
        "version": 3,
        "slices": [{"name": "w", "shape": [1, COLS], "start": [2, 0]}],
    }  # no payload: 3
    return [enc(s0), enc(s1)]


def test_the_version_3_slices_vector_is_unchanged():
    assert [blake3.blake3(m).hexdigest() for m in _slice_manifests(BANDS, 3)] == list(SLICES_VECTORS_V3)


def test_slices_vector_matches_an_independent_encoder():
    from shardstore.format.slices import make_slices

    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    info = ss.CommitInfo(step=0, job="vector-job", transition="init")
    states = [ss.SlotState({"w": w}, slices=make_slices([("w", ((0, 0), (2, COLS)))])),
              ss.SlotState({}, slices=make_slices([("w", ((2, 0), (1, COLS)))]))]  # fmt: skip
    cid = ss.save_slots(store, states, info=info, ref=None, parent=None)
    lc = ss.load_commit(store, cid)
    assert [bytes(store.get(lc.shard_ids[i])) for i in (0, 1)] == _slice_manifests(TILES, 4)
    assert lc.commit.version == 4
    # the layout is not learned state: the learned-state root is the one-slot chunked state's, without optimizer
    alone = ss.save_slots(store, [ss.SlotState({"w": w})], info=info, ref=None, parent=None)
    assert lc.commit.learned_root == store.commit(alone).learned_root == SLICES_LEARNED_ROOT
    assert (lc.shard_ids[0], lc.shard_ids[1], cid) == SLICES_VECTORS
    assert ss.verify(store).ok
    # each slot's selection: the tiles its rows overlap (both column tiles), not the entry slot 0 records
    from shardstore.ops.transfer import commit_closure

    assert set(commit_closure(lc, 1).data) == {b.object for b in lc.entries()["w"].param}
    assert set(commit_closure(lc, 0).data) == {b.object for b in lc.entries()["w"].param}


#: Format 3's slices vector (the row-band grid), recomputed from SPEC.md alone: unchanged.
SLICES_VECTORS_V3 = (
    "8e1a730304f79b4e6f4348184128d95eeb9efbb4dd11198230d35eb11e466aec",  # shard manifest, slot 0
    "4a8863ebe7794af2ef9c6b2f9d55f0092fcd028d1bd383f13bb5f36d55b87ab5",  # shard manifest, slot 1
)

SLICES_VECTORS = (
    "e47dd5a85d90e34131c2c7bb57edb9ce5f59044846f691dbcc0c804c65e139f3",  # shard manifest, slot 0 (version 4)
    "4a8863ebe7794af2ef9c6b2f9d55f0092fcd028d1bd383f13bb5f36d55b87ab5",  # shard manifest, slot 1 (version 3: slices only; unchanged)
    "420156ecef3deffd1c79ad2ca01f53369a605105b1cca05e5463d3b090d0b5c2",  # full root
)
#: The slices vector's learned-state root (version 4): that of ``w`` saved alone by one slot.
SLICES_LEARNED_ROOT = "80df4c4f57d26f1eb1ab15139ad8e4888aa847775ec577f57c9194f1cbb2f773"


# -- slices alone (SPEC.md §24, issue 35): a commit whose highest shard manifests are version 3 only
# because they record slices is version 3, and a transition of it, recording none, is version 1 -------


def _small_slices_vector() -> dict[str, str]:
    """The small slices vector's ids from SPEC.md's values alone: the first vector's ``layer.weight``
    (float32 [2, 3], one object) held by two slots, slot 0 row 0 (it records the entry), slot 1 row 1;
    then its repartition into one slot."""
    enc = lambda d: json.dumps(d, sort_keys=True, separators=(",", ":")).encode()  # noqa: E731
    h = lambda d: blake3.blake3(enc(d)).hexdigest()  # noqa: E731
    entry = {"dtype": "float32", "name": "layer.weight", "optim": None, "param": blake3.blake3(array("f", [0, 0.25, 0.5, 0.75, 1.0, 1.25]).tobytes()).hexdigest(),
             "shape": [2, 3]}  # fmt: skip
    base = {"algorithm": "none", "config": None, "groups": [], "job": "vector-job", "parent": None, "rng": [], "slots": 2,
            "step": 0, "type": "shard", "version": 3}  # fmt: skip
    s0 = h(
        base | {"slot": 0, "entries": [entry], "slices": [{"name": "layer.weight", "shape": [1, 3], "start": [0, 0]}]}
    )
    s1 = h(base | {"slot": 1, "entries": [], "slices": [{"name": "layer.weight", "shape": [1, 3], "start": [1, 0]}]})
    none = {"algorithm": "none", "groups": []}
    learned = h({"config": None, "data_cursor": None, "optimizer": none, "step": 0, "tensors": [entry], "type": "learned",
                 "version": 1})  # fmt: skip
    commit = {"config": None, "data_cursor": None, "job": "vector-job", "learned_root": learned, "optimizer": none,
              "parent": None, "profile": "fp32", "schedule": None, "step": 0, "transition": "init", "type": "commit", "version": 3,
              "layout": [{"shard": s0, "slot": 0, "tensors": ["layer.weight"]}, {"shard": s1, "slot": 1, "tensors": []}]}  # fmt: skip
    cid = h(commit)
    moved = h(base | {"slot": 0, "slots": 1, "entries": [entry], "parent": cid, "version": 1})
    child = h(commit | {"layout": [{"shard": moved, "slot": 0, "tensors": ["layer.weight"]}], "parent": cid,
                        "transition": "repartition", "version": 1})  # fmt: skip
    return {"shard 0": s0, "shard 1": s1, "learned": learned, "commit": cid, "moved shard": moved, "moved": child}


#: SPEC.md §24's small slices vector.
SMALL_SLICES_VECTOR = {
    "shard 0": "ed5995acd1b85893197b9b167b9c655361af96abef0c9afea9f1df672fbea2cd",
    "shard 1": "1dae62ee9c1e8b36eebd2c7d9d100360fa856979451b71cfd97270fff510a1ce",
    "learned": "b654bff7fcd81044a0a747587af2f8b3b859b81779d05378d34c9722bd8254f2",
    "commit": "41f0af61c342dda85cb8569e5b8049336a5556f7e482f963963bc6336daba01a",
    "moved shard": "fc9e192ff5877e8614514c8822926689e76c7be389178a2dc418e08dcb5c1970",
    "moved": "557a5037bf696bc2c26873cabf55f493920c895c5053826043ea96b02ab9e530",
}


def test_a_commit_version_3_by_slices_alone_and_its_transition():
    """SPEC.md §5.1's version rule for commits (issue 35, item 6, contradiction a): a commit is the
    highest version of its shard manifests', so one whose shard manifests are version 3 only
    because they record slices is version 3 (its learned-state document is version 1); a
    transition keeps its grid and records no slices, so its repartition is version 1 with the same
    learned-state root. Ids from SPEC.md's values alone, then from the writer."""
    from shardstore.checkpoint.slots import write_shard_entries
    from shardstore.format.manifest import banded
    from shardstore.format.slices import make_slices

    want = _small_slices_vector()
    assert want == SMALL_SLICES_VECTOR
    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    w = torch.tensor([[0, 0.25, 0.5], [0.75, 1.0, 1.25]])
    info = ss.CommitInfo(step=0, job="vector-job", transition="init")
    states = [ss.SlotState({"layer.weight": w}, slices=make_slices([("layer.weight", ((0, 0), (1, 3)))])),
              ss.SlotState({}, slices=make_slices([("layer.weight", ((1, 0), (1, 3)))]))]  # fmt: skip
    cid = ss.save_slots(store, states, info=info, ref=None, parent=None)
    lc = ss.load_commit(store, cid)
    assert (lc.commit.version, lc.shards[0].version, lc.shards[1].version) == (3, 3, 3)
    assert (lc.shard_ids[0], lc.shard_ids[1], lc.commit.learned_root, cid) == (
        want["shard 0"], want["shard 1"], want["learned"], want["commit"])  # fmt: skip
    moved = ss.CommitInfo(step=0, job="vector-job", transition="repartition")
    (entry,) = lc.shards[0].entries
    sid = write_shard_entries(store, [entry], groups=[], algorithm="none", rng={}, info=moved, parent=cid, slot=0, slots=1,
                              bands=banded(lc.commit.version))  # fmt: skip
    child = ss.write_commit(store, [sid], info=moved, parent=cid)
    assert store.commit(child).version == 1 and store.commit(child).learned_root == lc.commit.learned_root
    assert (sid, child) == (want["moved shard"], want["moved"])
    assert ss.verify(store, [cid, child]).ok


def _init_commit(version: int, layout: list[dict], learned_root: str, optimizer: dict) -> str:
    """A chunked vector's commit id from SPEC.md §24's values (as ``tests/test_grid.py``'s): step 0,
    job ``vector-job``, profile ``fp32``, transition ``init``, no schedule, data cursor, config or parent."""
    doc = {"config": None, "data_cursor": None, "job": "vector-job", "layout": layout, "learned_root": learned_root, "optimizer": optimizer,
           "parent": None, "profile": "fp32", "schedule": None, "step": 0, "transition": "init", "type": "commit", "version": version}  # fmt: skip
    return blake3.blake3(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_state_and_slices_full_roots_from_the_values_spec_states():
    """The chunked state and slices vectors' full roots on both grids (version 3's no longer
    written, still stated in SPEC.md §24), and the slices vector's learned-state root (that of
    ``w`` alone: version 2's learned-state document on the row-band grid), from SPEC.md alone."""
    topt = {
        "algorithm": "torch",
        "groups": [],
        "torch_optimizer": {"class_name": "torch.optim.sgd.SGD", "groups": [{"hyper": HYPER, "name": "g0"}]},
    }
    none = {"algorithm": "none", "groups": []}
    full = {}
    for boxes, version in ((BANDS, 3), (TILES, 4)):
        shard_id, root = _independent(boxes, version)
        full["state", version] = _init_commit(version, [{"shard": shard_id, "slot": 0, "tensors": ["w"]}], root, topt)
        manifests = _slice_manifests(boxes, version)
        s0, s1 = (blake3.blake3(m).hexdigest() for m in manifests)
        learned = {"config": None, "data_cursor": None, "optimizer": none, "step": 0, "tensors": json.loads(manifests[0])["entries"],
                   "type": "learned", "version": 2 if version == 3 else 4}  # fmt: skip
        alone = blake3.blake3(json.dumps(learned, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        full["slices", version] = _init_commit(
            version, [{"shard": s0, "slot": 0, "tensors": ["w"]}, {"shard": s1, "slot": 1, "tensors": []}], alone, none
        )
        full["learned", version] = alone
    assert full["state", 4] == STATE_VECTORS[2] and full["slices", 4] == SLICES_VECTORS[2]
    assert full["state", 3] == "346cef81caea1db8fc543da808d361ba925a91536f2ea5674555a8c9a7f3b08a"
    assert full["slices", 3] == "3619a549d4809ab6789dfde2ec70c3fbb81169b85b84beb862ff27275b0b13c6"
    assert (
        full["learned", 3] == "87487da2a3effa47abfb07096475c38002236244ce7345bf9bad31c401de7302"
    )  # the version-2 vector's (tests/test_grid.py)
    assert full["learned", 4] == SLICES_LEARNED_ROOT


@pytest.mark.parametrize(
    "forge, message",
    [
        (lambda s0, s1: (s0, ()), "cover 1048576 of its 1572864 elements"),  # slot 1's row unheld
        (lambda s0, s1: (s0, (msgspec.structs.replace(s1[0], start=(1, 0)),)), "overlap but are not the same box"),
        (lambda s0, s1: (s0, (msgspec.structs.replace(s1[0], name="v"),)), "which the commit does not hold"),
        (lambda s0, s1: (s0, (msgspec.structs.replace(s1[0], shape=(2, COLS)),)), "lies outside shape"),
    ],
)
def test_forged_slices_are_refused_naming_tensor_and_slot(forge, message):
    from shardstore.format.slices import make_slices

    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    info = ss.CommitInfo(step=0, job="vector-job", transition="init")
    s0, s1 = make_slices([("w", ((0, 0), (2, COLS)))]), make_slices([("w", ((2, 0), (1, COLS)))])
    a, b = forge(s0, s1)
    with pytest.raises(ss.LayoutError, match=message):
        ss.save_slots(
            store, [ss.SlotState({"w": w}, slices=a), ss.SlotState({}, slices=b)], info=info, ref=None, parent=None
        )


def test_export_and_diff_read_chunked_state_block_by_block(tmp_path):
    from safetensors.torch import load_file

    from shardstore.ops.diff import diff
    from shardstore.ops.interchange import export_commit

    store = ss.open_store(str(tmp_path / "s"))
    state, info = _state()
    a = ss.save_slots(store, [state], info=info, ref=None, parent=None)
    m = state.optim.params["w"].torch_state.tensors["momentum_buffer"]
    m[2, :3] += 1.0  # only block 1 (row 2) of the momentum changes
    b = ss.save_slots(store, [state], info=info, ref=None, parent=None)
    export_commit(store, b, str(tmp_path / "out"), with_optimizer=True, weights_only=True)  # no model config
    assert torch.equal(load_file(str(tmp_path / "out" / "optimizer.state.momentum_buffer.safetensors"))["w"], m)
    (w,) = diff(store, a, b, stats=True).tensors
    assert w.stats["state momentum_buffer"].max_abs_diff == 1.0


@pytest.mark.parametrize(
    "split, want",
    [
        ([[(0, 1366)], [(1366, 1366)], [(2732, 1364)]], [{0, 1}, {0, 1, 2, 3}, {2, 3}]),  # dim 0 over 3 slots (uneven)
        ([[(0, N, 0, N // 2)], [(0, N, N // 2, N // 2)]], [{0, 2}, {1, 3}]),  # dim 1 over 2: a column of tiles each
        (
            [
                [(0, N // 2, 0, N // 2)],
                [(0, N // 2, N // 2, N // 2)],
                [(N // 2, N // 2, 0, N // 2)],
                [(N // 2, N // 2, N // 2, N // 2)],
            ],
            [{0}, {1}, {2}, {3}],
        ),  # (Shard(0), Shard(1)) on 2 x 2: one tile each
        (
            [[(0, N // 2)], [(0, N // 2)], [(N // 2, N // 2)], [(N // 2, N // 2)]],
            [{0, 1}, {0, 1}, {2, 3}, {2, 3}],
        ),  # dim 0, replicated
        (
            [[(0, 1), (3000, 1)], [(1, 2999), (3001, 1095)]],
            [{0, 1, 2, 3}, {0, 1, 2, 3}],
        ),  # strided (SPEC.md §15.4 parts)
    ],
    ids=["dim0x3", "dim1x2", "2x2", "dim0x2-replicated", "strided-parts"],
)
def test_slot_k_selection_is_exactly_the_blocks_its_slices_overlap(split, want):
    """uint8 [4096, 4096] (16 MiB): 2 x 2 tiles of 2048 x 2048, in C order 0 (top left), 1, 2, 3.
    Slot k's selection (``copy --shard k``) is given by hand from the rows and columns its slices cover."""
    from shardstore.format.slices import make_slices
    from shardstore.ops.transfer import commit_closure

    t = torch.randint(0, 256, (N, N), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def box(b):
        r0, nr, c0, nc = b if len(b) == 4 else (*b, 0, N)
        return (r0, c0), (nr, nc)

    states = [
        ss.SlotState({"t": t} if k == 0 else {}, slices=make_slices([("t", box(b)) for b in boxes]))
        for k, boxes in enumerate(split)
    ]
    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    lc = ss.load_commit(
        store,
        ss.save_slots(store, states, info=ss.CommitInfo(step=0, job="j", transition="init"), ref=None, parent=None),
    )
    blocks = lc.entries()["t"].param
    assert [(tuple(b.start), tuple(b.shape)) for b in blocks] == [((0, 0), (2048, 2048)), ((0, 2048), (2048, 2048)),
                                                                  ((2048, 0), (2048, 2048)), ((2048, 2048), (2048, 2048))]  # fmt: skip
    for k in range(len(split)):
        assert set(commit_closure(lc, k).data) == {blocks[i].object for i in want[k]}, k
        assert ss.verify(store, [lc.id], slot=k).ok


def test_diff_reports_slices_between_two_splits_of_one_learned_state():
    from shardstore.format.slices import make_slices
    from shardstore.ops.diff import diff

    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    info = ss.CommitInfo(step=0, job="vector-job", transition="init")

    def split(rows: int) -> str:
        states = [ss.SlotState({"w": w}, slices=make_slices([("w", ((0, 0), (rows, COLS)))])),
                  ss.SlotState({}, slices=make_slices([("w", ((rows, 0), (ROWS - rows, COLS)))]))]  # fmt: skip
        return ss.save_slots(store, states, info=info, ref=None, parent=None)

    a, b = split(2), split(1)
    d = diff(store, a, b)
    assert a != b and d.learned_root_equal and not d.tensors and not d.empty
    assert {(f.name, f.before, f.after) for f in d.fields} == {
        ("slices.0.w", "[0:2, 0:524288]", "[0:1, 0:524288]"),
        ("slices.1.w", "[2:3, 0:524288]", "[1:3, 0:524288]"),
    }
    assert not diff(store, a, a).fields


def _pairwise_slice_problems(shards, entries):
    """The pairwise check commit_slice_problems made before it swept (kept as the oracle)."""
    import math

    from shardstore.format.grid import intersect

    held: dict = {}
    for slot, shard in sorted(shards.items()):
        for x in shard.slices:
            e = entries.get(x.name)
            if e is None:
                yield "unheld", x.name, slot
                continue
            box = (tuple(x.start), tuple(x.shape))
            if len(box[0]) != len(e.shape) or any(s + n > d for s, n, d in zip(box[0], box[1], e.shape)):
                yield "outside", x.name, slot
                continue
            held.setdefault(x.name, {}).setdefault(box, []).append(slot)
    for name, boxes in sorted(held.items()):
        regions = sorted(boxes.items())
        clash = next(
            ((a, b) for i, (a, _) in enumerate(regions) for b, _ in regions[i + 1 :] if intersect(a, b) is not None),
            None,
        )
        if clash is not None:
            yield "overlap", name, None
            continue
        if sum(math.prod(b[1]) for b, _ in regions) != math.prod(entries[name].shape):
            yield "cover", name, regions[0][1][0]


def _kind(message: str) -> str:
    return next(
        k
        for k, word in (
            ("unheld", "does not hold"),
            ("outside", "lies outside"),
            ("overlap", "overlap"),
            ("cover", "cover"),
        )
        if word in message
    )


def _shards(boxes_by_slot):
    from types import SimpleNamespace

    from shardstore.format.manifest import Slice

    return {
        s: SimpleNamespace(slices=tuple(Slice(name=n, start=b[0], shape=b[1]) for n, b in bs))
        for s, bs in boxes_by_slot.items()
    }


def test_slice_check_agrees_with_the_pairwise_check():
    """On small random boxes (replicas, gaps, overlaps, empty and outside boxes), the check
    accepts and refuses exactly what the pairwise check did; where that found no overlap it
    reports the gap, and where it found one it reports an overlap or (when the slices also
    leave an element uncovered) that gap."""
    from types import SimpleNamespace

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from shardstore.format.slices import commit_slice_problems

    @st.composite
    def case(draw):
        shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))

        def box():  # inside the shape, or one past it on a dim; sometimes empty
            start = tuple(draw(st.integers(0, d)) for d in shape)
            return start, tuple(draw(st.integers(0, d - a + draw(st.integers(0, 1)))) for a, d in zip(start, shape))

        n = draw(st.integers(1, 4))
        return shape, {
            s: [(draw(st.sampled_from(["w", "w", "v"])), box()) for _ in range(draw(st.integers(0, 6)))]
            for s in range(n)
        }

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(case())
    def check(c):
        shape, by_slot = c
        shards, entries = _shards(by_slot), {"w": SimpleNamespace(shape=shape)}
        got = list(commit_slice_problems(shards, entries))
        want = list(_pairwise_slice_problems(shards, entries))
        assert [n for _, n, _ in got] == [n for _, n, _ in want]
        for (m, _, slot), (k, _, w) in zip(got, want):
            assert _kind(m) == k or (k, _kind(m)) == ("overlap", "cover"), (m, k)
            if _kind(m) != "overlap":
                assert slot == w or k == "overlap"

    check()


def _coverage(boxes, shape):
    """Element → how many of ``boxes`` cover it (every element of ``shape``)."""
    import itertools

    return {
        x: sum(all(a <= i < a + n for i, a, n in zip(x, *b)) for b in boxes)
        for x in itertools.product(*(range(d) for d in shape))
    }


@st.composite
def _tilings(draw):
    """(shape, distinct boxes): an exact cover made by cutting boxes in two, then perhaps
    one box dropped, moved, grown or added, and some empty boxes."""
    shape = tuple(draw(st.lists(st.integers(1, 5), max_size=3)))
    boxes = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 8))):
        (start, extent) = boxes.pop(draw(st.integers(0, len(boxes) - 1)))
        cuttable = [k for k, n in enumerate(extent) if n > 1]
        if not cuttable:
            boxes.append((start, extent))
            continue
        k = draw(st.sampled_from(cuttable))
        c = draw(st.integers(1, extent[k] - 1))
        boxes.append((start, extent[:k] + (c,) + extent[k + 1 :]))
        boxes.append((start[:k] + (start[k] + c,) + start[k + 1 :], extent[:k] + (extent[k] - c,) + extent[k + 1 :]))
    change = draw(st.sampled_from(["none", "none", "drop", "move", "grow", "add"]))
    if shape and change != "none":
        i = draw(st.integers(0, len(boxes) - 1))
        start, extent = boxes[i]
        k = draw(st.integers(0, len(shape) - 1))
        if change == "drop":
            boxes.pop(i)
        elif change == "move" and start[k] > 0:
            boxes[i] = (start[:k] + (start[k] - 1,) + start[k + 1 :], extent)
        elif change == "grow" and start[k] + extent[k] < shape[k]:
            boxes[i] = (start, extent[:k] + (extent[k] + 1,) + extent[k + 1 :])
        elif change == "add":
            a = tuple(draw(st.integers(0, d - 1)) for d in shape)
            boxes.append((a, tuple(draw(st.integers(1, d - x)) for x, d in zip(a, shape))))
    boxes += [((0,) * len(shape), (0,) * len(shape))] * draw(st.integers(0, 1)) if shape else []
    return shape, sorted(set(boxes))


@given(_tilings())
@example(
    ((3, 3), [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 1), (1, 1)), ((1, 2), (2, 1)), ((2, 0), (1, 2))])
)  # pinwheel
@example(((3, 3), [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2))]))  # pinwheel, no centre
@example(((), [((), ())]))
@example(((), []))
@settings(max_examples=400, deadline=None, derandomize=True, database=None)
def test_tiling_defect_agrees_with_counting_every_element(case):
    """tiling_defect is None exactly when every element is covered once; an overlap it names
    is two boxes sharing an element, a gap an element none covers, and it names a gap when no
    element is covered twice (brute force over every element of small tensors)."""
    from shardstore.format.grid import intersect
    from shardstore.format.slices import Gap, Overlap, tiling_defect

    shape, boxes = case
    count = _coverage(boxes, shape)
    got = tiling_defect(boxes, shape)
    assert (got is None) == all(c == 1 for c in count.values()), (got, count)
    if isinstance(got, Overlap):
        assert got.first < got.second and intersect(boxes[got.first], boxes[got.second]) is not None
    if isinstance(got, Gap):
        assert count[got.element] == 0
    if got is not None and max(count.values(), default=0) <= 1:
        assert isinstance(got, Gap)


def _counting(monkeypatch):
    """Counters of the slice check's work: box comparisons and fingerprint terms."""
    import shardstore.format.slices as slices
    from shardstore.format.grid import intersect

    calls = {"intersect": 0, "term": 0}

    def counted(a, b):
        calls["intersect"] += 1
        if calls["intersect"] > 100_000:
            raise AssertionError("the slice check compares boxes pairwise")
        return intersect(a, b)

    term = slices._term

    def counted_term(*args):
        calls["term"] += 1
        return term(*args)

    monkeypatch.setattr(slices, "intersect", counted)
    monkeypatch.setattr(slices, "_term", counted_term)
    return calls


def test_twenty_thousand_slices_are_checked_without_comparing_pairs(monkeypatch):
    """Regression: every pair of slices was compared (4,000 slices: 11.8 s; a 64 MiB manifest
    holds ~800,000). A 100 x 200 mesh's slices, each held twice, make ~40,000 records: the
    check accepts them, and refuses one moved row or one missing slice, comparing no boxes and
    with work linear in the number of distinct slices."""
    from types import SimpleNamespace

    import shardstore.format.slices as slices

    calls = _counting(monkeypatch)
    rows, cols = 100, 200
    boxes = [("w", ((3 * i, 2 * j), (3, 2))) for i in range(rows) for j in range(cols)]
    entries = {"w": SimpleNamespace(shape=(3 * rows, 2 * cols))}
    by_slot = {0: boxes, 1: boxes[::-1]}  # replicas: identical boxes held by two slots
    assert list(slices.commit_slice_problems(_shards(by_slot), entries)) == []
    moved = boxes[:-1] + [("w", ((3 * rows - 4, 2 * cols - 2), (3, 2)))]  # overlaps its upper neighbour
    assert [_kind(m) for m, _, _ in slices.commit_slice_problems(_shards({0: moved}), entries)] == ["overlap"]
    assert [_kind(m) for m, _, _ in slices.commit_slice_problems(_shards({0: boxes[1:]}), entries)] == ["cover"]
    strips = [("w", ((0, j), (3 * rows, 1))) for j in range(2 * cols)] + [
        ("w", ((0, 0), (1, 2 * cols)))
    ]  # a row across every strip
    assert [_kind(m) for m, _, _ in slices.commit_slice_problems(_shards({0: strips}), entries)] == ["overlap"]
    assert calls["intersect"] == 0 and calls["term"] <= 4 * (3 * rows * cols + len(strips)), calls


@pytest.mark.parametrize("defect", ["none", "missing column", "moved column", "row across the columns"])
def test_full_width_rows_above_half_height_columns_are_checked_in_linear_work(defect, monkeypatch):
    """Regression (issue 30): 4,000 full-width rows over the top half of a tensor and 4,000
    half-height columns under them (an exact cover, 8,000 slices) made the check hold every
    column at once while it swept the rows' dim: quadratic, 2,000 slices 5.6 s, a 2 MB
    manifest ~30 min, in every reader. Now it compares no boxes, computes one fingerprint
    term per slice when they tile, and at most a few per slice to name a defect."""
    from types import SimpleNamespace

    import shardstore.format.slices as slices

    calls = _counting(monkeypatch)
    half = 4000
    rows = [("w", ((i, 0), (1, half))) for i in range(half)]
    cols = [("w", ((half, j), (half, 1))) for j in range(half)]
    boxes, want = {
        "none": (rows + cols, []),
        "missing column": (rows + cols[:1999] + cols[2000:], ["cover"]),
        "moved column": (rows + cols[:-1] + [("w", ((half - 1, half - 1), (half, 1)))], ["overlap"]),
        "row across the columns": (rows + cols + [("w", ((2 * half - 1, 0), (1, half)))], ["overlap"]),
    }[defect]
    entries = {"w": SimpleNamespace(shape=(2 * half, half))}
    got = list(slices.commit_slice_problems(_shards({0: boxes[::2], 1: boxes[1::2]}), entries))
    assert [_kind(m) for m, _, _ in got] == want
    if defect == "missing column":
        assert "none covers the element at [4000, 1999]" in got[0][0]
    assert calls["intersect"] == 0
    assert calls["term"] <= (len(boxes) + 1 if defect == "none" else 4 * len(boxes)), calls
