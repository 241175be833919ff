"""Loss: the weighted objective of one microbatch, computed on slot 0 from its logits.

Without distillation a token's term is ``weight * cross_entropy``. With distillation
(`DistillTargets`, made by `shardtrain.run.distill` before the student's pass) the rows of
the batch split in two:

- **new records** keep ``weight * cross_entropy(student, target)``;
- **declared replay records** get only ``coef * T**2 * weight * KL(p_ref || p_student)``,
  the forward KL from the frozen reference's next-token distribution to the student's,
  both taken at temperature T: ``p = softmax(logits / T)``, so
  ``KL = sum_v p_ref(v) * (log p_ref(v) - log p_student(v))`` per position. The T**2
  factor (Hinton et al.) keeps the gradient's scale independent of T.

Both terms of every microbatch are divided by the whole batch's target weight
(`Batch.total_weight`, replay rows included), so the step loss is a sum over
microbatches and neither microbatching nor the number of workers changes the update.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

__all__ = ["DistillTargets", "microbatch_loss"]


@dataclasses.dataclass(frozen=True)
class DistillTargets:
    """What slot 0 needs to distil one batch: which rows are replay and the reference's log-probs."""

    replay: torch.Tensor  # (B,) bool: the batch's declared replay rows
    ref_logprobs: torch.Tensor  # (R, T, V) log softmax(reference logits / T) of the replay rows, batch order
    coef: float  # KL coefficient (recipe)
    temperature: float  # T (recipe)

    def __post_init__(self) -> None:
        r = int(self.replay.sum())
        if self.ref_logprobs.ndim != 3 or self.ref_logprobs.shape[0] != r:
            raise ValueError(
                f"reference log-probs of shape {tuple(self.ref_logprobs.shape)} do not cover the {r} replay rows"
            )


def microbatch_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor,
    total_weight: torch.Tensor,
    *,
    rows: tuple[int, int] = (0, 0),
    distill: DistillTargets | None = None,
) -> torch.Tensor:
    """The microbatch's share of the step loss (a scalar with a graph to `logits`).

    `logits` (b, t, V), `targets` and `weights` (b, t) are rows ``rows = (start, stop)``
    of the batch, trimmed to t positions; `total_weight` is the whole batch's weight.
    """
    b, t, v = logits.shape
    ce = F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1), reduction="none")  # (b*t,)
    if distill is None:
        return (ce * weights.reshape(-1)).sum() / total_weight
    start, stop = rows
    replay = distill.replay[start:stop].to(logits.device)  # (b,)
    if replay.shape[0] != b:
        raise ValueError(f"rows {rows} do not match a microbatch of {b} rows")
    new_w = weights * (~replay).to(weights.dtype)[:, None]  # (b, t): CE only on new records
    loss = (ce * new_w.reshape(-1)).sum()
    if bool(replay.any()):
        first = int(distill.replay[:start].sum())  # replay rows before this microbatch
        ref = distill.ref_logprobs[first : first + int(replay.sum()), :t].to(logits.device)  # (r, t, V)
        temp = distill.temperature
        student = F.log_softmax(logits[replay] / temp, dim=-1)  # (r, t, V)
        kl = (ref.exp() * (ref - student)).sum(dim=-1)  # (r, t): KL(p_ref || p_student) per position
        loss = loss + distill.coef * temp * temp * (kl * weights[replay]).sum()
    return loss / total_weight
