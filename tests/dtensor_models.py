"""The small model the DTensor tests shard (FSDP2, tensor parallelism, 2-D meshes) and its
training loop: one definition, so every test module splits the same tensors.

``fc1.weight`` is ``rows`` x ``wide`` float32 (by default 10 x 131072, 5 MiB: two column
tiles of 10 x 65536, SPEC.md §5.1), so every split the tests use cuts a block and the exchange
moves pieces.
"""

from __future__ import annotations

import torch

__all__ = ["WIDE", "Net", "adamw", "train", "fsdp"]

WIDE = 131072


class Net(torch.nn.Module):
    """``fc2(relu(fc1(x)))``, parameters drawn from seed 0; ``table``: a persistent buffer
    larger than one block (FSDP2 leaves it whole on every rank)."""

    def __init__(self, rows: int = 10, table: bool = False, wide: int = WIDE) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = torch.nn.Linear(wide, rows)
        self.fc2 = torch.nn.Linear(rows, 4)
        if table:
            self.register_buffer("table", torch.arange(10 * WIDE, dtype=torch.float32).reshape(10, WIDE))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int, batch: int = 4) -> None:
    """``steps`` updates on batches drawn from ``seed`` (the same on every rank: data
    parallelism then averages equal gradients)."""
    g = torch.Generator().manual_seed(seed)
    wide = model.fc1.in_features
    for _ in range(steps):
        x = torch.randn(batch, wide, generator=g)
        y = torch.randint(0, 4, (batch,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def fsdp(mesh, model: torch.nn.Module | None = None) -> torch.nn.Module:
    """``model`` (a fresh ``Net``) with ``fc1`` and the whole model ``fully_shard``-ed over ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    m = Net() if model is None else model
    fully_shard(m.fc1, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m
