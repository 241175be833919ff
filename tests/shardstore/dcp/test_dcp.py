"""``shardstore.dcp`` in one process: DCP's ``save``/``load`` through ``StoreWriter``/``StoreReader``,
the DCP document (``format.dcp``), what a second save writes, what a partial read reads, the
command line on DCP commits, refusals and damage (SPEC.md §9.4). The multi-rank cases (FSDP2,
resharding, async saves, failures on every rank) are ``tests/shardstore/dcp/test_dcp_distributed.py``.
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import blake3
import msgspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from read_counter import ReadCounter
from safetensors.torch import load_file
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem, SavePlan, WriteItem, WriteItemType
from write_counter import WriteCounter

import shardstore as ss
from shardstore.backends.local import LocalStorage
from shardstore.dcp import StoreReader, StoreWriter
from shardstore.format.dcp import DCP_EXTRA, chunk_entry_name, dcp_extra, decode_document, encode_document
from shardstore.format.manifest import ExtraEntry
from shardstore.ops.interchange import export_commit
from shardstore_cli import shardstore_cli

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _state(seed: int = 0) -> dict:
    """Tensors of every kind DCP hands a storage writer, and non-tensor values (bytes items)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(8, 6, generator=g)
    return {
        "model": {
            "frozen.weight": torch.randn(64, 64, generator=g),
            "trained.weight": torch.randn(64, 64, generator=g),
            "half": torch.randn(16, generator=g).to(torch.bfloat16),
            "ids": torch.arange(5, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
            "transposed": wide.t(),  # not contiguous: stored in C order of its shape
            "big": torch.arange(1100 * 1000, dtype=torch.float32).reshape(1100, 1000),  # 4.4 MB: 2 tiles
            "layer weight": torch.ones(2),  # not a tensor name: its entry is named by its hash
        },
        "step": 7,
        "note": "frozen half",
        "hyper": {"lr": 0.001, "betas": (0.9, 0.999), "names": ["a", "b"]},
    }


def _fresh(state: dict) -> dict:
    """A state dict of the same structure with other values, to load into."""
    out = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    return out | {"step": 0, "note": "", "hyper": {"lr": 0.0, "betas": (0.0, 0.0), "names": []}}


def _assert_loaded(got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k
    assert (got["step"], got["note"], got["hyper"]) == (want["step"], want["note"], want["hyper"])


def test_save_and_load_round_trip_every_kind_of_value(tmp_path):
    root = str(tmp_path / "store")
    state = _state()
    writer = StoreWriter(root, ref="main", step=7)
    saved = dcp.save(state, storage_writer=writer)
    store = ss.open_store(root, create=False)
    assert store.ref("main") == writer.last_commit
    got = _fresh(state)
    reader = StoreReader(root)
    dcp.load(got, storage_reader=reader)
    _assert_loaded(got, state)
    assert reader.commit == writer.last_commit
    assert reader.read_metadata() == saved  # dcp.save's Metadata, storage_data included, read back equal
    lc = ss.load_commit(store, "main")
    entries = lc.entries()
    assert entries["model.big"].param[1].shape == (550, 1000) and len(entries["model.big"].param) == 2  # §5.1 tiles
    assert chunk_entry_name("model.layer weight", (0,), True) in entries
    assert chunk_entry_name("model.layer weight", (0,), True).startswith("dcp/")
    assert lc.commit.step == 7 and lc.commit.parent is None and lc.commit.transition == "train"
    assert lc.commit.profile == "bf16+fp32" and ss.verify(store).ok


def test_a_second_save_with_half_the_state_frozen_writes_only_the_other_half(tmp_path):
    counter = WriteCounter(LocalStorage(str(tmp_path / "store")))
    store = ss.Store(counter)
    state = _state()
    dcp.save(state, storage_writer=StoreWriter(store, step=1))
    first = counter.bytes
    with torch.no_grad():
        state["model"]["trained.weight"].add_(1.0)  # 16 KiB changed; everything else as it was
    counter.bytes = counter.objects = 0
    dcp.save(state, storage_writer=StoreWriter(store, step=2))
    lc = ss.load_commit(store, "main")
    x = dcp_extra(lc.commit.extras)
    assert x == dcp_extra(ss.load_commit(store, lc.commit.parent).commit.extras)  # the same document: not rewritten
    manifests = sum(store.object_size(o) for o in [lc.id, *lc.shard_ids.values()])
    assert counter.bytes == 64 * 64 * 4 + manifests, (first, counter.bytes)  # the changed tensor and two manifests
    assert counter.objects == 1 + 2  # its object, the shard manifest, the commit
    assert first > 4_400_000  # the first save wrote everything (the big tensor alone is 4.4 MB)
    assert lc.commit.parent is not None and ss.load_commit(store, lc.commit.parent).commit.step == 1


class _Planner:
    """The two planner calls a tensor read makes: into preallocated targets."""

    def __init__(self, targets: dict) -> None:
        self.targets = targets

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.targets[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def test_a_read_of_part_of_a_chunk_reads_only_the_tiles_it_overlaps(tmp_path):
    root = str(tmp_path / "store")
    big = torch.arange(1100 * 1000, dtype=torch.float32).reshape(1100, 1000)
    dcp.save({"big": big}, storage_writer=StoreWriter(root))
    counter = ReadCounter(LocalStorage(root))
    reader = StoreReader(ss.Store(counter, create=False))
    reader.read_metadata()
    item = ReadItem(  # rows 600-799: inside the second tile (rows 550-1099)
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("part"),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("big", [0, 0]),
        storage_offsets=torch.Size([600, 0]),
        lengths=torch.Size([200, 1000]),
    )
    part = torch.zeros(200, 1000)
    before = counter.bytes
    reader.read_data(LoadPlan([item]), _Planner({"part": part})).wait()
    assert torch.equal(part, big[600:800])
    assert counter.bytes - before == 550 * 1000 * 4  # one tile of two, verified, never the other
    bad = ReadItem(**{**vars(item), "storage_offsets": torch.Size([1000, 0])})  # rows 1000-1199 of 1100
    with pytest.raises(ss.TensorMismatch, match="leaves its shape"):
        reader.read_data(LoadPlan([bad]), _Planner({"part": part}))


def _column_tiled(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """8 MiB of float32 (4 MiB of bfloat16) whose grid cuts its columns in two (SPEC.md §5.1): each
    tile is [8, 131072], rows 512 KiB apart in the tensor, so no tile is contiguous in a target of its shape."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 262144, generator=g).to(dtype)


class _Recording(_Planner):
    def __init__(self, targets: dict) -> None:
        super().__init__(targets)
        self.committed: list[str] = []

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(item.dest_index.fqn)


def _whole_reads(reader: StoreReader, names: list[str]) -> LoadPlan:
    md = reader.read_metadata()
    items = []
    for fqn in names:
        size = md.state_dict_metadata[fqn].size
        zero = torch.Size([0] * len(size))
        items.append(
            ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn), zero, MetadataIndex(fqn, zero), zero, torch.Size(size))
        )
    return LoadPlan(items)


@pytest.mark.parametrize("threads", [1, 3])
def test_tiles_strided_in_their_target_are_read_through_a_reused_buffer(tmp_path, monkeypatch, threads):
    """A tile that is not one byte range of its target goes through its thread's one reused buffer
    (never memory of its own per block: bench_dcp), and every target still gets its own bytes."""
    root = str(tmp_path / "store")
    state = {"a": _column_tiled(1), "b": _column_tiled(2), "c": _column_tiled(3, torch.bfloat16)}
    dcp.save(state, storage_writer=StoreWriter(root))
    entries = ss.load_commit(ss.open_store(root, create=False), "main").entries()
    assert all(len(entries[k].param) == 2 for k in ("a", "b")) and isinstance(entries["c"].param, str)

    def no_fresh_memory(self, oid, dtype, shape, *, what="tensor"):
        raise AssertionError(f"{what}: read into memory of its own")

    monkeypatch.setattr(ss.Store, "get_tensor", no_fresh_memory)
    got = {k: torch.full_like(v, -1) for k, v in state.items()}
    dcp.load(got, storage_reader=StoreReader(root, thread_count=threads))
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_a_corrupt_tile_strided_in_its_target_lands_nowhere(tmp_path):
    """The buffered path verifies a tile before any of its bytes is copied into the target: a byte
    flipped in the second tile of a tensor is refused naming its object, that tile's columns keep
    what the target held, and nothing is committed to the planner."""
    root = str(tmp_path / "store")
    state = {"w": _column_tiled(4)}
    dcp.save(state, storage_writer=StoreWriter(root))
    store = ss.open_store(root, create=False)
    second = ss.load_commit(store, "main").entries()["w"].param[1]
    assert tuple(second.start) == (0, 131072)
    path = Path(root) / "objects" / second.object[:2] / second.object
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # same size: only the hash can tell
    path.write_bytes(bytes(data))
    reader = StoreReader(root, thread_count=1)
    plan = _whole_reads(reader, ["w"])
    target = torch.full_like(state["w"], -1)
    planner = _Recording({"w": target})
    with pytest.raises(ss.CorruptObject, match=f"DCP chunk 'w', block 1.*{second.object}"):
        reader.read_data(plan, planner)
    assert torch.equal(target[:, :131072], state["w"][:, :131072])  # the first tile, verified, landed
    assert bool((target[:, 131072:] == -1).all())  # not one byte of the corrupt tile
    assert planner.committed == []


def test_commits_chain_and_verify_log_diff_show_them(tmp_path, capsys):
    root = str(tmp_path / "store")
    state = _state()
    dcp.save(state, storage_writer=StoreWriter(root, step=1))
    state["model"]["trained.weight"] += 1
    state["step"] = 8
    dcp.save(state, storage_writer=StoreWriter(root, step=2))
    store = ss.open_store(root, create=False)
    head = ss.load_commit(store, "main")
    first = head.commit.parent
    main = shardstore_cli.main
    capsys.readouterr()
    assert main(["verify", root]) == 0
    assert capsys.readouterr().out.startswith("ok: 2 commit(s)")
    assert main(["log", root, "--json"]) == 0
    log = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in log["commits"]] == [head.id, first] and [c["step"] for c in log["commits"]] == [2, 1]
    assert main(["diff", root, first, "main"]) == 0
    out = capsys.readouterr().out
    assert "model.trained.weight" in out and "model.frozen.weight" not in out.split("unchanged")[0]
    assert "dcp.step: bytes uint8" in out and "dcp.note" not in out  # the bytes item that changed, by its key
    assert main(["show", root, "main"]) == 0
    assert f"{DCP_EXTRA} (commit-wide): DCP metadata: 10 tensors in 10 chunks, 5 bytes items" in capsys.readouterr().out


def _with_document(store: ss.Store, items: dict) -> str:
    """A commit of the store's ``main`` shards whose DCP document lists ``items`` (fqn -> (size,
    [(offsets, entry name)])), each chunk's sizes its entry's: a split DCP's planner did not make."""
    lc = ss.load_commit(store, "main")
    doc = json.loads(bytes(store.get(dcp_extra(lc.commit.extras).state)))
    entries = lc.entries()
    doc["items"] = {
        fqn: doc["items"][chunks[0][1]]
        | {"size": size, "chunks": [{"entry": e, "offsets": o, "sizes": list(entries[e].shape)} for o, e in chunks]}
        for fqn, (size, chunks) in items.items()
    }
    doc["planner_data"] = None
    forged = store.put(_canonical(doc))
    extra = ExtraEntry(key=DCP_EXTRA, state=forged, tensors=())
    return ss.write_commit(
        store,
        [lc.shard_ids[i] for i in sorted(lc.shard_ids)],
        info=ss.CommitInfo(step=0, profile="fp32"),
        parent=None,
        extras=(extra,),
    )


def test_export_writes_each_tensor_whole_from_its_chunks(tmp_path):
    """``export`` of a DCP commit: every tensor under its key, bitwise, whatever split its chunks
    came in (one whole chunk; rows; columns, each chunk itself two tiles); the bytes items are
    no tensor of model.safetensors (SPEC.md §19.2)."""
    root, out = str(tmp_path / "store"), tmp_path / "out"
    state = _state()
    dcp.save(state, storage_writer=StoreWriter(root))
    assert shardstore_cli.main(["export", root, "main", str(out), "--weights-only"]) == 0
    got = load_file(out / "model.safetensors")
    want = {f"model.{k}": v for k, v in state["model"].items()}
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())

    wide = torch.randn(1100, 2000, generator=torch.Generator().manual_seed(3))  # each column half: 2 tiles
    root = str(tmp_path / "split")
    halves = {"r0": torch.arange(4.0), "r1": torch.arange(4.0) + 4, "c0": wide[:, :1000], "c1": wide[:, 1000:]}
    dcp.save(halves, storage_writer=StoreWriter(root))
    store = ss.open_store(root, create=False)
    cid = _with_document(
        store, {"v": ([8], [([0], "r0"), ([4], "r1")]), "w": ([1100, 2000], [([0, 1000], "c1"), ([0, 0], "c0")])}
    )
    assert ss.verify(store, [cid]).ok
    assert shardstore_cli.main(["export", root, cid, str(out), "--weights-only", "--force"]) == 0
    got = load_file(out / "model.safetensors")
    assert sorted(got) == ["v", "w"] and torch.equal(got["v"], torch.arange(8.0)) and torch.equal(got["w"], wide)


@pytest.mark.parametrize(
    "chunks, said",
    [
        ([([0], "a"), ([4], "b")], "its chunks hold 8 elements, the tensor 10: a gap"),
        ([([0], "a"), ([2], "b")], "the chunks at \\[0\\] and \\[2\\] overlap"),
    ],
)
def test_export_refuses_by_name_a_tensor_its_chunks_do_not_tile(tmp_path, chunks, said):
    """A DCP commit whose chunks of a tensor leave a gap or overlap (valid: DCP reads what a load
    plan asks for) exports nothing: a typed error naming the tensor, no directory (SPEC.md §19.2)."""
    root, out = str(tmp_path / "store"), tmp_path / "out"
    dcp.save({"a": torch.arange(4.0), "b": torch.arange(4.0), "ok": torch.ones(2)}, storage_writer=StoreWriter(root))
    store = ss.open_store(root, create=False)
    cid = _with_document(store, {"ok": ([2], [([0], "ok")]), "w": ([10 if "gap" in said else 8], chunks)})
    assert ss.verify(store, [cid]).ok
    with pytest.raises(ss.StateMismatch, match=f"DCP tensor 'w' of commit {cid} cannot be exported whole: {said}"):
        export_commit(store, cid, str(out), weights_only=True)
    assert not out.exists()
    assert shardstore_cli.main(["export", root, cid, str(out), "--weights-only"]) != 0
    assert not out.exists()


def test_gc_keeps_and_copy_carries_everything_a_dcp_commit_needs(tmp_path):
    """The document and the bytes items are in the commit's closure (SPEC.md §19.1): gc keeps them,
    copy carries them, and the copy loads."""
    root, other = str(tmp_path / "store"), str(tmp_path / "copy")
    dcp.save({"w": torch.arange(10.0), "n": {"a": 1}}, storage_writer=StoreWriter(root))
    dcp.save({"w": torch.arange(10.0) + 1, "n": {"a": 2}}, storage_writer=StoreWriter(root, ref="gone"))
    store = ss.open_store(root, create=False)
    store.delete_ref("gone", expected=store.ref("gone"))
    before = set(store.objects())
    ss.gc(store, grace_seconds=0, dry_run=False)
    assert len(set(store.objects())) == len(before) - 4  # the other commit, its shard manifest, w and n's bytes
    assert ss.verify(store).ok
    ss.copy_commit(store, ss.open_store(other), "main", ref="main")
    got = {"w": torch.zeros(10), "n": {"a": 0}}
    dcp.load(got, storage_reader=StoreReader(other))
    assert torch.equal(got["w"], torch.arange(10.0)) and got["n"] == {"a": 1}


def test_checkpoint_id_names_the_ref_and_the_target(tmp_path):
    root = str(tmp_path / "store")
    writer = StoreWriter(root, ref=None)
    dcp.save({"w": torch.ones(3)}, storage_writer=writer)  # ref None: a commit, no ref moved
    store = ss.open_store(root, create=False)
    assert store.refs() == {} and store.has(writer.last_commit)
    dcp.save({"w": torch.full((3,), 2.0)}, checkpoint_id="runs/a", storage_writer=writer)
    assert store.ref("runs/a") == writer.last_commit
    got = {"w": torch.zeros(3)}
    dcp.load(got, checkpoint_id=writer.last_commit[:12], storage_reader=StoreReader(root, "nothing"))
    assert torch.equal(got["w"], torch.full((3,), 2.0))
    assert StoreWriter.validate_checkpoint_id("runs/a") and not StoreWriter.validate_checkpoint_id("/abs/path")
    assert StoreReader.validate_checkpoint_id(writer.last_commit) and not StoreReader.validate_checkpoint_id("../x")
    with pytest.raises(ss.InvalidName):
        dcp.save({"w": torch.ones(3)}, checkpoint_id="/tmp/ckpt", storage_writer=writer)


def test_what_cannot_be_stored_is_refused_before_anything_is_written(tmp_path):
    root = str(tmp_path / "store")
    store = ss.open_store(root)
    with pytest.raises(BaseException, match="TensorMismatch.*'c'.*complex64"):  # DCP's CheckpointException
        dcp.save({"w": torch.ones(2), "c": torch.ones(2, dtype=torch.complex64)}, storage_writer=StoreWriter(root))
    assert list(store.objects()) == [] and store.refs() == {}
    writer = StoreWriter(root)
    with pytest.raises(ss.CommitProtocolError, match="use_collectives"):
        writer.set_up_storage_writer(True, rank=0, use_collectives=False)
    clash = [SavePlan([_tensor_item("w:4", [0], [4], [4])]), SavePlan([_tensor_item("w", [4], [4], [8])])]
    with pytest.raises(ss.UnsupportedState, match="would both be tensor entry 'w:4'"):
        writer.prepare_global_plan(clash)  # a whole tensor named like another's chunk: refused at planning
    with pytest.raises(ss.UnsupportedState, match="cannot cross to another process"):
        pickle.dumps(StoreWriter(ss.open_store("memory://dcp-refusals")))
    pickle.loads(pickle.dumps(StoreWriter(root)))  # a URL crosses
    with pytest.raises(ss.InvalidName):
        StoreWriter(root, ref="../escape")
    with pytest.raises(ss.ManifestError, match="job"):
        StoreWriter(root, job="bad job!")


class _ResolvesBytesTo(DefaultSavePlanner):
    """DCP's own planner, but resolving each bytes item to ``value`` (a planner's ``transform_object``)."""

    def __init__(self, value) -> None:
        super().__init__()
        self.value = value

    def transform_object(self, write_item, object):
        if write_item.type == WriteItemType.BYTE_IO:
            return self.value
        return super().transform_object(write_item, object)


def test_a_bytes_item_a_planner_resolves_to_anything_but_bytes_is_refused(tmp_path):
    """``bytes(5)`` is five zero bytes: a bytes item resolved to an int (or a one-element tensor)
    is refused naming its key, never committed as zeros; bytes as such are stored as they are."""
    root = str(tmp_path / "store")
    store = ss.open_store(root)
    for value in (5, torch.tensor([3])):
        with pytest.raises(BaseException, match="UnsupportedState.*bytes item 'n'.*resolved it to a"):
            dcp.save({"w": torch.ones(2), "n": 3}, storage_writer=StoreWriter(root), planner=_ResolvesBytesTo(value))
        assert store.refs() == {}
    raw = b"\x00not a pickle\xff"
    writer = StoreWriter(root)
    dcp.save({"w": torch.ones(2), "n": 3}, storage_writer=writer, planner=_ResolvesBytesTo(bytearray(raw)))
    x = dcp_extra(ss.load_commit(store, writer.last_commit).commit.extras)
    assert bytes(store.get(x.tensors[0].object)) == raw


def _tensor_item(fqn: str, offsets: list[int], sizes: list[int], size: list[int]) -> WriteItem:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData

    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size(size))
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD, tensor_data=data)


def test_loads_are_refused_for_other_commits_and_damaged_objects(tmp_path):
    root = str(tmp_path / "store")
    dcp.save({"w": torch.arange(6.0), "n": 3}, storage_writer=StoreWriter(root))
    store = ss.open_store(root, create=False)
    plain = ss.save(store, {"w": torch.ones(2)}, step=0, ref="plain", rng=False)
    # DCP catches what read_metadata raises and reports its message (not its class) on every rank
    with pytest.raises(BaseException, match="was not written through torch.distributed.checkpoint"):
        dcp.load({"w": torch.zeros(6)}, storage_reader=StoreReader(root, plain))
    with pytest.raises(ss.StateMismatch, match="no DCP document"):
        StoreReader(root, plain).read_metadata()
    with pytest.raises(ss.TargetNotFound):
        StoreReader(root, "absent").read_metadata()
    w = ss.load_commit(store, "main").entries()["w"].param
    path = Path(root) / "objects" / w[:2] / w
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(BaseException, match=f"CorruptObject.*{w}"):
        dcp.load({"w": torch.zeros(6), "n": 0}, storage_reader=StoreReader(root))
    report = ss.verify(store, ["main"])
    assert [p.kind for p in report.problems] == ["CorruptObject"] and report.problems[0].object == w


def test_a_document_that_disagrees_with_its_commit_is_refused(tmp_path):
    """A commit whose DCP document maps a chunk to an entry of another shape: verify reports it and
    the reader refuses it before reading a tensor byte (SPEC.md §9.4, §17)."""
    root = str(tmp_path / "store")
    dcp.save({"a": torch.ones(2), "b": torch.ones(3)}, storage_writer=StoreWriter(root))
    store = ss.open_store(root, create=False)
    lc = ss.load_commit(store, "main")
    x = dcp_extra(lc.commit.extras)
    doc = json.loads(bytes(store.get(x.state)))
    doc["items"]["a"]["chunks"][0]["entry"] = "b"  # a [2] chunk held by the [3] entry
    forged = store.put(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())
    info = ss.CommitInfo(step=0, profile="fp32")
    cid = ss.write_commit(
        store, [lc.shard_ids[0]], info=info, parent=None, extras=(ExtraEntry(key=DCP_EXTRA, state=forged, tensors=()),)
    )
    report = ss.verify(store, [cid])
    assert {p.kind for p in report.problems} == {"ManifestError"} and all(p.object == forged for p in report.problems)
    said = [str(p) for p in report.problems]
    assert any("entry 'b' is float32[3], the chunk float32[2]" in m for m in said), said
    assert any("entry 'b' is also the chunk of" in m for m in said) and any("first 'a'" in m for m in said), said
    with pytest.raises(ss.ManifestError, match="entry 'b' is float32\\[3\\]"):
        StoreReader(root, cid).read_metadata()


def test_the_document_decodes_strictly():
    raw = _canonical(_VECTOR_DOC)
    assert msgspec.json.encode(decode_document(raw, "vector"), order="sorted") == raw
    for bad in (
        raw.replace(b'"version":1', b'"version":2'),
        raw.replace(b'{"dcp_version"', b'{"extra":1,"dcp_version"'),
        raw.replace(b":", b": ", 1),  # not canonical
        raw.replace(b'"float32"', b'"complex64"', 1),
        raw.replace(b'"entry":"w"', b'"entry":"../w"'),
    ):
        with pytest.raises(ss.ManifestError):
            decode_document(bad, "forged")
    store = ss.open_store("memory://dcp-reserved")
    with pytest.raises(BaseException, match="UnsupportedState.*'tensor:0' starts with a prefix"):
        dcp.save({"tensor:0": {"x": 1}, "w": torch.ones(1)}, storage_writer=StoreWriter(store))
    assert list(store.objects()) == []  # refused while planning, before any write


def _nested(depth: int, leaf):
    """``leaf`` under ``depth - 1`` dicts: DCP flattens it to a key path of ``depth`` parts."""
    for _ in range(depth - 1):
        leaf = {"k": leaf}
    return {"w": leaf}


def test_a_value_nested_deeper_than_the_document_holds_is_refused_before_anything_is_written(tmp_path):
    """The DCP document holds key paths of at most 64 parts, and every reader (``read_metadata``,
    ``verify``) refuses a longer one: a save of a value nested deeper is refused while planning,
    never committed as a checkpoint no load can read (SPEC.md §9.4, §Limits)."""
    root = str(tmp_path / "store")
    store = ss.open_store(root)
    with pytest.raises(BaseException, match="UnsupportedState.*nested 65 levels deep"):
        dcp.save(_nested(65, torch.ones(2)), storage_writer=StoreWriter(root))
    assert list(store.objects()) == [] and store.refs() == {}
    dcp.save(_nested(64, torch.ones(2)), storage_writer=StoreWriter(root))  # the limit itself: saved and loaded
    got = _nested(64, torch.zeros(2))
    dcp.load(got, storage_reader=StoreReader(root))
    assert torch.equal(_leaf(got), torch.ones(2)) and ss.verify(store).ok
    # whatever else the encoder would write and the decoder refuse is refused by the encoder too
    doc = decode_document(_canonical(_VECTOR_DOC), "vector")
    with pytest.raises(ss.UnsupportedState, match="over a limit of the DCP document"):
        encode_document(msgspec.structs.replace(doc, planner_data={"b": ("k",) * 65, "w": ("w",)}))


def _leaf(sd: dict):
    x = sd["w"]
    while isinstance(x, dict):
        x = x["k"]
    return x


def test_shardstore_never_unpickles_a_bytes_item(tmp_path, monkeypatch, capsys):
    """verify, diff, show and read_metadata of a DCP commit with bytes items run with every
    unpickler disabled; only DCP's own load (the caller's planner) unpickles them."""
    root = str(tmp_path / "store")
    dcp.save({"w": torch.ones(2), "obj": {"k": [1, "two"]}}, storage_writer=StoreWriter(root))

    def refuse(*args, **kwargs):
        raise AssertionError("unpickled")

    for mod, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    store = ss.open_store(root, create=False)
    assert ss.verify(store).ok
    StoreReader(root).read_metadata()
    assert shardstore_cli.main(["diff", root, "main", "main"]) == 0
    assert shardstore_cli.main(["show", root, "main", "--json"]) == 0
    capsys.readouterr()


# -- the test vector of SPEC.md §24 (DCP commit) ----------------------------------------

_VECTOR_DOC = {
    "dcp_version": None,
    "items": {
        "b": {
            "chunks": [{"entry": "b", "offsets": [0], "sizes": [2]}],
            "dtype": "float32",
            "kind": "tensor",
            "layout": "strided",
            "memory_format": "contiguous_format",
            "pin_memory": False,
            "requires_grad": False,
            "size": [2],
        },
        "w": {
            "chunks": [{"entry": "w", "offsets": [0, 0], "sizes": [2, 3]}],
            "dtype": "float32",
            "kind": "tensor",
            "layout": "strided",
            "memory_format": "contiguous_format",
            "pin_memory": False,
            "requires_grad": False,
            "size": [2, 3],
        },
    },
    "planner_data": {"b": ["b"], "w": ["w"]},
    "storage_meta": None,
    "type": "dcp-metadata",
    "version": 1,
}
VECTOR_DOCUMENT = "975a436a356c88c4ab820316c0003dc7f75997ad6b2afdb760cfe6d5ecc1376a"
VECTOR_SHARD = "ba17dcac57f4dff9bf57fb41638a058b1dc2a6c413cbc54994db6247fb279808"
VECTOR_LEARNED_ROOT = "b40745a13f707cdb805108b460495c06814166a0eca801313d986906f233978a"
VECTOR_COMMIT = "531ffb756f16fda9c2e2c2911c09f7f8c2f3f0ca9e94889871d53c839bd0049f"


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _b3(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def test_vector(tmp_path):
    """SPEC.md §24's DCP vector: ``w`` float32 [2, 3] = 0, 0.25, ..., 1.25 and ``b`` float32
    [0.5, -1.0], saved by ``dcp.save`` in one process into an empty store (step 0, job
    ``default``): its DCP document, shard manifest, learned-state root and commit id, each
    rebuilt here from those values with ``json``, ``struct`` and ``blake3`` only."""
    import struct

    root = str(tmp_path / "store")
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4, "b": torch.tensor([0.5, -1.0])}
    writer = StoreWriter(root)
    dcp.save(state, storage_writer=writer)
    w, b = _b3(struct.pack("<6f", 0, 0.25, 0.5, 0.75, 1.0, 1.25)), _b3(struct.pack("<2f", 0.5, -1.0))
    document = _canonical(_VECTOR_DOC)
    entries = [
        {"dtype": "float32", "name": "b", "optim": None, "param": b, "shape": [2]},
        {"dtype": "float32", "name": "w", "optim": None, "param": w, "shape": [2, 3]},
    ]
    shard = {"algorithm": "none", "config": None, "entries": entries, "groups": [], "job": "default", "parent": None}
    shard |= {"rng": [], "slot": 0, "slots": 1, "step": 0, "type": "shard", "version": 1}
    extras = [{"key": DCP_EXTRA, "state": _b3(document), "tensors": []}]
    optimizer = {"algorithm": "none", "groups": []}
    learned = {"config": None, "data_cursor": None, "extras": extras, "optimizer": optimizer, "step": 0}
    learned |= {"tensors": entries, "type": "learned", "version": 1}
    commit = {"config": None, "data_cursor": None, "extras": extras, "job": "default", "optimizer": optimizer}
    commit |= {"layout": [{"shard": _b3(_canonical(shard)), "slot": 0, "tensors": ["b", "w"]}]}
    commit |= {"learned_root": _b3(_canonical(learned)), "parent": None, "profile": "fp32", "schedule": None}
    commit |= {"step": 0, "transition": "train", "type": "commit", "version": 1}
    assert (_b3(document), _b3(_canonical(shard))) == (VECTOR_DOCUMENT, VECTOR_SHARD)
    assert (_b3(_canonical(learned)), _b3(_canonical(commit))) == (VECTOR_LEARNED_ROOT, VECTOR_COMMIT)
    store = ss.open_store(root, create=False)
    assert writer.last_commit == store.ref("main") == VECTOR_COMMIT and bytes(store.get(VECTOR_COMMIT)) == _canonical(
        commit
    )
    assert bytes(store.get(VECTOR_DOCUMENT)) == document
    assert (w, b) == (  # the tensors of §24's first vector: a DCP save and a native save share objects
        "8eda9d89b70474cef7735b8d312688fe78131031beee7cda4f022b4f1e9c4559",
        "2289f11e7346cf789fa7f35974d30ed0420e97ec8527c2314adee1030be1fef4",
    )


def test_a_forged_list_index_in_the_flattening_map_is_refused_before_dcp_grows_the_list(tmp_path):
    """DCP's load grows each list of the flattening map to the largest index the map gives it: a
    forged index of 20,000,000 made a load allocate and fill that many slots (minutes, gigabytes)
    while ``verify`` called the commit sound. The document's lists are bounded (SPEC.md §9.4,
    §Limits): verify and the reader refuse it before DCP sees it, and a save beyond it is refused
    while planning."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    root = str(tmp_path / "store")
    dcp.save({"l": [torch.ones(2), torch.zeros(1)]}, storage_writer=StoreWriter(root))
    store = ss.open_store(root, create=False)
    lc = ss.load_commit(store, "main")
    doc = json.loads(bytes(store.get(dcp_extra(lc.commit.extras).state)))
    assert doc["planner_data"]["l.1"] == ["l", 1]
    commits = {}
    for index, said in ((20_000_000, "list index 20000000 is over the limit"), (-3, "list index -3 is negative")):
        doc["planner_data"]["l.1"] = ["l", index]
        forged = store.put(_canonical(doc))
        commits[index] = cid = ss.write_commit(
            store,
            [lc.shard_ids[0]],
            info=ss.CommitInfo(step=0, profile="fp32"),
            parent=None,
            extras=(ExtraEntry(key=DCP_EXTRA, state=forged, tensors=()),),
        )
        report = ss.verify(store, [cid])
        assert [p.kind for p in report.problems] == ["ManifestError"] and said in str(report.problems[0])
        with pytest.raises(BaseException, match=said):  # DCP wraps the reader's ManifestError, by message
            _load_state_dict_from_keys(storage_reader=StoreReader(root, cid))
    # many lists, each within the limit, over it together
    with pytest.raises(BaseException, match="UnsupportedState.*lists hold 1000002 items on load"):
        dcp.save(
            {"a": [{}] * 500_000 + [torch.ones(1)], "b": [{}] * 500_000 + [torch.ones(1)]},
            storage_writer=StoreWriter(root, ref="big"),
        )
    assert store.ref("big") is None
    got = _load_state_dict_from_keys(storage_reader=StoreReader(root, "main"))  # the sound commit still loads
    assert torch.equal(got["l"][0], torch.ones(2)) and torch.equal(got["l"][1], torch.zeros(1))
