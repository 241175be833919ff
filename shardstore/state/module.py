"""What of a module a commit holds: its parameters and its persistent buffers (SPEC.md §Buffers).

``model.state_dict()`` is the reference for "the module's state": parameters, plus the
buffers registered as persistent (running statistics such as BatchNorm's ``running_mean``,
``running_var`` and ``num_batches_tracked``). Non-persistent buffers are not in it and are
not saved. Anything else a ``state_dict()`` holds (an ``_extra_state`` from
``get_extra_state``, an entry a hook adds) is refused with ``UnsupportedState`` naming it,
never skipped: a checkpoint that silently drops part of a model is the failure this module
exists to prevent. A second name for the same tensor (a tied weight) is saved once, under
the name ``named_parameters`` / ``named_buffers`` gives it. Tensors on the ``meta`` device
are not owned by this process and are skipped, parameters and buffers alike.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import StateMismatch, UnsupportedState
from ..format.names import check_tensor_name

__all__ = ["named_state", "check_held"]


def named_state(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(name → tensor of every owned parameter and persistent buffer, the names that are buffers).

    A mapping is taken as given: every tensor in it is a parameter entry.
    """
    if not isinstance(model, torch.nn.Module):
        return {check_tensor_name(n): t for n, t in model.items() if t.device.type != "meta"}, set()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    known = {id(t) for t in (*params.values(), *buffers.values())}
    out: dict[str, torch.Tensor] = {}
    kinds: set[str] = set()
    for name, t in params.items():
        if t.device.type != "meta":
            out[check_tensor_name(name)] = t
    for name, value in model.state_dict(keep_vars=True).items():
        if name in params:
            continue
        if name in buffers and isinstance(value, torch.Tensor) and value is buffers[name]:
            if value.device.type != "meta":
                out[check_tensor_name(name)] = value
                kinds.add(name)
            continue
        if isinstance(value, torch.Tensor) and id(value) in known:
            continue  # another name of a tensor saved under its own name (tied weights)
        raise UnsupportedState(
            f"model state_dict entry {name!r} ({type(value).__name__}) is neither a parameter nor a persistent buffer; "
            "shardstore saves parameters and buffers only, and refuses rather than drop it (SPEC.md §Buffers)"
        )
    return out, kinds


def check_held(optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor]) -> None:
    """A module's optimizer holding a non-meta parameter the module does not hold: that parameter and
    its state would be dropped, so it is refused (SPEC.md §Buffers). A name → tensor mapping is a
    slot's declared share (other slots' parameters are skipped by design) and is not checked."""
    held = {id(t) for t in tensors.values()}
    for i, g in enumerate(optimizer.param_groups):
        for j, p in enumerate(g["params"]):
            if id(p) not in held and p.device.type != "meta":
                raise StateMismatch(f"optimizer param group {i}, parameter {j} ({list(p.shape)}) is not among the model's "
                                    "parameters and buffers; its value and state would not be saved (name it in the model)")
