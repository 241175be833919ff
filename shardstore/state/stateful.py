"""Extras for objects that hold state without ``state_dict()``: ``torch.Generator`` and ``DataLoader`` (SPEC.md §9c).

A ``torch.Generator``'s state is a ``uint8`` tensor (``get_state()`` / ``set_state()``), so
it is stored like any extra's tensor, without pickle, as the state document
``{"device": "cpu", "state": "tensor:0"}``. A ``torch.utils.data.DataLoader`` has no
``state_dict()``; what decides the order of its next epoch is the generators it and its
sampler hold (``DataLoader(generator=g)``, ``RandomSampler(generator=g)``), stored by their
attribute paths: ``{"generators": {"generator": {...}, "sampler.generator": {...}}}``. A
loader's position *within* an epoch lives in its iterator, not in the loader, and is not
captured: a loader with ``state_dict()`` (torchdata's ``StatefulDataLoader``) is stored
through it instead, position included. accelerate's prepared loaders (``DataLoaderShard``,
``DataLoaderDispatcher``) around a plain ``DataLoader`` have a ``state_dict()`` that cannot
work (``_stateless_adapter``): they are stored as a loader is, with accelerate's epoch counter
``iteration`` beside the generators (``{"generators": {...}, "iteration": 1}``); around a
``StatefulDataLoader`` their own ``state_dict()`` is used.

``stateful(obj)`` gives the object itself when it has ``state_dict()``/``load_state_dict()``,
else one of the adapters below, else the object (which the caller then refuses).
"""

from __future__ import annotations

from typing import Any

from ..errors import StateMismatch
from ..format.lazy import torch

__all__ = ["GeneratorState", "LoaderState", "stateful"]

#: Attribute paths of a DataLoader where a generator that decides its order may live.
#: ``batch_sampler.batch_sampler.sampler.generator``: under accelerate's ``BatchSamplerShard``.
_LOADER_PATHS = (
    "generator",
    "sampler.generator",
    "batch_sampler.sampler.generator",
    "batch_sampler.batch_sampler.sampler.generator",
)


class GeneratorState:
    """A ``torch.Generator`` as an extra: its device and its state tensor."""

    def __init__(self, generator: torch.Generator, where: str = "generator") -> None:
        self.generator, self.where = generator, where

    def state_dict(self) -> dict[str, Any]:
        return {"device": str(self.generator.device), "state": self.generator.get_state()}

    def check(self, sd: Any) -> None:
        """StateMismatch unless ``sd`` is a generator state this generator can take (before anything is written)."""
        if not isinstance(sd, dict) or set(sd) != {"device", "state"}:
            raise StateMismatch(f"{self.where}: the stored state is not a generator's ({{'device', 'state'}} expected)")
        if sd["device"] != str(self.generator.device):
            raise StateMismatch(
                f"{self.where}: stored from a {sd['device']} generator, restoring into a {self.generator.device} one"
            )
        state = sd["state"]
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
            raise StateMismatch(f"{self.where}: the stored state is not a 1-d uint8 tensor")
        if state.numel() != self.generator.get_state().numel():
            raise StateMismatch(
                f"{self.where}: stored state has {state.numel()} bytes, this generator's has {self.generator.get_state().numel()}"
            )

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.check(sd)
        self.generator.set_state(sd["state"])


def _generators(loader: Any) -> dict[str, torch.Generator]:
    """Each distinct generator of ``loader`` under the first path it is found at (``DataLoader(shuffle=True,
    generator=g)`` hands ``g`` to its ``RandomSampler``: one generator, stored once, as ``generator``)."""
    out: dict[str, torch.Generator] = {}
    for path in _LOADER_PATHS:
        obj: Any = loader
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if isinstance(obj, torch.Generator) and all(obj is not g for g in out.values()):
            out[path] = obj
    return out


class LoaderState:
    """A ``DataLoader`` without ``state_dict()`` as an extra: the states of the generators that decide its order."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.parts = {p: GeneratorState(g, f"DataLoader.{p}") for p, g in _generators(loader).items()}
        # accelerate's loaders count epochs in ``iteration`` and hand it to the sampler's set_epoch
        self.epochs = isinstance(getattr(loader, "iteration", None), int)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"generators": {p: g.state_dict() for p, g in self.parts.items()}}
        if self.epochs:
            out["iteration"] = self.loader.iteration
        return out

    def check(self, sd: Any) -> None:
        keys = {"generators", "iteration"} if self.epochs else {"generators"}
        stored = sd.get("generators") if isinstance(sd, dict) and set(sd) == keys else None
        if not isinstance(stored, dict):
            raise StateMismatch(f"DataLoader: the stored state is not this loader's ({sorted(keys)} expected)")
        if self.epochs and (isinstance(sd["iteration"], bool) or not isinstance(sd["iteration"], int)):
            raise StateMismatch("DataLoader: the stored iteration is not an integer")
        if sorted(stored) != sorted(self.parts):
            raise StateMismatch(
                f"DataLoader: stored generators at {sorted(stored)}, this loader has them at {sorted(self.parts)}"
            )
        for p, g in self.parts.items():
            g.check(stored[p])

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.check(sd)
        for p, g in self.parts.items():
            g.generator.set_state(sd["generators"][p]["state"])
        if self.epochs:
            self.loader.iteration = sd["iteration"]


def _stateless_adapter(obj: Any) -> bool:
    """accelerate's ``DataLoaderShard`` / ``DataLoaderDispatcher`` around a plain ``DataLoader``:
    its ``state_dict()`` returns ``dl_state_dict``, which accelerate sets only around a loader
    with a ``state_dict()`` of its own (torchdata's ``StatefulDataLoader``), so here it raises
    ``AttributeError: 'DataLoader' object has no attribute 'dl_state_dict'``."""
    base = getattr(obj, "base_dataloader", None)
    return isinstance(base, torch.utils.data.DataLoader) and not callable(getattr(base, "state_dict", None))


def stateful(obj: Any) -> Any:
    """``obj`` if it has ``state_dict()``, else a Generator or DataLoader adapter, else ``obj``."""
    if _stateless_adapter(obj):
        return LoaderState(obj)
    if callable(getattr(obj, "state_dict", None)):
        return obj
    if isinstance(obj, torch.Generator):
        return GeneratorState(obj)
    if isinstance(obj, torch.utils.data.DataLoader):
        return LoaderState(obj)
    return obj
