"""The paired bootstrap of evaluation reports (shardtrain.run.evaluate). The evaluation ring's KV cache,
generation and losses: tests/shardtrain/engine/test_ring.py."""

from __future__ import annotations

import pytest
import torch

from shardtrain.run.evaluate import SetLoss, paired_bootstrap


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
