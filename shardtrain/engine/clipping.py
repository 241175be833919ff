"""Global gradient clipping whose norm does not depend on how the model is partitioned.

Each slot computes the squared L2 norm of each of its parameters' gradients in float64.
All slots exchange these values as one fixed-size float64 vector indexed by canonical
parameter order (`canonical_parameter_names`), each slot filling only the entries it
owns. Every worker then adds the entries one by one in canonical order, taking each from
its owner's row, so every worker and every partition of the model performs the same
float64 additions in the same order: the total norm is bitwise identical everywhere.

Clipping then follows `torch.nn.utils.clip_grad_norm_`: gradients are scaled by
`max_norm / (norm + 1e-6)` when that factor is below 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from shardtrain.errors import PeerFailureError

__all__ = ["squared_grad_norms", "global_grad_norm", "clip_coefficient", "scale_grads_"]


def squared_grad_norms(named_params: Mapping[str, torch.nn.Parameter]) -> dict[str, float]:
    """Squared L2 norm of each parameter's gradient, in float64 (0 for a missing gradient)."""
    return {
        name: (0.0 if p.grad is None else float(p.grad.detach().double().square().sum()))
        for name, p in named_params.items()
    }


def global_grad_norm(
    local: Mapping[str, float], canonical_names: Sequence[str], owners: Sequence[int], *, rank: int, world_size: int
) -> float:
    """The global gradient norm from each slot's `local` squared norms (collective).

    `owners[i]` is the slot owning `canonical_names[i]`; `local` must hold exactly the
    names this rank owns. With one worker no message is exchanged.
    """
    index = {name: i for i, name in enumerate(canonical_names)}
    vec = torch.zeros(len(canonical_names), dtype=torch.float64)  # (P,)
    for name, value in local.items():
        i = index[name]
        assert owners[i] == rank, (name, owners[i], rank)
        vec[i] = value
    if world_size > 1:
        rows = [torch.empty_like(vec) for _ in range(world_size)]  # world_size x (P,)
        try:
            dist.all_gather(rows, vec)
        except RuntimeError as exc:
            raise PeerFailureError(
                f"slot {rank}: gathering gradient norms failed; a peer died, hung or "
                f"disconnected: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
            ) from exc
    else:
        rows = [vec]
    lists = [r.tolist() for r in rows]
    values = [lists[owners[i] if world_size > 1 else 0][i] for i in range(len(canonical_names))]
    total = 0.0
    for v in values:  # canonical order, plain float64 additions
        total += v
    return math.sqrt(total)


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """The factor clipping applies to every gradient (1.0 when no clipping is needed)."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


@torch.no_grad()
def scale_grads_(params: Sequence[torch.nn.Parameter], coef: float) -> None:
    """Multiply every gradient by `coef` in place (skipped when `coef` is 1)."""
    if coef == 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
