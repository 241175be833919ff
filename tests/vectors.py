"""The fixed state behind the test vectors in SPEC.md §Test vectors (no RNG, no floats from a generator)."""
from __future__ import annotations

import torch

import shardstore as ss
from shardstore.optim import Hyper, OptimState, ParamOpt


def vector_state() -> tuple[list[ss.SlotState], ss.CommitInfo]:
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4  # exact binary fractions
    b = torch.tensor([0.5, -1.0], dtype=torch.float32)
    e = torch.arange(4, dtype=torch.int64)
    hyper = {"decay": Hyper(0.001, 0.9, 0.999, 1e-08, 0.1), "no_decay": Hyper(0.001, 0.9, 0.999, 1e-08, 0.0)}
    m1w, m2w = w / 8, w * w / 64
    m1b, m2b = b / 8, b * b / 64
    slot0 = ss.SlotState(
        {"layer.weight": w},
        OptimState("adamw", {"decay": hyper["decay"]}, {"layer.weight": ParamOpt("decay", 2, m1w, m2w)}),
        {"torch": bytes(range(16))},
    )
    slot1 = ss.SlotState(
        {"layer.bias": b, "positions": e},
        OptimState("adamw", {"no_decay": hyper["no_decay"]}, {"layer.bias": ParamOpt("no_decay", 1, m1b, m2b)}),
        {"torch": bytes(range(16, 32))},
    )
    info = ss.CommitInfo(step=2, job="vector-job", schedule="sched-1", config={"hidden_size": 3, "rms_norm_eps": 1e-06}, data_cursor=8)
    return [slot0, slot1], info
