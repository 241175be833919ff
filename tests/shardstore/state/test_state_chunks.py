"""Chunked torch-form optimizer state (format 4) and large extras/buffers (SPEC.md §5.1, §9.1-§9.3).

Pure tests, no processes: a version-2 store whose large state tensor is one object stays
readable; forged payloads are refused naming tensor and state key; a large extra's tensor is
stored whole and a large buffer chunked, each restored bitwise. (The chunked vectors:
tests/shardstore/format/test_chunk_vectors.py.)
"""

from __future__ import annotations

import uuid

import msgspec
import pytest
import torch
from chunk_vectors import (
    BANDS,
    COLS,
    ROWS,
    saved,
    slot_state,
)
from conftest import TensorHolder

import shardstore as ss
from shardstore.format.manifest import encode


def _legacy_v2(store: ss.Store) -> tuple[str, torch.Tensor]:
    """A commit as format 2 wrote it: the parameter chunked on the row-band grid, its large state tensor one object."""
    from shardstore.format.grid import box_slices, make_payload

    state, info = slot_state()
    m = state.optim.params["w"].torch_state.tensors["momentum_buffer"]
    w = state.tensors["w"]
    cid = saved(store)
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
    cid = saved(store)
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


def test_a_large_extra_tensor_is_one_object_and_a_large_buffer_is_chunked():
    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    model = torch.nn.Linear(4, 2)
    model.register_buffer("table", torch.arange(3 * COLS, dtype=torch.float32).reshape(3, COLS))  # 6 MiB
    big = torch.arange(2 * COLS * 3, dtype=torch.float32)  # 12 MiB: an extra's one tensor bigger than a block
    cid = ss.save(store, model, step=0, rng=False, extra={"holder": TensorHolder(big)})
    lc = ss.load_commit(store, cid)
    assert lc.entries()["table"].kind == "buffer" and len(lc.entries()["table"].param) == 2
    (x,) = lc.commit.extras
    assert (
        isinstance(x.tensors[0].object, str) and lc.commit.version == 4
    )  # extras' tensors are one object; the buffer is on tiles
    back, holder = torch.nn.Linear(4, 2), TensorHolder(torch.empty(0))
    back.register_buffer("table", torch.zeros(3, COLS))
    ss.restore(store, cid, back, extra={"holder": holder})
    assert torch.equal(back.table, model.table) and torch.equal(holder.t, big)
    # an extra's tensor listed as blocks is refused: that form is the torch form's state only
    c = store.commit(cid)
    forged = (msgspec.structs.replace(x.tensors[0], object=lc.entries()["table"].param),)
    bad = store.put_manifest(msgspec.structs.replace(c, extras=(msgspec.structs.replace(x, tensors=forged),)))
    with pytest.raises(ss.ManifestError, match="extra 'holder': tensor 0 has a chunked payload"):
        ss.load_commit(store, bad)
