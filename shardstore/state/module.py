"""What of a module a commit holds: its parameters and its persistent buffers (SPEC.md §Buffers).

``model.state_dict()`` is the reference for "the module's state": parameters, plus the
buffers registered as persistent (running statistics such as BatchNorm's ``running_mean``,
``running_var`` and ``num_batches_tracked``). Non-persistent buffers are not in it and are
not saved. Anything else a ``state_dict()`` holds (an ``_extra_state`` from
``get_extra_state``, an entry a hook adds) is refused with ``UnsupportedState`` naming it,
never skipped: a checkpoint that silently drops part of a model is the failure this module
exists to prevent. A second name for the same tensor (a tied weight) is saved once, under
the name ``named_parameters`` / ``named_buffers`` gives it. Tensors on the ``meta`` device
are not owned by this process and are skipped, parameters and buffers alike. A compiled
module's names are taken without ``torch.compile``'s ``_orig_mod`` segment (``restore_match``),
so a compiled and a plain model hold the same names. A module inside a data-parallel
wrapper (``DistributedDataParallel``, ``DataParallel``: what accelerate's ``prepare`` and
Lightning hand a multi-process run) is saved and restored as the module it wraps
(``unwrap_module``, as accelerate's ``unwrap_model`` does), so its names carry no ``module.``
prefix and a wrapped and a plain model hold one commit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..errors import StateMismatch, UnsupportedState
from ..format.names import check_tensor_name
from ..format.tensors import check_shape
from .restore_match import canonical_name

__all__ = ["unwrap_module", "named_state", "check_held", "tensor_profile"]

#: Short names of floating dtypes in a profile label (``fp32`` is what shardtrain's profile is called).
_PROFILE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


#: Wrappers that hold exactly one module (``.module``) and no state of their own: torch's data-parallel
#: containers. ``torch.compile``'s wrapper is not among them: its names are handled by ``canonical_name``.
_PARALLEL_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def unwrap_module(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> torch.nn.Module | Mapping[str, torch.Tensor]:
    """The module a data-parallel wrapper holds (through any number of them), else ``model`` itself."""
    while isinstance(model, _PARALLEL_WRAPPERS):
        model = model.module
    return model


def named_state(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(name → tensor of every owned parameter and persistent buffer, the names that are buffers).

    A mapping is taken as given: every tensor in it is a parameter entry. A data-parallel
    wrapper is taken as the module it wraps (``unwrap_module``).
    """
    model = unwrap_module(model)
    if not isinstance(model, torch.nn.Module):
        return {check_tensor_name(n): _shaped(n, t) for n, t in model.items() if t.device.type != "meta"}, set()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    known = {id(t) for t in (*params.values(), *buffers.values())}
    out: dict[str, torch.Tensor] = {}
    kinds: set[str] = set()
    for name, t in params.items():
        if t.device.type != "meta":
            out[check_tensor_name(canonical_name(name))] = _shaped(name, t)
    if len(out) != sum(
        t.device.type != "meta" for t in params.values()
    ):  # two names, one without _orig_mod: never merge them
        raise StateMismatch(
            "the model holds two parameters whose names differ only by '_orig_mod' segments (SPEC.md §16.1)"
        )
    for name, value in model.state_dict(keep_vars=True).items():
        if name in params:
            continue
        if name in buffers and isinstance(value, torch.Tensor) and value is buffers[name]:
            if value.device.type != "meta":
                out[check_tensor_name(canonical_name(name))] = _shaped(name, value)
                kinds.add(canonical_name(name))
            continue
        if isinstance(value, torch.Tensor) and id(value) in known:
            continue  # another name of a tensor saved under its own name (tied weights)
        raise UnsupportedState(
            f"model state_dict entry {name!r} ({type(value).__name__}) is neither a parameter nor a persistent buffer; "
            "shardstore saves parameters and buffers only, and refuses rather than drop it (SPEC.md §Buffers)"
        )
    return out, kinds


def _shaped(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``, whose shape a manifest can hold (TensorMismatch naming it before anything is written)."""
    check_shape(t.shape, f"tensor {name!r}")
    return t


def check_held(optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    """A module's optimizer holding a non-meta parameter the module does not hold: that parameter and
    its state would be dropped, so it is refused (SPEC.md §Buffers). A name → tensor mapping is a
    slot's declared share (other slots' parameters are skipped by design) and is not checked."""
    held = {id(t) for t in tensors.values()}
    for i, g in enumerate(optimizer.param_groups):
        for j, p in enumerate(g["params"]):
            if id(p) not in held and p.device.type != "meta":
                raise StateMismatch(
                    f"optimizer param group {i}, parameter {j} ({list(p.shape)}) is not among the model's "
                    "parameters and buffers; its value and state would not be saved (name it in the model)"
                )


def tensor_profile(dtypes: Iterable[str]) -> str:
    """The numerical profile a commit holds when no trainer names one (SPEC.md §8.3): its tensors'
    floating dtypes, short names joined by ``+`` (``fp32``, ``bf16``, ``bf16+fp16``), ``none`` if none."""
    names = sorted({_PROFILE_NAMES[d] for d in dtypes if d in _PROFILE_NAMES})
    return "+".join(names) or "none"
