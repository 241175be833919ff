"""Tests of shardstore.interchange: Hugging Face round trips, hand-written safetensors, sharding, errors."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import shardstore as ss
from shardstore.errors import InvalidName, LayoutError, ManifestError, StateMismatch, StorageError, TensorMismatch
from shardstore.ops.interchange import export_commit, import_directory, split_layers

transformers = pytest.importorskip("transformers")


def tiny_llama(path: Path, *, tied: bool, seed: int = 0, vocab_size: int = 128, **save: object) -> torch.nn.Module:
    """A tiny random Llama saved with save_pretrained (offline)."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(path), **save)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def llama_dir(request, tmp_path_factory) -> tuple[Path, torch.nn.Module, bool]:
    path = tmp_path_factory.mktemp("llama")
    return path, tiny_llama(path, tied=request.param), request.param


def logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.arange(24).reshape(2, 12) * 5 % 128
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("slots,max_shard", [(1, None), (2, 30_000)])
def test_round_trip_logits_equal(store, llama_dir, tmp_path, slots, max_shard):
    src, model, tied = llama_dir
    cid = import_directory(store, str(src), slots=slots)
    assert store.ref("main") == cid
    lc = ss.load_commit(store, cid)
    assert lc.commit.transition == "import" and lc.commit.optimizer.algorithm == "none"
    assert all(e.optim is None for e in lc.entries().values())
    assert ("lm_head.weight" in lc.entries()) == (not tied)
    assert ss.verify(store).ok
    out = tmp_path / "out"
    kw = {} if max_shard is None else {"max_shard_bytes": max_shard}
    result = export_commit(store, "main", str(out), **kw)
    assert result.sharded == (max_shard is not None)
    assert (out / "model.safetensors.index.json").exists() == result.sharded
    back = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    assert torch.equal(logits(back), logits(model))
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_slots_partition_layers(store, llama_dir):
    src, _, tied = llama_dir
    lc = ss.load_commit(store, import_directory(store, str(src), slots=2, ref=None))
    owner = lc.owner()
    assert owner["model.embed_tokens.weight"] == owner["model.norm.weight"] == 0
    assert owner.get("lm_head.weight", 0) == 0
    assert {owner[n] for n in owner if n.startswith("model.layers.0.")} == {0}
    assert {owner[n] for n in owner if n.startswith("model.layers.1.")} == {1}
    explicit = ss.load_commit(store, import_directory(store, str(src), layout=[(0, 0), (0, 2)], ref=None))
    assert {n for n, s in explicit.owner().items() if s == 0} == {n for n in owner if not n.startswith("model.layers.")}
    assert explicit.commit.learned_root == lc.commit.learned_root


def test_import_is_deterministic_and_moves_ref(store, llama_dir):
    src, _, _ = llama_dir
    a = import_directory(store, str(src), ref=None, parent=None)
    b = import_directory(store, str(src), ref=None, parent=None)
    assert a == b
    c = import_directory(store, str(src), ref="imports/x")
    d = import_directory(store, str(src), ref="imports/x")
    assert store.commit(d).parent == c and store.ref("imports/x") == d


def test_import_sharded_directory_with_index(store, tmp_path):
    model = tiny_llama(tmp_path / "src", tied=False, seed=1, max_shard_size="40KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").exists()
    import_directory(store, str(tmp_path / "src"))
    export_commit(store, "main", str(tmp_path / "out"))
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert torch.equal(logits(back), logits(model))


def test_hand_written_safetensors_match_the_library(store, tmp_path):
    tensors = {
        "a.f32": torch.randn(3, 5),
        "b.bf16": torch.randn(7).to(torch.bfloat16),
        "c.i64": torch.arange(5),
        "d.bool": torch.tensor([True, False, True]),
        "e.empty": torch.zeros(0, 4),
        "f.f16": torch.randn(2, 2).half(),
        "g.u8": torch.arange(9, dtype=torch.uint8),
        "h.f64": torch.randn(3, dtype=torch.float64),
    }
    ss.save(store, tensors, step=0, rng=False)
    export_commit(store, "main", str(tmp_path / "out"), weights_only=True)  # no model config: the files alone
    path = tmp_path / "out" / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    assert header["__metadata__"] == {"format": "pt"}
    for name, info in header.items():
        if name != "__metadata__":
            assert info["data_offsets"][0] % tensors[name].element_size() == 0  # aligned
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)
    assert not (tmp_path / "out" / "config.json").exists()  # the commit has no model config


def test_export_with_optimizer(store, trained, tmp_path):
    model, opt = trained
    ss.save(store, model, opt, step=3, config={"hidden": 8})
    result = export_commit(store, "main", str(tmp_path / "out"), with_optimizer=True)
    assert {"optimizer.exp_avg.safetensors", "optimizer.exp_avg_sq.safetensors", "optimizer.json"} <= set(result.files)
    with safe_open(str(tmp_path / "out" / "optimizer.exp_avg_sq.safetensors"), framework="pt") as f:
        for name, p in model.named_parameters():
            assert torch.equal(f.get_tensor(name), opt.state[p]["exp_avg_sq"])
    doc = json.loads((tmp_path / "out" / "optimizer.json").read_text())
    assert doc["algorithm"] == "adamw" and doc["tensors"]["mid.weight"] == {"group": "decay", "birth": 0, "age": 3}
    assert doc["groups"]["decay"]["weight_decay"] == 0.1
    with pytest.raises(StorageError, match="refusing to overwrite"):
        export_commit(store, "main", str(tmp_path / "out"))
    export_commit(store, "main", str(tmp_path / "out"), overwrite=True)
    sharded = export_commit(store, "main", str(tmp_path / "out"), max_shard_bytes=200, overwrite=True)
    left = {n for n in os.listdir(tmp_path / "out") if n.endswith((".safetensors", ".json"))}
    assert left == set(sharded.files)  # the unsharded files of the earlier export are gone
    with pytest.raises(StorageError, match="refusing to overwrite"):
        export_commit(store, "main", str(tmp_path / "out"))


def test_import_errors(store, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(ManifestError, match="config.json is missing"):
        import_directory(store, str(src))
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(ManifestError, match="no \\*.safetensors"):
        import_directory(store, str(src))
    save_file({"model.layers.0.w": torch.zeros(2), "model.layers.1.w": torch.ones(2)}, str(src / "model.safetensors"))
    with pytest.raises(LayoutError):
        import_directory(store, str(src), slots=3)
    with pytest.raises(LayoutError):
        import_directory(store, str(src), layout=[(0, 1), (2, 2)])
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.layers.0.w": "model.safetensors"}})
    )
    with pytest.raises(ManifestError, match="index and the files disagree"):
        import_directory(store, str(src))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../evil.safetensors"}}))
    with pytest.raises(InvalidName):
        import_directory(store, str(src))
    os.unlink(src / "model.safetensors.index.json")
    (src / "model-2.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ManifestError, match="not a readable safetensors file"):
        import_directory(store, str(src))
    assert store.refs() == {}


def test_split_layers():
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(LayoutError):
        split_layers(2, 3)


def test_import_widens_bf16_and_carries_tokenizer_assets(store, tmp_path):
    """A sharded bf16 directory (with its index) becomes float32 entries equal to the bf16 values,
    exactly; its tokenizer files are pinned with the import, survive gc, and come back on export,
    also for a later commit whose parent chain reaches the import."""
    from shardstore.ops.assets import assets_pin, commit_assets
    from shardstore.ops.gc import gc

    model = tiny_llama(tmp_path / "f32", tied=False, seed=2)
    src = tmp_path / "src"
    model.to(torch.bfloat16).save_pretrained(src, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").exists()
    files = {"tokenizer.json": b'{"fake": 1}', "tokenizer_config.json": b"{}", "chat_template.jinja": b"{{ x }}"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    files["generation_config.json"] = (src / "generation_config.json").read_bytes()  # save_pretrained's, kept too
    (src / "notes.txt").write_bytes(b"not an asset")
    cid = import_directory(store, str(src), dtype="float32")
    lc = ss.load_commit(store, cid)
    assert {e.dtype for e in lc.entries().values()} == {"float32"}
    assert commit_assets(store, cid) == files and store.pinned(assets_pin(cid))
    gc(store, grace_seconds=0, dry_run=False)
    child = ss.save(store, {n: torch.zeros(1) for n in ("w",)}, step=1, parent=cid, rng=False, ref=None)
    out = export_commit(store, child, str(tmp_path / "out-child"), weights_only=True)  # the child has no config
    assert set(files) <= set(out.files) and "notes.txt" not in out.files
    assert all((tmp_path / "out-child" / n).read_bytes() == d for n, d in files.items())
    export_commit(store, cid, str(tmp_path / "out"))
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    source = {k: v for f in sorted(src.glob("model-*.safetensors")) for k, v in load_file(str(f)).items()}
    assert set(back) == set(source) and all(torch.equal(back[k], source[k].float()) for k in source)
    (tmp_path / "f64").mkdir()
    save_file({"x": torch.zeros(2, dtype=torch.float64)}, str(tmp_path / "f64" / "model.safetensors"))
    (tmp_path / "f64" / "config.json").write_text("{}")
    with pytest.raises(ss.TensorMismatch, match="float64"):  # widening must be exact: float64 is refused
        import_directory(store, str(tmp_path / "f64"), dtype="float32")


@pytest.fixture
def copied_child(store, tmp_path) -> tuple[str, str, dict[str, torch.Tensor]]:
    """A commit trained from an import (whose tokenizer set the import pins), copied alone to
    another store: (that store's path, the commit, its weights). Its parent stays behind."""
    from safetensors.torch import load_file

    from shardstore.format.manifest import MAX_MANIFEST_BYTES, decode_config
    from shardstore_cli.shardstore_cli import main as shardstore_main

    tiny_llama(tmp_path / "hf", tied=True, seed=3, vocab_size=288)  # room for the embedded byte tokenizer
    (tmp_path / "hf" / "tokenizer.json").write_bytes(b'{"fake": 1}')
    imported = import_directory(store, str(tmp_path / "hf"), dtype="float32")
    config = decode_config(store.get(ss.load_commit(store, imported).commit.config, limit=MAX_MANIFEST_BYTES))
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    child = ss.save(store, weights, step=1, parent=imported, config=config, ref="main", rng=False)
    assert "tokenizer.json" in export_commit(store, child, str(tmp_path / "here")).files  # the parent's set
    dst = str(tmp_path / "dst")
    assert shardstore_main(["copy", store.url, dst, "main", "--ref", "main"]) == 0
    assert not ss.open_store(dst).has(imported)  # the parent is a pointer, not part of the closure (SPEC.md §19.1)
    return dst, child, weights


def test_a_copied_commit_without_its_history_exports(copied_child, tmp_path):
    """Issue 30, defect 6: looking for the asset set ends at the absent parent instead of failing."""
    from safetensors.torch import load_file

    from shardstore_cli.shardstore_cli import main as shardstore_main

    dst, _, weights = copied_child
    out = tmp_path / "out"
    assert shardstore_main(["export", dst, "main", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no set reachable
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(weights) and all(torch.equal(back[k], weights[k]) for k in weights)


def test_a_copied_commit_without_its_history_seeds_a_job(copied_child, tmp_path):
    """Issue 30, defect 6: `shardtrain prepare --seed-commit` walks the same chain, and ends there too."""
    from shardstore_cli.shardtrain_cli import main as shardtrain_main

    dst, child, _ = copied_child
    job = tmp_path / "job"
    assert shardtrain_main(["prepare", "--out", str(job), "--seed-store", dst, "--seed-commit", child, "--quiet"]) == 0
    assert json.loads((job / "job.json").read_text())["seed"]["commit"] == child


def test_a_failed_overwrite_leaves_no_mixed_export(store, trained, tmp_path):
    # An export over an earlier one (overwrite=True) that fails part way must not leave a
    # directory that looks complete: the new model.safetensors beside the old config.json and
    # optimizer files would load as a model that never existed.
    from conftest import train_steps

    from shardstore.store import object_key

    model, opt = trained
    out = tmp_path / "out"
    ss.save(store, model, opt, step=3, config={"hidden": 8})
    export_commit(store, "main", str(out), with_optimizer=True)
    train_steps(model, opt, 2, seed=7)
    cid = ss.save(store, model, opt, step=5, config={"hidden": 16})
    lc = ss.load_commit(store, cid)
    lost = lc.entries()["mid.weight"].optim.exp_avg
    os.unlink(os.path.join(store.url, object_key(lost)))
    with pytest.raises(ss.ShardstoreError, match=lost):
        export_commit(store, cid, str(out), with_optimizer=True, overwrite=True)
    left = set(os.listdir(out))
    assert "config.json" not in left and "optimizer.json" not in left, left
    assert not {n for n in left if n.startswith("optimizer.")}, left  # the old moments are not the new model's


def test_export_refuses_a_tensor_named_like_the_safetensors_header_before_writing(store, tmp_path):
    # "__metadata__" is a valid tensor name (SPEC.md §6) but safetensors' header key: the file
    # was written whole, then its read-back failed with a JSON error naming a temporary file.
    ss.save(store, {"__metadata__": torch.ones(3), "w": torch.zeros(2)}, step=0, config={"a": 1}, rng=False)
    out = tmp_path / "out"
    with pytest.raises(StateMismatch, match="'__metadata__'.*reserves the key"):
        export_commit(store, "main", str(out))
    assert not out.exists() or os.listdir(out) == []


def test_import_refuses_a_header_naming_a_tensor_twice(store, tmp_path):
    # safetensors keeps the last of two header entries of one name without a word: this file's
    # bytes are float32 [1.0, 2.0] under the first entry, and were imported as int32.
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    entry = '"a":{{"dtype":"{}","shape":[2],"data_offsets":[0,8]}}'
    header = ("{" + entry.format("F32") + "," + entry.format("I32") + "}").encode()
    header += b" " * (-len(header) % 8)
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.0, 2.0))
    with pytest.raises(ManifestError, match="holds 'a' more than once"):
        import_directory(store, str(src))
    assert store.refs() == {} and list(store.objects()) == []


def test_config_json_is_written_last(store, trained, tmp_path, monkeypatch):
    # config.json makes a directory loadable: an export that fails writing any other file (a full
    # disk at optimizer.json, simulated here) must not leave it beside an incomplete set.
    import shardstore.ops.interchange as interchange

    model, opt = trained
    ss.save(store, model, opt, step=3, config={"hidden": 8})
    written = []
    real = interchange._write_file

    def write_file(path, raw):
        if os.path.basename(path) == "optimizer.json":
            raise StorageError(f"writing {path}: No space left on device")
        real(path, raw)
        written.append(os.path.basename(path))

    monkeypatch.setattr(interchange, "_write_file", write_file)
    with pytest.raises(StorageError, match="No space left"):
        export_commit(store, "main", str(tmp_path / "out"), with_optimizer=True)
    assert "config.json" not in os.listdir(tmp_path / "out"), written


def test_import_refuses_a_tensor_no_manifest_can_hold_before_writing(store, tmp_path):
    # 17 dims (the format holds 16): the tensors were stored, then a shard manifest no reader
    # decodes was written, and the import failed reading it back, naming neither tensor nor file.
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"a": torch.zeros([1] * 17), "b": torch.ones(3)}, str(src / "model.safetensors"))
    with pytest.raises(TensorMismatch, match="tensor 'a' in model.safetensors: shape"):
        import_directory(store, str(src))
    assert store.refs() == {} and list(store.objects()) == []


def test_a_second_tokenizer_set_for_the_same_commit_is_refused_not_mixed(store, tmp_path):
    # The same weights and config imported under another ref (no parent either time) is the same
    # commit id, and the asset pin took the union of both sets: export then gave the files of
    # whichever asset index sorted first, here the first import's template for the second ref.
    from shardstore.ops.assets import assets_pin, commit_assets

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(src / "model.safetensors"))
    (src / "chat_template.jinja").write_text("template 0")
    cid = import_directory(store, str(src), ref="r0")
    assert import_directory(store, str(src), ref="again") == cid  # the same set again: fine
    (src / "chat_template.jinja").write_text("template 1")
    with pytest.raises(StateMismatch, match="chat_template.jinja"):
        import_directory(store, str(src), ref="r1")
    assert store.ref("r1") is None and commit_assets(store, cid) == {"chat_template.jinja": b"template 0"}
    assert len(store.pinned(assets_pin(cid))) == 2  # the index and the one file: nothing added
    other = import_directory(store, str(src), ref="r1", step=1)  # the remedy: a commit of its own
    assert commit_assets(store, other) == {"chat_template.jinja": b"template 1"}
    store.add_to_pin(assets_pin(cid), store.pinned(assets_pin(other)))  # two sets, as a union of pins leaves
    with pytest.raises(ManifestError, match="2 asset indexes"):
        commit_assets(store, cid)
