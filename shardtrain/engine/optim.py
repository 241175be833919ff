"""AdamW over one slot's parameters, with a per-parameter Adam age.

Design. The optimizer is shard-local: each worker builds one over the parameters its slot
owns and nothing else; no optimizer state ever crosses workers. Everything global about an
update (the clipping norm, the step index that drives the learning-rate schedule) is
computed outside and passed in, so the update of a parameter depends only on its own
gradient, its own state and the global step, whichever worker holds it.

Each parameter carries its own *age*, the number of updates it has received, and its bias
correction uses that age rather than a global step count: a parameter added later (a new
block) starts its own clock at 0 while the rest of the model keeps theirs. Moments are
created (as zeros) on a parameter's first update, so a parameter of age 0 has none.

Parameters belong to named groups ("decay" for matrices and "no_decay" for norms and
other 1-D tensors by default) with their own hyperparameters. The learning rate of a
group at global step s is `group.lr * lr_multiplier(s, schedule)`: linear warm-up, then
cosine decay, a pure function of s.

The update math (decoupled weight decay, as in Loshchilov & Hutter and torch.optim.AdamW)
is written out here, in a fixed elementwise order, for each parameter with a gradient:

    age += 1
    p  *= 1 - lr * weight_decay
    m   = beta1 * m + (1 - beta1) * g
    v   = beta2 * v + (1 - beta2) * g * g
    p  -= lr / (1 - beta1**age) * m / (sqrt(v) / sqrt(1 - beta2**age) + eps)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from shardtrain.errors import ConfigError, OptimizerStateError

__all__ = ["GroupConfig", "Schedule", "lr_multiplier", "default_group", "AdamW"]


@dataclasses.dataclass(frozen=True)
class GroupConfig:
    """Hyperparameters of one optimizer group; `lr` is the peak (scheduled) learning rate."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr >= 0,
            "beta1": 0 <= self.beta1 < 1,
            "beta2": 0 <= self.beta2 < 1,
            "eps": self.eps > 0,
            "weight_decay": self.weight_decay >= 0,
        }
        for field, ok in checks.items():
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok:
                raise ConfigError(f"optimizer group {field} out of range: {value!r}")

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_ratio` at `total_steps`."""

    warmup_steps: int = 0
    total_steps: int = 1
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not (0 <= self.warmup_steps <= self.total_steps and self.total_steps >= 1 and 0 <= self.min_ratio <= 1):
            raise ConfigError(f"invalid schedule {self}")


def lr_multiplier(step: int, schedule: Schedule) -> float:
    """Learning-rate factor for the update at global step `step` (0-based), a pure function."""
    if step < 0:
        raise ConfigError(f"global step must be >= 0, got {step}")
    if step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    progress = min(1.0, (step - schedule.warmup_steps) / max(1, schedule.total_steps - schedule.warmup_steps))
    return schedule.min_ratio + (1.0 - schedule.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def default_group(name: str, param: torch.Tensor) -> str:
    """Matrices decay; norms and other 1-D tensors do not."""
    return "decay" if param.ndim >= 2 else "no_decay"


@dataclasses.dataclass
class _State:
    param: torch.nn.Parameter
    group: str
    age: int = 0
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None


class AdamW:
    """Shard-local AdamW with decoupled weight decay and per-parameter Adam age."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        groups: Mapping[str, GroupConfig],
        *,
        schedule: Schedule | None = None,
        group_of: Callable[[str, torch.Tensor], str] = default_group,
    ) -> None:
        self.groups: dict[str, GroupConfig] = dict(groups)
        self.schedule = schedule or Schedule()
        self._group_of = group_of
        self._state: dict[str, _State] = {}
        for name, param in named_params:
            self.add_parameter(name, param)

    def add_parameter(self, name: str, param: torch.nn.Parameter, group: str | None = None) -> None:
        """Start optimizing `param` with age 0 (its own Adam clock) in `group`."""
        if name in self._state:
            raise OptimizerStateError(f"parameter {name!r} is already in the optimizer")
        group = self._group_of(name, param) if group is None else group
        if group not in self.groups:
            raise OptimizerStateError(
                f"parameter {name!r}: unknown optimizer group {group!r} (groups: {sorted(self.groups)})"
            )
        self._state[name] = _State(param, group)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._state)

    def zero_grad(self) -> None:
        for s in self._state.values():
            s.param.grad = None

    @torch.no_grad()
    def step(self, global_step: int) -> float:
        """Update every parameter that has a gradient; return the learning-rate multiplier."""
        mult = lr_multiplier(global_step, self.schedule)
        for name, s in self._state.items():
            g = s.param.grad
            if g is None:
                continue  # no gradient, no update: the parameter's age does not advance
            h = self.groups[s.group]
            if s.exp_avg is None or s.exp_avg_sq is None:
                s.exp_avg = torch.zeros_like(s.param, memory_format=torch.preserve_format)
                s.exp_avg_sq = torch.zeros_like(s.param, memory_format=torch.preserve_format)
            s.age += 1
            lr = h.lr * mult
            p, m, v = s.param, s.exp_avg, s.exp_avg_sq
            p.mul_(1.0 - lr * h.weight_decay)
            m.mul_(h.beta1).add_(g, alpha=1.0 - h.beta1)
            v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
            bias1 = 1.0 - h.beta1**s.age
            bias2 = 1.0 - h.beta2**s.age
            denom = (v.sqrt() / math.sqrt(bias2)).add_(h.eps)
            p.addcdiv_(m, denom, value=-lr / bias1)
        return mult

    def state_export(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
        """(groups, params): group hyperparameters by group name, and per parameter its
        moments (None before its first update), age and group.

        The moment tensors are the live state, not copies: write or hash them, do not
        modify them.
        """
        groups = {name: g.as_dict() for name, g in self.groups.items()}
        params = {
            name: {"exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq, "age": s.age, "group": s.group}
            for name, s in self._state.items()
        }
        return groups, params

    def state_import(self, groups: Mapping[str, Mapping[str, float]], params: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace groups and per-parameter state with an export, exactly (copies are taken).

        The imported parameter set must be exactly this optimizer's; every check runs
        before anything is changed, so a rejected import leaves the optimizer as it was.
        """
        try:
            new_groups = {
                name: GroupConfig(**{k: g[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay")})
                for name, g in groups.items()
            }
        except (KeyError, TypeError, ConfigError) as exc:
            raise OptimizerStateError(f"invalid optimizer group in import: {exc}") from exc
        missing = sorted(set(self._state) - set(params))
        unexpected = sorted(set(params) - set(self._state))
        if missing or unexpected:
            raise OptimizerStateError(
                f"imported optimizer state does not match the parameters: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        staged: dict[str, _State] = {}
        for name, entry in params.items():
            param = self._state[name].param
            group, age = entry.get("group"), entry.get("age")
            if group not in new_groups:
                raise OptimizerStateError(f"parameter {name!r}: group {group!r} is not among the imported groups")
            if isinstance(age, bool) or not isinstance(age, int) or age < 0:
                raise OptimizerStateError(f"parameter {name!r}: Adam age must be an int >= 0, got {age!r}")
            moments = [entry.get("exp_avg"), entry.get("exp_avg_sq")]
            if age == 0 and any(t is not None for t in moments):
                raise OptimizerStateError(f"parameter {name!r}: age 0 but moments are present")
            if age > 0:
                for which, t in zip(("exp_avg", "exp_avg_sq"), moments):
                    if not isinstance(t, torch.Tensor) or t.shape != param.shape or t.dtype != param.dtype:
                        got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
                        raise OptimizerStateError(
                            f"parameter {name!r}: {which} must be a {param.dtype} tensor of "
                            f"shape {tuple(param.shape)}, got {got!r}"
                        )
                moments = [t.detach().to(device=param.device, copy=True) for t in moments]
            staged[name] = _State(param, group, age, *moments)
        self.groups = new_groups
        self._state = {name: staged[name] for name in self._state}
