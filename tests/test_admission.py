"""Admission: a worker given less memory than its estimate refuses before allocating; nothing is committed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardstore import open_store
from shardtrain.engine.model import LlamaConfig
from shardtrain.engine.partition import Partition
from shardtrain.errors import AdmissionError, ConfigError
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


def _tiny_model(**options: int) -> MemoryModel:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return MemoryModel(config, seq_len=8, microbatch_size=2, **options)


def test_the_estimate_counts_the_memory_tier_and_the_replicas_a_host_keeps() -> None:
    """Issue 32: a slot's host keeps (K + 1) commits of its own stored state (weights and both Adam
    moments, float32) and, with peer replicas, as much of each slot it is buddy of (s-1, ..., s-N)."""
    partition = Partition(3, (range(0, 1), range(1, 2), range(2, 3)))
    plain = _tiny_model().estimates(partition)
    assert all(e.tier == 0 for e in plain)  # no memory tier: nothing held
    stored = [4 * e.parameters * 3 for e in plain]
    one = _tiny_model(tier_commits=1, replicas=1).estimates(partition)
    assert [e.tier for e in one] == [2 * (stored[s] + stored[(s - 1) % 3]) for s in range(3)]
    two = _tiny_model(tier_commits=2, replicas=2).estimates(partition)
    assert [e.tier for e in two] == [3 * sum(stored) for _ in range(3)]
    # more buddies than other slots: each host keeps every other slot once
    assert _tiny_model(tier_commits=1, replicas=5).estimates(partition) == _tiny_model(
        tier_commits=1, replicas=2
    ).estimates(partition)
    assert [e.total for e in one] == [e.total for e in plain]  # the device's peak is unchanged
    with pytest.raises(ConfigError, match="tier_commits must be an int >= 0"):
        _tiny_model(tier_commits=-1)


def test_admission_counts_what_the_tiers_will_add(monkeypatch: pytest.MonkeyPatch) -> None:
    partition = Partition(3, (range(0, 1), range(1, 2), range(2, 3)))
    est = _tiny_model(tier_commits=1, replicas=1).estimates(partition)[1]
    cpu = torch.device("cpu")
    # On the CPU the tiers share the device's memory: the estimate plus the tiers must fit.
    monkeypatch.setenv(FREE_MEMORY_ENV, str(est.total + est.tier - 1))
    with pytest.raises(AdmissionError, match=f"estimated peak {est.total + est.tier:,} bytes .*memory tiers"):
        admit(1, est, cpu)
    # A restarted worker's tier already holds (part of) it: only what is not held counts.
    assert admit(1, est, cpu, held=1)[0] == est.total + est.tier - 1
    monkeypatch.setenv(FREE_MEMORY_ENV, str(est.total))
    assert admit(1, est, cpu, held=est.tier)[0] == est.total
    # On an accelerator the device's peak and the host's tiers are checked apart (the override
    # stands for both here: with more commits kept the tiers outgrow the device's peak, so one
    # figure can fit the device and not the host).
    meta = torch.device("meta")
    est = _tiny_model(tier_commits=4, replicas=1, reserve=0).estimates(partition)[1]
    assert est.tier > est.total
    monkeypatch.setenv(FREE_MEMORY_ENV, str(max(est.total, est.tier - 1)))
    with pytest.raises(AdmissionError, match=f"memory tiers on its host would hold {est.tier:,} more bytes"):
        admit(1, est, meta)
    monkeypatch.setenv(FREE_MEMORY_ENV, str(max(est.total, est.tier)))
    admit(1, est, meta)
