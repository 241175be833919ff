"""The chunked vectors (SPEC.md §24): the chunked state vector (SGD momentum on format 4's tiles,
format 3's row bands still stated), the slices vector, the small slices vector of a commit
version 3 by slices alone and its transition, and their full roots, each recomputed from
SPEC.md with ``json``, ``array`` and ``blake3`` only and then made by the writer.
"""

from __future__ import annotations

import json
import uuid
from array import array

import blake3
import torch
from chunk_vectors import (
    BANDS,
    COLS,
    HYPER,
    ROWS,
    TILES,
    independent,
    saved,
    slice_manifests,
)

import shardstore as ss

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
    assert independent(BANDS, 3) == STATE_VECTORS_V3


def test_chunked_state_vector_matches_an_independent_encoder():
    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    cid = saved(store)
    lc = ss.load_commit(store, cid)
    (st,) = lc.entries()["w"].state.tensors
    assert [(b.start, b.shape) for b in st.object] == TILES
    shard_id, root = independent()
    assert lc.commit.version == 4 and lc.shards[0].version == 4
    assert (lc.shard_ids[0], lc.commit.learned_root) == (shard_id, root)
    assert (shard_id, root, cid) == STATE_VECTORS
    assert ss.verify(store).ok


def test_the_version_3_slices_vector_is_unchanged():
    assert [blake3.blake3(m).hexdigest() for m in slice_manifests(BANDS, 3)] == list(SLICES_VECTORS_V3)


def test_slices_vector_matches_an_independent_encoder():
    from shardstore.format.slices import make_slices

    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    info = ss.CommitInfo(step=0, job="vector-job", transition="init")
    states = [ss.SlotState({"w": w}, slices=make_slices([("w", ((0, 0), (2, COLS)))])),
              ss.SlotState({}, slices=make_slices([("w", ((2, 0), (1, COLS)))]))]  # fmt: skip
    cid = ss.save_slots(store, states, info=info, ref=None, parent=None)
    lc = ss.load_commit(store, cid)
    assert [bytes(store.get(lc.shard_ids[i])) for i in (0, 1)] == slice_manifests(TILES, 4)
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
    """A chunked vector's commit id from SPEC.md §24's values (as ``tests/shardstore/format/test_grid.py``'s): step 0,
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
        shard_id, root = independent(boxes, version)
        full["state", version] = _init_commit(version, [{"shard": shard_id, "slot": 0, "tensors": ["w"]}], root, topt)
        manifests = slice_manifests(boxes, version)
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
    )  # the version-2 vector's (tests/shardstore/format/test_grid.py)
    assert full["learned", 4] == SLICES_LEARNED_ROOT
