"""Admission: a worker given less memory than its estimate refuses before allocating; nothing is committed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardstore import open_store
from shardtrain.engine.model import LlamaConfig
from shardtrain.errors import AdmissionError
from shardtrain.job.default_job import prepare_default
from shardtrain.reshape.admission import FREE_MEMORY_ENV, admit, free_memory
from shardtrain.reshape.planner import MemoryModel
from shardtrain.run.lifecycle import RunSpec, train


def test_a_short_worker_refuses_before_anything_is_committed(tmp_path: Path) -> None:
    job = prepare_default(tmp_path / "job", steps_a=2, steps_b=1, batch_size=4, microbatch_size=2, eval_per_set=2)
    url = str(tmp_path / "store")
    with pytest.raises(AdmissionError) as refused:
        train(RunSpec(job=job, store=url, until=2), 2, timeout=60, env={FREE_MEMORY_ENV: "1=1000000"})
    msg = str(refused.value)
    assert "slot 1: estimated peak" in msg and "exceeds the 1,000,000 bytes free on cpu" in msg
    assert "refused before allocating" in msg
    store = open_store(url)
    assert store.refs() == {}
    pinned = {oid for ids in store.pins().values() for oid in ids}
    assert pinned and set(store.objects()) == pinned  # the job's files, kept before launch; no commit, no tensor


def test_admit_compares_the_estimate_with_what_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    est = MemoryModel(config, seq_len=8, microbatch_size=2).estimate(0, range(2))
    assert free_memory(torch.device("cpu")) > 0  # the host's real available memory
    monkeypatch.setenv(FREE_MEMORY_ENV, str(est.total))
    free, baseline = admit(0, est, torch.device("cpu"))
    assert free == est.total and baseline > 0
    monkeypatch.setenv(FREE_MEMORY_ENV, str(est.total - 1))
    with pytest.raises(AdmissionError, match=f"slot 0: estimated peak {est.total:,} bytes"):
        admit(0, est, torch.device("cpu"))
