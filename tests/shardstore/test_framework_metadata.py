"""Metadata as frameworks produce it (issue 34, item 4): a Hugging Face ``config.to_dict()`` as
``config=``, the step ≥ Adam age rule saying what to pass, ``export`` refusing a commit it
cannot make a whole directory of. ``shardtrain prepare --model`` without ``--seed-store``
(same issue) is tested with the model it needs, in tests/shardtrain/job/test_own_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardstore
from shardstore.errors import CursorError, ManifestError, StateMismatch
from shardstore.ops.interchange import export_commit
from shardstore_cli.shardstore_cli import main as shardstore_main

transformers = pytest.importorskip("transformers", reason="Hugging Face configs under test")


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_a_hugging_face_config_to_dict_is_taken_as_config_json_holds_it(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, id2label={0: "neg", 1: "pos"}
    )
    raw = cfg.to_dict()
    assert 0 in raw["id2label"]  # integer keys, as transformers hands them over
    store = shardstore.open_store(tmp_path / "s")
    model = torch.nn.Linear(2, 2)
    cid = shardstore.save(store, model, step=0, config=raw)
    # the same object as the config.json transformers itself writes (integer keys as their decimal text)
    from_json = shardstore.save(store, model, step=0, config=json.loads(cfg.to_json_string(use_diff=False)), ref=None)
    assert store.commit(from_json).config == store.commit(cid).config
    got = shardstore.restore(store, cid, torch.nn.Linear(2, 2)).config
    assert got["id2label"] == {"0": "neg", "1": "pos"}
    assert transformers.LlamaConfig.from_dict(got).id2label == {0: "neg", 1: "pos"}
    with pytest.raises(ManifestError, match=r"keys 0 and '0' at \$\.id2label are both written '0'"):
        shardstore.save(store, model, step=0, config={"id2label": {0: "a", "0": "b"}})
    with pytest.raises(ManifestError, match="neither a string nor an integer"):
        shardstore.save(store, model, step=0, config={"flags": {True: 1}})


def test_a_step_below_the_adam_age_is_refused_before_writing_and_says_what_to_pass(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    store = shardstore.open_store(tmp_path / "s")
    before = _files(tmp_path / "s")
    with pytest.raises(CursorError, match=r"pass the number of optimizer steps taken, here at least 3 \(SPEC\.md §9\)"):
        shardstore.save(store, model, opt, step=0)
    assert _files(tmp_path / "s") == before  # refused before the first object
    assert shardstore.load_commit(store, shardstore.save(store, model, opt, step=3)).commit.step == 3


def test_export_of_a_commit_without_a_model_config_is_refused_before_writing(tmp_path, capsys):
    store = shardstore.open_store(tmp_path / "s")
    cid = shardstore.save(store, torch.nn.Linear(2, 2), step=0)
    out = tmp_path / "out"
    with pytest.raises(StateMismatch, match=r"holds no model config.*weights_only=True \(--weights-only\)"):
        export_commit(store, cid, str(out))
    assert not out.exists()
    assert (
        shardstore_main(["export", str(tmp_path / "s"), cid, str(out)]) == 5
    )  # refused (StateMismatch: the one exit-code table)
    assert "holds no model config" in capsys.readouterr().err and not out.exists()
    assert shardstore_main(["export", str(tmp_path / "s"), cid, str(out), "--weights-only"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
