"""The canonical block grid and chunked payloads (SPEC.md §Chunked payloads, §Block exchange).

Pure tests, no processes: the grid's vectors, a chunked commit's pinned ids recomputed from
SPEC.md with ``json`` and ``blake3`` only, a Hypothesis property that a restore into any
split reads exactly the blocks it overlaps, and the typed errors for damaged or forged
payloads. (Blocks assembled from any split, the block plan over a mesh:
tests/shardstore/sharded/test_block_plan.py.)
"""

from __future__ import annotations

import itertools
import json
import math
import uuid
from array import array

import blake3
import msgspec
import pytest
import torch
from faults import CountingStore
from hypothesis import given, settings
from hypothesis import strategies as st
from split_cases import mesh_regions, split_cases

import shardstore as ss
from shardstore.format.grid import (
    BLOCK_BYTES,
    block_count,
    box_slices,
    grid,
    intersect,
    make_payload,
    overlapping,
    read_jobs,
    tile_shape,
)
from shardstore.format.manifest import Block
from shardstore.format.tensors import ITEMSIZES

MiB = 1 << 20


@pytest.mark.parametrize(
    "dtype, shape, boxes",
    [
        ("float32", (2, 3), [((0, 0), (2, 3))]),  # small: one block, the whole tensor
        ("float32", (), [((), ())]),
        ("int64", (0, 7), [((0, 0), (0, 7))]),  # empty: one (empty) block
        ("float32", (1 << 20,), [((0,), (1 << 20,))]),  # exactly the bound: one block
        ("float32", (10, 131072), [((0, 0), (8, 131072)), ((8, 0), (2, 131072))]),  # bands of 8 rows
        ("bfloat16", (3, 1 << 21), [((0, 0), (1, 1 << 21)), ((1, 0), (1, 1 << 21)), ((2, 0), (1, 1 << 21))]),
        # one row exceeds the bound: one row at a time, cut along the last dim
        (
            "float32",
            (2, 1100000),
            [((0, 0), (1, 1048576)), ((0, 1048576), (1, 51424)), ((1, 0), (1, 1048576)), ((1, 1048576), (1, 51424))],
        ),
        (
            "float64",
            (2, 3, 300000),
            [((i, j, 0), (1, 1, 300000)) for i in range(2) for j in range(3)],
        ),  # cut along dim 1
    ],
)
def test_row_band_grid_vectors(dtype, shape, boxes):
    """The grid of versions 2 and 3, still what their stores are checked against (SPEC.md §5.1)."""
    assert BLOCK_BYTES == 4 * MiB
    assert grid(dtype, shape, bands=True) == boxes
    assert block_count(dtype, shape, bands=True) == len(boxes)


def _tiles(shape, tile):
    runs = [[(j, min(n, d - j)) for j in range(0, d, n)] for d, n in zip(shape, tile)]
    return [(tuple(r[0] for r in c), tuple(r[1] for r in c)) for c in itertools.product(*runs)]


@pytest.mark.parametrize(
    "dtype, shape, tile",
    [
        ("float32", (2, 3), (2, 3)),  # small: one block, the whole tensor
        ("float32", (), ()),
        ("int64", (0, 7), (0, 7)),  # empty: one (empty) block
        ("float32", (1 << 20,), (1 << 20,)),  # exactly the bound: one block
        ("float32", (3 << 20,), (786432,)),  # 1-d: halved twice, four pieces of 3 MiB
        ("float32", (10, 131072), (10, 65536)),  # the larger extent is halved: two column tiles
        ("float32", (4096, 4096), (1024, 1024)),  # square: 4 x 4 tiles of 4 MiB
        ("bfloat16", (4096, 11008), (1024, 1376)),  # an MLP weight: 4 x 8 tiles
        ("float32", (1501, 1500), (751, 750)),  # uneven: rounding up, the last tile of a run is smaller
        ("float32", (10000, 3, 3), (10000, 3, 3)),  # 360 kB: one block
        ("float32", (200000, 3, 3), (100000, 3, 3)),  # bands of whole 3 x 3 cells
        ("float64", (2, 3, 300000), (2, 3, 75000)),  # the last dim halved until the tile fits
        ("float32", (8, 1024, 1024), (8, 256, 512)),  # 3-d: the largest extents halved in turn
    ],
)
def test_tile_grid_vectors(dtype, shape, tile):
    """The tile grid of version 4 (SPEC.md §5.1): the tile shape, and the blocks it gives in C order."""
    assert tile_shape(dtype, shape) == tile
    boxes = grid(dtype, shape)
    assert boxes == (
        [((0,) * len(shape), tuple(shape))]
        if math.prod(shape) * ITEMSIZES[dtype] <= BLOCK_BYTES
        else _tiles(shape, tile)
    )
    assert block_count(dtype, shape) == len(boxes)
    assert all(math.prod(b[1]) * ITEMSIZES[dtype] <= BLOCK_BYTES for b in boxes) or len(boxes) == 1


def test_tiles_bound_the_reads_of_row_column_and_2d_splits():
    """What the tile grid is for: on a 64 MiB weight, a Shard(0), Shard(1) or 2 x 2 split of
    2 or 4 ranks overlaps exactly its share of blocks; on the row-band grid a column split
    overlaps every block."""
    shape = (4096, 4096)
    share = {  # (name, region) of rank 0 of each split
        "Shard(0) x2": ((0, 0), (2048, 4096)), "Shard(1) x2": ((0, 0), (4096, 2048)),
        "Shard(1) x4": ((0, 0), (4096, 1024)), "(Shard(0), Shard(1)) 2x2": ((0, 0), (2048, 2048)),
    }  # fmt: skip
    for name, region in share.items():
        read = sum(math.prod(b[1]) for b in grid("float32", shape) if intersect(b, region)) * 4
        assert read == math.prod(region[1]) * 4, name
    bands = sum(math.prod(b[1]) for b in grid("float32", shape, bands=True) if intersect(b, share["Shard(1) x2"])) * 4
    assert bands == 4096 * 4096 * 4  # the whole tensor: what issue 26 measured


# Chunked commits pinned by id (SPEC.md §Test vectors): element i = i.


def _independent_ids(n_rows: int, cols: int, boxes, version: int) -> tuple[list[str], str, str]:
    """Block ids, shard manifest id and learned root from SPEC.md's rules, without shardstore:
    each block's object is its box's elements in C order (rows of the box, each a byte range)."""
    raw = array("f", range(n_rows * cols)).tobytes()
    row = cols * 4
    ids = []
    for (r0, c0), (nr, nc) in boxes:
        ids.append(
            blake3.blake3(
                b"".join(raw[(r0 + i) * row + c0 * 4 : (r0 + i) * row + (c0 + nc) * 4] for i in range(nr))
            ).hexdigest()
        )
    blocks = [{"object": oid, "shape": list(ext), "start": list(start)} for (start, ext), oid in zip(boxes, ids)]
    entry = {"dtype": "float32", "name": "w", "optim": None, "param": blocks, "shape": [n_rows, cols]}
    enc = lambda d: json.dumps(d, sort_keys=True, separators=(",", ":")).encode()  # noqa: E731
    shard = {
        "algorithm": "none",
        "config": None,
        "entries": [entry],
        "groups": [],
        "job": "vector-job",
        "parent": None,
        "rng": [],
        "slot": 0,
        "slots": 1,
        "step": 0,
        "type": "shard",
        "version": version,
    }
    learned = {
        "config": None,
        "data_cursor": None,
        "optimizer": {"algorithm": "none", "groups": []},
        "step": 0,
        "tensors": [entry],
        "type": "learned",
        "version": version,
    }
    return ids, blake3.blake3(enc(shard)).hexdigest(), blake3.blake3(enc(learned)).hexdigest()


def test_the_version_2_chunked_vector_is_unchanged():
    """Format 2's vector (float32 [3, 524288] on the row-band grid: rows 0-1, row 2) stays
    pinned, recomputed from SPEC.md alone; ``tests/shardstore/format/test_legacy_store.py`` reads a store of it."""
    boxes = [((0, 0), (2, 524288)), ((2, 0), (1, 524288))]
    assert grid("float32", (3, 524288), bands=True) == boxes
    ids, shard_id, root = _independent_ids(3, 524288, boxes, 2)
    assert (ids, shard_id, root) == CHUNKED_VECTORS[:3]
    # and its full root, from SPEC.md §24's values alone (no test of a store pins it)
    assert (
        _init_commit(2, [{"shard": shard_id, "slot": 0, "tensors": ["w"]}], root, {"algorithm": "none", "groups": []})
        == CHUNKED_VECTORS[3]
    )


def _tiled_state() -> tuple[torch.Tensor, ss.CommitInfo]:
    return torch.arange(1501 * 1500, dtype=torch.float32).reshape(1501, 1500), ss.CommitInfo(
        step=0, job="vector-job", transition="init"
    )


def test_tiled_vectors_match_an_independent_encoder():
    store = ss.open_store(f"memory://grid-{uuid.uuid4().hex}")
    w, info = _tiled_state()
    cid = ss.save_slots(store, [ss.SlotState({"w": w})], info=info, ref=None, parent=None)
    lc = ss.load_commit(store, cid)
    e = lc.entries()["w"]
    boxes = [((0, 0), (751, 750)), ((0, 750), (751, 750)), ((751, 0), (750, 750)), ((751, 750), (750, 750))]
    ids, shard_id, root = _independent_ids(1501, 1500, boxes, 4)
    assert [(tuple(b.start), tuple(b.shape)) for b in e.param] == boxes
    assert [b.object for b in e.param] == ids
    assert lc.shard_ids[0] == shard_id
    assert lc.commit.learned_root == root
    assert lc.commit.version == 4 and lc.shards[0].version == 4
    assert (ids, shard_id, root, cid) == TILED_VECTORS
    assert (
        _init_commit(4, [{"shard": shard_id, "slot": 0, "tensors": ["w"]}], root, {"algorithm": "none", "groups": []})
        == cid
    )  # SPEC.md §24 alone
    assert ss.verify(store).ok
    back = torch.zeros(1501, 1500)
    ss.restore(store, cid, {"w": back})
    assert torch.equal(back, w)


def _init_commit(version: int, layout: list[dict], learned_root: str, optimizer: dict) -> str:
    """The id of a chunked vector's commit manifest from SPEC.md §24's values: step 0, job
    ``vector-job``, profile ``fp32``, transition ``init``, no schedule, data cursor, config or parent."""
    doc = {"config": None, "data_cursor": None, "job": "vector-job", "layout": layout, "learned_root": learned_root, "optimizer": optimizer,
           "parent": None, "profile": "fp32", "schedule": None, "step": 0, "transition": "init", "type": "commit", "version": version}  # fmt: skip
    return blake3.blake3(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


CHUNKED_VECTORS = (
    [
        "376340a03365bddb93ff1cac75c539a9741fcb30ffb28646efbe48b213defcd3",
        "a1908d9f1d0da682bd5e9fbd6178c8b7ed5e2abc608c77532321545a08dca5ad",
    ],
    "3063682d113132e8e6e11f8d7382e853010cb0e8919f9d742bda0457f21fc1c3",  # shard manifest
    "87487da2a3effa47abfb07096475c38002236244ce7345bf9bad31c401de7302",  # learned-state root
    "cbabe2bd0f6aa625b333a66e19094dedb9e3870c1945edd17215c0864e5b83ac",  # full root
)

TILED_VECTORS = (
    [
        "c70bc3ac4cc264292dbd5395b9a3cf18bc207e5ecd538fdff7d3e344a5fdbda2",
        "d4433455bd0eb0d758f0a82d72ee8c7d48fc696a95b88dd9cadf18f11292ccd1",
        "ad397486da4e3cd39ced9995a4abc0ee587d2f76cff26ba145a0e4d253c8dca8",
        "c16d9b427ce61e81b22f8d3a3dd6f58556366ffbe767ca6d34035f941fe085dd",
    ],
    "44f8c828ff5081c354aadd6584755fe604272f859ac162c002b95553386db67c",  # shard manifest (version 4)
    "5be2aa23a8d5f492625d59ad8e166817d6bc6a4b21a6ed5d083e1c364fa240e4",  # learned-state root (version 4)
    "d47a9b0138bf67f333ecd05b1414224be9b68bc51325bf573a51a73a5e504e69",  # full root
)


# -- the property: a restore into any split reads exactly what it overlaps --------------------


@settings(max_examples=100, deadline=None)
@given(split_cases(), st.data())
def test_restore_into_any_split_reads_exactly_the_overlapping_blocks(case, data):
    dtype, shape, bound, splits, _ = case
    tdtype = ss.format.tensors.torch_dtype(dtype)
    whole = (torch.arange(math.prod(shape)) % 253).to(tdtype).reshape(shape)
    store = ss.open_store(f"memory://grid-{uuid.uuid4().hex}")
    bands = data.draw(st.booleans())  # the tile grid, or the row-band grid of versions 2-3 (still read)
    boxes = grid(dtype, shape, block_bytes=bound, bands=bands)
    ids = [store.put_tensor(whole[box_slices(b, (0,) * len(shape))].contiguous()) for b in boxes]
    payload = make_payload(dtype, shape, ids, block_bytes=bound, bands=bands)
    origin, extent = data.draw(st.sampled_from(sorted(mesh_regions(shape, splits, 1))))
    dest = torch.zeros(extent, dtype=tdtype)
    counting = CountingStore(store)
    nread = sum(job() for job in read_jobs(counting, payload, dtype, shape, dest, origin, "t"))
    # brute force: the blocks holding at least one element of the region
    want = set()
    for idx in itertools.product(*(range(o, o + n) for o, n in zip(origin, extent))):
        want |= {i for i, (s, e) in enumerate(boxes) if all(a <= x < a + b for x, a, b in zip(idx, s, e))}
    got = [ids.index(oid) for oid in counting.read]
    assert sorted(got) == sorted(want) and len(got) == len(set(got))
    assert overlapping(payload, dtype, shape, (origin, extent)) == sorted(want) if len(boxes) > 1 else True
    assert nread == sum(math.prod(boxes[i][1]) for i in want) * tdtype.itemsize
    assert torch.equal(dest, whole[box_slices((origin, extent), (0,) * len(shape))])


# -- damaged and forged payloads --------------------------------------------------------------


@pytest.fixture(scope="module")
def chunked():
    """A commit with one chunked parameter and chunked Adam moments (10 x 131072 float32: 2 column tiles each)."""
    store = ss.open_store(f"memory://grid-{uuid.uuid4().hex}")
    m = torch.nn.Linear(131072, 10)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(2, 131072)).sum().backward()
    opt.step()
    cid = ss.save(store, m, opt, step=1, rng=False)
    return store, cid, m, opt


def _forge(store: ss.Store, cid: str, blocks) -> str:
    c = store.commit(cid)
    lay = c.layout[0]
    shard = store.shard(lay.shard)
    entries = tuple(
        msgspec.structs.replace(e, param=blocks(e.param)) if e.name == "weight" else e for e in shard.entries
    )
    sid = store.put_manifest(msgspec.structs.replace(shard, entries=entries))
    return store.put_manifest(msgspec.structs.replace(c, layout=(msgspec.structs.replace(lay, shard=sid),)))


def _b(start, shape, oid):
    return Block(start=start, shape=shape, object=oid)


@pytest.mark.parametrize(
    "forge, message",
    [
        (lambda p: (_b((0, 0), (8, 131072), p[0].object), _b((8, 0), (1, 131072), p[1].object)), "do not tile"),
        (
            lambda p: (_b((0, 0), (8, 131072), p[0].object), _b((7, 0), (3, 131072), p[1].object)),
            "blocks 0 and 1 .* overlap",
        ),
        (
            lambda p: (_b((0, 0), (5, 131072), p[0].object), _b((5, 0), (5, 131072), p[1].object)),
            "canonical grid's block 0",
        ),
        (
            lambda p: (_b((0, 0), (8, 131072), p[0].object), _b((8, 0), (3, 131072), p[1].object)),
            "block 1 .* lies outside",
        ),
        (lambda p: p[0].object, "must be 2 blocks, not one object"),
        (lambda p: (*p, _b((0, 0), (1, 1), p[0].object)), "overlap"),
    ],
)
def test_forged_grids_are_refused_naming_tensor_and_block(chunked, forge, message):
    store, cid, m, opt = chunked
    bad = _forge(store, cid, forge)
    with pytest.raises(ss.GridError, match=message) as e:
        ss.load_commit(store, bad)
    assert "'weight'" in str(e.value) and "param payload" in str(e.value)
    with pytest.raises(ss.GridError):
        ss.restore(store, bad, torch.nn.Linear(131072, 10))
    report = ss.verify(store, [bad], deep=False)
    assert any(p.kind == "GridError" and p.tensor == "weight" for p in report.problems)


def test_a_small_tensor_listed_as_blocks_is_refused(chunked):
    store, cid, _, _ = chunked
    c = store.commit(cid)
    shard = store.shard(c.layout[0].shard)
    bias = next(e for e in shard.entries if e.name == "bias")
    forged = (_b((0,), (5,), bias.param), _b((5,), (5,), bias.param))
    entries = tuple(msgspec.structs.replace(e, param=forged) if e.name == "bias" else e for e in shard.entries)
    sid = store.put_manifest(msgspec.structs.replace(shard, entries=entries))
    bad = store.put_manifest(msgspec.structs.replace(c, layout=(msgspec.structs.replace(c.layout[0], shard=sid),)))
    with pytest.raises(ss.GridError, match="'bias'.*fits one block"):
        ss.load_commit(store, bad)


def test_corrupt_or_missing_block_is_refused_naming_tensor_and_block(chunked, tmp_path):
    _, _, m, opt = chunked
    store = ss.open_store(str(tmp_path / "s"))
    cid = ss.save(store, m, opt, step=1, rng=False)
    e = ss.load_commit(store, cid).entries()["weight"]
    victim = e.optim.exp_avg[1].object
    path = tmp_path / "s" / "objects" / victim[:2] / victim
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    fresh, fopt = torch.nn.Linear(131072, 10), None
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    with pytest.raises(ss.CorruptObject, match=r"exp_avg of 'weight'.*block 1.*" + victim):
        ss.restore(store, cid, fresh, fopt, threads=1)
    report = ss.verify(store)
    assert [(p.kind, p.tensor, p.object) for p in report.problems] == [("CorruptObject", "weight", victim)]
    assert "exp_avg block 1" in str(report.problems[0])
    path.unlink()
    report = ss.verify(store)
    assert [(p.kind, p.tensor, p.object) for p in report.problems] == [("ObjectNotFound", "weight", victim)]
    with pytest.raises(ss.ObjectNotFound):
        ss.restore(store, cid, fresh, fopt, threads=1)
    # the parameter itself, restored without the optimizer, needs neither moment block
    assert ss.restore(store, cid, fresh).tensors == ["bias", "weight"]
    assert torch.equal(fresh.weight, m.weight)


def test_version_1_commits_stay_version_1(chunked):
    store = ss.open_store(f"memory://grid-{uuid.uuid4().hex}")
    cid = ss.save(store, torch.nn.Linear(4, 3), step=0, rng=False)
    lc = ss.load_commit(store, cid)
    assert lc.commit.version == 1 and lc.shards[0].version == 1
    big_store, big, _, _ = chunked
    c = big_store.commit(big)
    with pytest.raises(ss.ManifestError, match="version 1 must be version 2 or 4"):
        ss.manifest.decode(ss.encode(msgspec.structs.replace(big_store.shard(c.layout[0].shard), version=1)))


def test_tools_understand_chunked_payloads(chunked, tmp_path, capsys):
    """diff --stats, export (block by block), import (same blocks back), copy, show and verify."""
    from safetensors.torch import load_file

    from shardstore.ops.diff import diff
    from shardstore.ops.interchange import export_commit, import_directory
    from shardstore_cli.shardstore_cli import main

    _, _, m, opt = chunked
    store = ss.open_store(str(tmp_path / "s"))
    a = ss.save(store, m, opt, step=1, rng=False, config={"num_hidden_layers": 1})
    kept = m.weight.detach().clone()
    with torch.no_grad():
        m.weight[9, -5:] += 1.0  # only the second block (columns 65536-131071) of the weight changes
    try:
        b = ss.save(store, m, opt, step=1, rng=False, config={"num_hidden_layers": 1})
        changed = m.weight.detach().clone()
    finally:
        with torch.no_grad():
            m.weight.copy_(kept)  # the module-scoped fixture stays as it was
    d = diff(store, a, b, stats=True)
    (w,) = d.tensors
    assert w.name == "weight" and w.after.param[0] == w.before.param[0] and w.after.param[1] != w.before.param[1]
    assert abs(w.stats["param"].max_abs_diff - 1.0) < 1e-6  # fp32 rounding of w + 1
    out = tmp_path / "export"
    export_commit(store, b, str(out), with_optimizer=True)
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["weight"], changed)
    assert torch.equal(load_file(str(out / "optimizer.exp_avg.safetensors"))["weight"], opt.state[m.weight]["exp_avg"])
    back = import_directory(store, str(out), ref=None)
    assert ss.load_commit(store, back).entries()["weight"].param == ss.load_commit(store, b).entries()["weight"].param
    dst = ss.open_store(str(tmp_path / "copy"))
    ss.copy_commit(store, dst, b)
    assert ss.verify(dst).ok
    fresh = torch.nn.Linear(131072, 10)
    ss.restore(dst, b, fresh)
    assert torch.equal(fresh.weight, changed)
    assert main(["verify", str(tmp_path / "s")]) == 0
    capsys.readouterr()
    assert main(["show", str(tmp_path / "s"), b, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["commit"]["version"] == 4 and shown["totals"]["objects"] == 3 * 3  # weight: 2 blocks x 3, bias: 1 x 3


def test_metadata_only_repartition_of_a_chunked_commit_writes_no_tensor_bytes(chunked):
    from shardstore.checkpoint.slots import write_shard_entries

    store, cid, _, _ = chunked
    lc = ss.load_commit(store, cid)
    entries = sorted(lc.entries().values(), key=lambda e: e.name)
    before = set(store.objects())
    info = ss.CommitInfo(step=lc.commit.step, job=lc.commit.job, transition="repartition")
    groups = list(lc.commit.optimizer.groups)
    sids = [
        write_shard_entries(store, [e], groups=[g for g in groups if g.name == e.optim.group], algorithm=lc.commit.optimizer.algorithm,
                            rng={}, info=info, parent=cid, slot=i, slots=2)
        for i, e in enumerate(entries)
    ]  # fmt: skip
    new = ss.write_commit(store, sids, info=info, parent=cid)
    assert store.commit(new).learned_root == lc.commit.learned_root and store.commit(new).version == 4
    assert set(store.objects()) - before == {new, *sids}  # manifests only
    assert ss.verify(store, [new]).ok


def test_blocks_of_the_same_object_are_read_once_and_fill_every_destination():
    """``run_reads`` reads an object once however many blocks name it (equal tiles of one tensor,
    equal tensors): a peer's copy is handed to one read and let go (SPEC.md §19.3), so a second
    read of it would go to the store. Each destination still gets the block's bytes at its place."""
    from shardstore.format.grid import run_reads

    shape, bound = (4, 8), 32  # four 2 x 4 tiles
    tile = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    whole = tile.repeat(2, 2)  # every tile the same bytes: one object
    store = ss.open_store(f"memory://grid-{uuid.uuid4().hex}")
    boxes = grid("float32", shape, block_bytes=bound)
    ids = [store.put_tensor(whole[box_slices(b, (0, 0))].contiguous()) for b in boxes]
    assert len(set(ids)) == 1 and len(ids) == 4
    payload = make_payload("float32", shape, ids, block_bytes=bound)
    counting = CountingStore(store)
    a = torch.zeros(shape)  # a whole tensor
    b = torch.zeros(3, 5)  # another one's slice, from (1, 2): across all four tiles
    jobs = read_jobs(counting, payload, "float32", shape, a, (0, 0), "a")
    jobs += read_jobs(counting, payload, "float32", shape, b, (1, 2), "b")
    assert len(jobs) == 8
    assert run_reads(jobs, threads=4, once_per_object=True) == 2 * 4 * 4  # the bytes read: one 2 x 4 float32 block
    assert counting.read == [ids[0]]
    assert torch.equal(a, whole) and torch.equal(b, whole[1:4, 2:7])


def test_merging_the_blocks_of_one_object_costs_time_linear_in_the_blocks(monkeypatch: pytest.MonkeyPatch):
    """``_once_per_object`` merges every block naming one object into one read: equal tensors
    (a model's zero-filled moments, its norm weights of ones) may be thousands, which
    ``read_state_dict`` on several threads now merges too. Each destination is moved into the
    merged read once, not copied again at every later merge (quadratic: 32000 zero tensors of one
    shape took 1.6 s before a byte was read)."""
    from shardstore.format import grid as grid_mod

    built = [0]  # destinations (hits) of every BlockRead made by the merge

    class Counted(grid_mod.BlockRead):
        def __init__(self, *a: object) -> None:
            super().__init__(*a)  # type: ignore[arg-type]
            built[0] += len(self.hits)

    store = ss.open_store(f"memory://grid-{uuid.uuid4().hex}")
    oid = store.put_tensor(torch.zeros(4))
    dests = [torch.ones(4) for _ in range(500)]
    jobs = [job for i, d in enumerate(dests) for job in read_jobs(store, oid, "float32", (4,), d, (0,), f"t{i}")]
    monkeypatch.setattr(grid_mod, "BlockRead", Counted)
    merged = grid_mod._once_per_object(jobs)
    assert len(merged) == 1 and len(merged[0].hits) == len(dests)
    assert built[0] <= 2 * len(dests), built  # each destination handled a bounded number of times
    assert grid_mod.run_reads(jobs, threads=2, once_per_object=True) == 16
    assert all(not d.any() for d in dests)


def test_one_object_named_as_two_dtypes_and_block_shapes_is_read_once():
    """The same bytes may be one tensor's float32 block, another's int32 one and a third's
    flat block (equal content, one id): ``run_reads`` reads the object once for all three
    (``_OneObject``) and fills each from a view in its own dtype and shape."""
    from shardstore.format.grid import run_reads

    x = torch.arange(8, dtype=torch.float32).reshape(2, 4) + 0.5
    store = ss.open_store(f"memory://grid-{uuid.uuid4().hex}")
    oid = store.put_tensor(x)
    assert store.put_tensor(x.view(torch.int32)) == oid and store.put_tensor(x.reshape(8)) == oid
    counting = CountingStore(store)
    a, b, c, d = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(8), torch.zeros(2, 4)
    jobs = read_jobs(counting, oid, "float32", (2, 4), a, (0, 0), "a")
    jobs += read_jobs(counting, oid, "int32", (2, 4), b, (0, 0), "b")
    jobs += read_jobs(counting, oid, "float32", (8,), c, (0,), "c")
    jobs += read_jobs(counting, oid, "float32", (2, 4), d, (0, 0), "d")
    assert run_reads(jobs, threads=2, once_per_object=True) == 32
    assert counting.read == [oid]
    assert torch.equal(a, x) and torch.equal(d, x)
    assert torch.equal(b, x.view(torch.int32)) and torch.equal(c, x.reshape(8))


def test_blocks_naming_one_object_as_different_sizes_are_refused_as_read_alone_with_nothing_filled():
    """``_OneObject`` (one object read once for blocks of several dtypes or shapes) refuses as each
    block read alone does: an object of another size than a block's dtype and shape is a
    ``TensorMismatch`` naming that block's own dtype and shape (not the byte buffer it is read
    into), and a block that needs another size than the object has is refused before any
    destination is filled (the object itself is not corrupt: it hashed to its id)."""
    from shardstore.format.grid import run_reads

    x = torch.arange(8, dtype=torch.float32)
    store = ss.open_store(f"memory://grid-{uuid.uuid4().hex}")
    oid = store.put_tensor(x)
    # every block wrong: the object has 32 bytes, each names 48 (run_reads without check_reads)
    a, b = torch.zeros(12), torch.zeros(12, dtype=torch.int32)
    jobs = read_jobs(store, oid, "float32", (12,), a, (0,), "tensor 'a'")
    jobs += read_jobs(store, oid, "int32", (4, 3), b, (0, 0), "tensor 'b'")
    with pytest.raises(ss.TensorMismatch, match=r"tensor 'a'.*float32\[12\] needs 48"):
        run_reads(jobs, threads=1, once_per_object=True)
    # the first block right, the second wrong: refused, naming the second, nothing filled
    a, b = torch.zeros(8), torch.zeros(12, dtype=torch.int32)
    jobs = read_jobs(store, oid, "float32", (8,), a, (0,), "tensor 'a'")
    jobs += read_jobs(store, oid, "int32", (12,), b, (0,), "tensor 'b'")
    with pytest.raises(ss.TensorMismatch, match=r"tensor 'b'.*holds 32 bytes.*int32\[12\] needs 48"):
        run_reads(jobs, threads=1, once_per_object=True)
    assert not a.any() and not b.any()
