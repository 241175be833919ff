"""The fixed state behind the test vectors in SPEC.md §Test vectors (no RNG, no floats from a generator)."""

from __future__ import annotations

import torch

import shardstore as ss
from shardstore.state.optim import Hyper, OptimState, ParamOpt


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
    info = ss.CommitInfo(
        step=2, job="vector-job", schedule="sched-1", config={"hidden_size": 3, "rms_norm_eps": 1e-06}, data_cursor=8
    )
    return [slot0, slot1], info


def sgd_vector_state() -> tuple[list[ss.SlotState], ss.CommitInfo]:
    """SGD(lr=0.1, momentum=0.9, nesterov=True) state in the torch form, plus a persistent buffer."""
    from shardstore.format.manifest import HyperGroup
    from shardstore.state.optim import TorchParam

    w = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4
    mean = torch.tensor([0.5, 1.0], dtype=torch.float32)
    hyper = {
        "dampening": 0,
        "foreach": None,
        "lr": "f64:3fb999999999999a",
        "maximize": False,
        "momentum": "f64:3feccccccccccccd",
        "nesterov": True,
        "weight_decay": 0,
    }
    optim = OptimState(
        "torch",
        {},
        {"layer.weight": ParamOpt("g0", 0, None, None, TorchParam("g0", {"momentum_buffer": w / 8}, {}))},
        "torch.optim.sgd.SGD",
        {"g0": HyperGroup(name="g0", hyper=hyper)},
    )
    slot = ss.SlotState({"layer.weight": w, "norm.running_mean": mean}, optim, {}, buffers={"norm.running_mean"})
    return [slot], ss.CommitInfo(step=2, job="vector-job")


class FixedScheduler:
    """A stateful object with a fixed state: an integer, a real in a list, and a tensor."""

    def state_dict(self) -> dict:
        return {"base_lrs": [0.001], "best": torch.tensor([1.5, -2.0], dtype=torch.float32), "last_epoch": 2}

    def load_state_dict(self, sd: dict) -> None:  # pragma: no cover - never restored in the vectors
        pass
