"""accelerate's ``save_state`` / ``load_state``, as commits: ``save_accelerator_state`` and ``load_accelerator_state``.

accelerate's own checkpoint is a directory of pickles (optimizer, scheduler, sampler, RNG) beside
safetensors weights; its ``save_state`` hooks see only the weights. Here everything an
``Accelerator`` prepared or was given is one commit, without pickle, and resumes bitwise,
mid-epoch included::

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    model, opt, loader, sched = accelerator.prepare(model, opt, StatefulDataLoader(data, shuffle=True), sched)
    ...
    save_accelerator_state(accelerator, store, step=step)     # was: accelerator.save_state(dir)
    restored = load_accelerator_state(accelerator, store)     # was: accelerator.load_state(dir)

What a commit holds, by where accelerate keeps it (``save_state``'s own list):

- the prepared models (``accelerator._models``) as what they wrap (``DistributedDataParallel``
  unwrapped, ``torch.compile``'s names without ``_orig_mod``: ``state.module``): one model's
  tensors under its own names, several under ``model_0.``, ``model_1.``, …;
- the prepared optimizers as what they wrap (``AcceleratedOptimizer``: ``state.wrapped``),
  several as one optimizer whose groups are theirs in order (they must be of one class);
- commit-wide extras: each prepared scheduler (``scheduler_0``, …), the gradient scaler
  (``scaler``), each object given to ``register_for_checkpointing`` (``custom_0``, …) and
  accelerate's step counter, which decides when gradient accumulation syncs (``accelerator``:
  ``{"step": N}``);
- the slot's own extras: each prepared data loader (``dataloader_0``, …) with its epoch
  counter and, around torchdata's ``StatefulDataLoader``, its position within the epoch
  (``state.stateful``; a loader that is mid-epoch and cannot say where is refused);
- the process's RNG: Python's, NumPy's, torch's CPU and CUDA generators, every one
  ``accelerate.utils.set_seed`` seeds on these devices; a loader's own generators are in its extra.

Anything the commit holds that the accelerator cannot take back (a scheduler saved, none
prepared now) is refused before a byte is written (``StateMismatch``), and so is a run of
several processes: each rank's RNG and loader position would need a slot of its own
(``save_distributed``), which this recipe does not build. So are hooks given to
``register_save_state_pre_hook`` (at save) and ``register_load_state_pre_hook`` (at load):
``save_state`` runs them on its output directory, where they write files of their own (an EMA
model that was never prepared, say), and this recipe has no directory to run them on, so what they
would save would be silently missing (``UnsupportedState`` naming them: hand such objects over as
``extra=`` or to ``register_for_checkpointing`` instead, and remove the hook).

``shardstore.save`` / ``restore`` take the same prepared objects one by one; this module only
gathers them from the accelerator (the attributes its ``save_state`` reads), and imports
nothing of accelerate: ``import shardstore.accelerate`` costs no framework import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .checkpoint.restore import Restored, restore
from .checkpoint.slots import AUTO, save
from .errors import StateMismatch, UnsupportedState
from .state.module import unwrap_module
from .store import Store
from .verification.commits import load_commit

__all__ = ["save_accelerator_state", "load_accelerator_state", "accelerator_objects", "AcceleratorObjects"]

#: The commit-wide extra holding accelerate's own counters.
COUNTERS_KEY = "accelerator"


class _Counters:
    """accelerate's step counter as an extra (``Accelerator.step``: micro-steps, for gradient accumulation)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        step = sd.get("step") if isinstance(sd, Mapping) and set(sd) == {"step"} else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateMismatch(f"extra {COUNTERS_KEY!r}: {{'step': int >= 0}} expected, the commit holds {sd!r}")
        self.accelerator.step = step


class _Optimizers:
    """Several prepared optimizers as one container (``state.wrapped``'s ``WrapsOptimizers`` shape)."""

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers


@dataclass
class AcceleratorObjects:
    """What ``save_accelerator_state`` passes to ``shardstore.save``, gathered from an ``Accelerator``."""

    model: torch.nn.Module | Mapping[str, torch.Tensor]
    optimizer: Any
    extra: dict[str, Any]
    slot_extra: dict[str, Any]


def _refuse_state_hooks(accelerator: Any, kind: str) -> None:
    """UnsupportedState if ``accelerator`` holds hooks ``save_state`` (``kind`` "save") or ``load_state``
    ("load") would run on its directory: what they write or read there would be missing (module docstring)."""
    hooks = getattr(accelerator, f"_{kind}_model_state_pre_hook", None) or {}
    if hooks:
        names = [getattr(h, "__qualname__", type(h).__name__) for h in hooks.values()]
        raise UnsupportedState(
            f"shardstore.accelerate: the accelerator holds register_{kind}_state_pre_hook hooks {names}; "
            f"accelerate's {kind}_state runs them on its output directory and this recipe has none, so what they "
            f"{'write' if kind == 'save' else 'read'} there would be silently missing: pass such objects as extra= "
            "or to register_for_checkpointing, and remove the hook (the handle's remove())"
        )


def accelerator_objects(accelerator: Any, extra: Mapping[str, Any] | None = None) -> AcceleratorObjects:
    """The prepared models, optimizers, schedulers, scaler, registered objects, counters and loaders of
    ``accelerator`` as ``save``/``restore`` take them (keys as the module docstring lists), with the
    caller's own commit-wide ``extra`` beside them."""
    if getattr(accelerator, "num_processes", 1) != 1:
        raise UnsupportedState(
            f"shardstore.accelerate: the accelerator runs {accelerator.num_processes} processes; each rank's RNG "
            "and data loader position need a slot of their own, which this recipe does not write (use "
            "shardstore.save_distributed)"
        )
    models = [unwrap_module(m) for m in accelerator._models]
    if len(models) == 1:
        model: Any = models[0]
    else:  # none: an empty commit of tensors; several: each under its own prefix
        model = torch.nn.ModuleDict({f"model_{i}": m for i, m in enumerate(models)}) if models else {}
    optimizers = list(accelerator._optimizers)
    optimizer = None if not optimizers else optimizers[0] if len(optimizers) == 1 else _Optimizers(optimizers)
    own: dict[str, Any] = {f"scheduler_{i}": s for i, s in enumerate(accelerator._schedulers)}
    own.update({f"custom_{i}": o for i, o in enumerate(accelerator._custom_objects)})
    if accelerator.scaler is not None:
        own["scaler"] = accelerator.scaler
    own[COUNTERS_KEY] = _Counters(accelerator)
    clash = sorted(set(own) & set(extra or {}))
    if clash:
        raise StateMismatch(f"extra keys {clash} are the accelerator's own (the module docstring lists them)")
    loaders = {f"dataloader_{i}": d for i, d in enumerate(accelerator._dataloaders)}
    return AcceleratorObjects(model, optimizer, {**own, **(extra or {})}, loaders)


def save_accelerator_state(
    accelerator: Any,
    store: Store,
    *,
    step: int,
    ref: str | None = "main",
    job: str = "default",
    config: Mapping[str, Any] | None = None,
    parent: str | None = AUTO,
    threads: int = 2,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Commit everything ``accelerator`` prepared or was given, and the process's RNG; return the commit id.

    ``step``: the number of optimizer steps taken (the commit's global step, at least every
    parameter's Adam age); ``extra``: the caller's own commit-wide objects with ``state_dict()``.
    """
    _refuse_state_hooks(accelerator, "save")
    objs = accelerator_objects(accelerator, extra)
    return save(
        store,
        objs.model,
        objs.optimizer,
        step=step,
        ref=ref,
        job=job,
        config=config,
        parent=parent,
        threads=threads,
        extra=objs.extra,
        slot_extra=objs.slot_extra,
    )


def load_accelerator_state(
    accelerator: Any,
    store: Store,
    target: str = "main",
    *,
    threads: int = 8,
    extra: Mapping[str, Any] | None = None,
) -> Restored:
    """Restore commit ``target`` into everything ``accelerator`` prepared or was given, in place, and the RNG.

    Prepare the same objects as the saving run did (``accelerate`` resumes so too), then call
    this before the training loop; ``Restored.step`` is the saved step. A commit whose extras are
    not exactly the accelerator's (and ``extra``'s) is refused before anything is written.
    """
    _refuse_state_hooks(accelerator, "load")
    objs = accelerator_objects(accelerator, extra)
    lc = load_commit(store, target)
    held = {x.key for x in lc.commit.extras}
    slot_held = {x.key for s in lc.shards.values() for x in s.extras}
    for what, have, want in (("commit-wide", held, set(objs.extra)), ("data loader", slot_held, set(objs.slot_extra))):
        if have != want:
            raise StateMismatch(
                f"commit {lc.id} holds {what} extras {sorted(have)}, the accelerator has {sorted(want)}: prepare "
                "(and register_for_checkpointing) what the saving run did"
            )
    return restore(
        store,
        lc.id,
        objs.model,
        objs.optimizer,
        rng=True,
        threads=threads,
        extra=objs.extra,
        slot_extra=objs.slot_extra,
    )
