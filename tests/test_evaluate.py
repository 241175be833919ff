"""Evaluation pieces in one process: the KV cache, the ring's losses, the paired bootstrap."""

from __future__ import annotations

import pytest
import torch

from shardtrain import Partition, Pipeline, build_stage
from shardtrain.engine.model import KVCache
from shardtrain.engine.ring import Ring
from shardtrain.job.default_job import prepare_default
from shardtrain.job.job import load_job
from shardtrain.run.evaluate import SetLoss, paired_bootstrap


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_job(prepare_default(tmp_path_factory.mktemp("job"), steps_a=2, steps_b=1, batch_size=4, eval_per_set=4))


def test_kv_cache_matches_recomputing_the_prefix(job) -> None:  # type: ignore[no-untyped-def]
    config = job.config
    model = build_stage(config, Partition.even(config.num_hidden_layers, 1), 0, seed=5)
    tokens = torch.tensor([job.encoded(0)[0][:20]])  # (1, 20)
    full = model(tokens)  # (1, 20, V)
    ring = Ring(model, Partition.even(config.num_hidden_layers, 1), 0, timeout=5)
    caches: dict[int, KVCache] = {}
    pieces = [
        ring.forward(tokens[:, :12], caches),
        ring.forward(tokens[:, 12:13], caches),
        ring.forward(tokens[:, 13:20], caches),
    ]  # prefill, one token, then several at once
    assert next(iter(caches.values())).past == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_greedy_generation_with_cache_equals_without(job) -> None:  # type: ignore[no-untyped-def]
    config = job.config
    partition = Partition.even(config.num_hidden_layers, 1)
    model = build_stage(config, partition, 0, seed=5, init_std=0.2)  # large init: varied tokens
    ring = Ring(model, partition, 0, timeout=5)
    prompt = job.tokenizer.encode_prompt(job.records[0].as_dicts()[:1])
    cached = ring.generate(prompt, max_new_tokens=10, stop=set())
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert cached == seq[len(prompt) :] and len(set(cached)) > 1


def test_ring_losses_agree_with_the_training_loss(job) -> None:  # type: ignore[no-untyped-def]
    config = job.config
    partition = Partition.even(config.num_hidden_layers, 1)
    model = build_stage(config, partition, 0, seed=5)
    docs = list(job.job.schedule.steps[0].docs)
    dl, dw = Ring(model, partition, 0, timeout=5).losses(job, docs, batch_size=3)
    loss = Pipeline(model, partition, 0).forward_backward(job.batch(0), step=0, microbatch_size=4)
    assert sum(dl) / sum(dw) == pytest.approx(loss, rel=1e-6)
    assert dw == [float(sum(job.encoded(d)[1][1:])) for d in docs]


def test_paired_bootstrap() -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.rand(50, generator=g) * 10 + 1).double()
    base = (torch.rand(50, generator=g) * 3).double() * w
    a = SetLoss("s", 0.0, float(w.sum()), tuple(base.tolist()), tuple(w.tolist()))
    same = paired_bootstrap(a, a)
    assert same == (0.0, 0.0, 0.0)
    better = SetLoss("s", 0.0, float(w.sum()), tuple((base - 0.1 * w).tolist()), tuple(w.tolist()))
    diff, lo, hi = paired_bootstrap(a, better)
    assert diff == pytest.approx(-0.1) and lo <= diff <= hi and hi < 0
    noisy = SetLoss(
        "s", 0.0, float(w.sum()), tuple((base + torch.randn(50, generator=g).double() * w).tolist()), tuple(w.tolist())
    )
    diff, lo, hi = paired_bootstrap(a, noisy)
    assert lo < diff < hi and hi - lo > 0.1
    with pytest.raises(ValueError, match="same documents"):
        paired_bootstrap(a, SetLoss("s", 0.0, 1.0, (1.0,), (1.0,)))
