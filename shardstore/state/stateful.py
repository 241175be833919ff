"""Extras for objects that hold state without ``state_dict()``: ``torch.Generator`` and ``DataLoader`` (SPEC.md §9.3).

A ``torch.Generator``'s state is a ``uint8`` tensor (``get_state()`` / ``set_state()``), so
it is stored like any extra's tensor, without pickle, as the state document
``{"device": "cpu", "state": "tensor:0"}``. A ``torch.utils.data.DataLoader`` has no
``state_dict()``; what decides the order of its next epoch is the generators it and its
sampler hold (``DataLoader(generator=g)``, ``RandomSampler(generator=g)``), stored by their
attribute paths: ``{"generators": {"generator": {...}, "sampler.generator": {...}}}``. A sampler
or batch sampler with state of its own is stored beside them, by its attribute path, under
``samplers`` (absent when it has none): one with ``state_dict()`` / ``load_state_dict()``
through those, a ``DistributedSampler`` as its epoch (``{"epoch": 7}``, set back with
``set_epoch``). A dataset with ``state_dict()`` is stored under ``dataset`` (with
``num_workers=0``; with workers its state lives in their copies, and the save is refused). A
loader's position *within* an epoch lives in its iterator, not in the loader, and is not
captured: a loader with ``state_dict()`` (torchdata's ``StatefulDataLoader``) is stored
through it instead, position included.

accelerate's prepared loaders (``DataLoaderShard``, ``DataLoaderDispatcher``: a loader in
``base_dataloader`` and an epoch counter ``iteration``) are recognised by that shape, never
by importing accelerate:

- around a plain ``DataLoader`` their ``state_dict()`` cannot work (``_stateless_adapter``):
  they are stored as a loader is, with ``iteration`` beside the generators
  (``{"generators": {...}, "iteration": 1}``), between epochs only. While one is being
  iterated (it is in its ``gradient_state.dataloader_references``, where accelerate keeps the
  loaders a loop is inside) its position lives in an iterator no one can read, so a save
  refuses it (``UnsupportedState``) rather than store the start of its epoch;
- around a loader with a ``state_dict()`` of its own (``Accelerator(dataloader_config=
  DataLoaderConfiguration(use_stateful_dataloader=True))``: torchdata's
  ``StatefulDataLoader``) the loader's state, mid-epoch position included, is stored with
  ``iteration``: ``{"iteration": 1, "loader": {...}}`` (``PreparedLoaderState``). Mid-epoch, that
  state resumes the epoch's order only if it holds the sampler's state (torchdata's own
  samplers) or the sampler replays the same order (``SequentialSampler``, accelerate's
  ``SeedableRandomSampler`` of that epoch); else torchdata would fast-forward through a new
  order, and the save is refused. A restored loader gets its iterator back at once, as it
  had one when saved, so that making it draws its random seed before ``restore`` sets the
  process's RNG (last), not after.

``stateful(obj)`` gives the object itself when it has ``state_dict()``/``load_state_dict()``,
else one of the adapters below, else the object (which the caller then refuses).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ..errors import StateMismatch, UnsupportedState
from ..format.lazy import torch

__all__ = ["GeneratorState", "LoaderState", "PreparedLoaderState", "stateful"]

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


def _at_paths(loader: Any, paths: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(path, the object at that dotted attribute path of ``loader``, None where it has none) for each path."""
    out = []
    for path in paths:
        obj: Any = loader
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        out.append((path, obj))
    return out


def _generators(loader: Any) -> dict[str, torch.Generator]:
    """Each distinct generator of ``loader`` under the first path it is found at (``DataLoader(shuffle=True,
    generator=g)`` hands ``g`` to its ``RandomSampler``: one generator, stored once, as ``generator``)."""
    out: dict[str, torch.Generator] = {}
    for path, obj in _at_paths(loader, _LOADER_PATHS):
        if isinstance(obj, torch.Generator) and all(obj is not g for g in out.values()):
            out[path] = obj
    return out


#: Attribute paths of a DataLoader where a sampler or batch sampler with state of its own may live.
_SAMPLER_PATHS = (
    "sampler",
    "batch_sampler",
    "batch_sampler.sampler",
    "batch_sampler.batch_sampler",
    "batch_sampler.batch_sampler.sampler",
)


class _EpochState:
    """A ``DistributedSampler``'s epoch (``set_epoch``), which with its seed decides its order."""

    def __init__(self, sampler: Any, where: str) -> None:
        self.sampler, self.where = sampler, where

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.sampler.epoch}

    def check(self, sd: Any) -> None:
        """StateMismatch unless ``sd`` is a DistributedSampler's epoch (before anything is written)."""
        epoch = sd.get("epoch") if isinstance(sd, dict) and set(sd) == {"epoch"} else None
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise StateMismatch(f"{self.where}: the stored state is not a DistributedSampler's ({{'epoch': int}})")

    def load_state_dict(self, sd: Any) -> None:
        self.check(sd)
        self.sampler.set_epoch(sd["epoch"])


def _samplers(loader: Any) -> dict[str, Any]:
    """Each distinct sampler or batch sampler of ``loader`` that holds state of its own, under the first
    path it is found at: one with ``state_dict()`` / ``load_state_dict()`` as itself, a
    ``DistributedSampler`` as its epoch (``_EpochState``); samplers without state are left out."""
    out: dict[str, Any] = {}
    seen: list[Any] = []
    for path, obj in _at_paths(loader, _SAMPLER_PATHS):
        if obj is None or any(obj is s for s in seen):
            continue
        seen.append(obj)
        if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            out[path] = obj
        elif isinstance(obj, torch.utils.data.distributed.DistributedSampler):
            out[path] = _EpochState(obj, f"DataLoader.{path}")
    return out


class LoaderState:
    """A ``DataLoader`` without ``state_dict()`` as an extra: the states of the generators that decide its
    order, and (under ``samplers``, when it has any) those of its samplers that hold state of their own."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.parts = {p: GeneratorState(g, f"DataLoader.{p}") for p, g in _generators(loader).items()}
        self.samplers = _samplers(loader)
        dataset = _unsharded(getattr(loader, "dataset", None))
        has = callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))
        self.dataset = dataset if has else None
        # accelerate's loaders count epochs in ``iteration`` and hand it to the sampler's set_epoch
        self.epochs = isinstance(getattr(loader, "iteration", None), int)

    def state_dict(self) -> dict[str, Any]:
        if _iterating(self.loader):  # an accelerate loader a loop is inside (only those are listed there)
            raise UnsupportedState(
                f"{_label(self.loader)} around a plain DataLoader is being iterated: its position within the epoch "
                "lives in its iterator and cannot be saved; save between epochs, or build the loader as torchdata's "
                "StatefulDataLoader and prepare it with DataLoaderConfiguration(use_stateful_dataloader=True) "
                "(SPEC.md §Extras)"
            )
        out: dict[str, Any] = {"generators": {p: g.state_dict() for p, g in self.parts.items()}}
        if self.epochs:
            out["iteration"] = self.loader.iteration
        if self.samplers:  # absent without any: the document of a loader without them is as it was
            out["samplers"] = {p: s.state_dict() for p, s in self.samplers.items()}
        if self.dataset is not None:
            if getattr(self.loader, "num_workers", 0):
                raise UnsupportedState(
                    f"{_label(self.loader)}: its dataset (a {_label(self.dataset)}) has a state_dict(), but with "
                    "num_workers > 0 its state lives in the workers' copies, which this process cannot read; build "
                    "the loader as torchdata's StatefulDataLoader, or use num_workers=0 (SPEC.md §9.3)"
                )
            out["dataset"] = self.dataset.state_dict()
        return out

    def check(self, sd: Any) -> None:
        keys = {"generators", "iteration"} if self.epochs else {"generators"}
        # ``samplers`` and ``dataset`` are optional in the stored document: one without them (a commit from
        # before they were stored, or a loader that had none) restores the generators and leaves this
        # loader's samplers and dataset as they are; one with them needs a loader that can take them
        optional = ({"samplers"} if self.samplers else set()) | ({"dataset"} if self.dataset is not None else set())
        fits = isinstance(sd, dict) and keys <= set(sd) <= keys | optional
        stored = sd.get("generators") if fits else None
        if not isinstance(stored, dict):
            raise StateMismatch(
                f"DataLoader: the stored state is not this loader's ({sorted(keys)} expected"
                + (f", and optionally {sorted(optional)})" if optional else ")")
            )
        if self.epochs and (isinstance(sd["iteration"], bool) or not isinstance(sd["iteration"], int)):
            raise StateMismatch("DataLoader: the stored iteration is not an integer")
        if sorted(stored) != sorted(self.parts):
            raise StateMismatch(
                f"DataLoader: stored generators at {sorted(stored)}, this loader has them at {sorted(self.parts)}"
            )
        for p, g in self.parts.items():
            g.check(stored[p])
        samplers = sd.get("samplers", self.samplers)
        if not isinstance(samplers, dict) or sorted(samplers) != sorted(self.samplers):
            raise StateMismatch(
                f"DataLoader: stored sampler states at {sorted(samplers) if isinstance(samplers, dict) else samplers!r}, "
                f"this loader has samplers with state at {sorted(self.samplers)}"
            )
        for p, s in self.samplers.items() if "samplers" in sd else ():
            if isinstance(s, _EpochState):  # a DistributedSampler's epoch: checked here, before the model's tensors
                s.check(samplers[p])

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.check(sd)
        for p, g in self.parts.items():
            g.generator.set_state(sd["generators"][p]["state"])
        if self.epochs:
            self.loader.iteration = sd["iteration"]
        for p, s in self.samplers.items() if "samplers" in sd else ():
            s.load_state_dict(sd["samplers"][p])
        if "dataset" in sd:
            assert self.dataset is not None  # checked: a stored dataset state needs a dataset to take it
            self.dataset.load_state_dict(sd["dataset"])


def _unsharded(dataset: Any) -> Any:
    """The dataset whose state a loader's position is: accelerate's ``IterableDatasetShard`` (what
    ``prepare`` puts around an iterable dataset for several processes) holds none of its own, and
    iterates the dataset it wraps, whose state it is."""
    shards = sys.modules.get("accelerate.data_loader")
    shard_type = getattr(shards, "IterableDatasetShard", None)
    if isinstance(shard_type, type) and isinstance(dataset, shard_type):
        return getattr(dataset, "dataset", None)
    return dataset


def _label(obj: Any) -> str:
    cls = type(obj)  # accelerate's adapters report their base loader's class as __class__
    return f"{cls.__module__}.{cls.__qualname__}"


def _iterating(loader: Any) -> bool:
    """Whether an accelerate loop is inside ``loader``: accelerate's ``GradientState`` lists it in
    ``dataloader_references`` from the start of its ``__iter__`` to the end of its epoch."""
    refs = getattr(getattr(loader, "gradient_state", None), "dataloader_references", None)
    return isinstance(refs, list) and any(r is loader for r in refs)


#: Where torchdata's ``StatefulDataLoader`` keeps its sampler's state in its ``state_dict()`` (None when
#: the sampler has none, and torchdata resumes by fast-forwarding through a new iteration of it).
_SAMPLER_STATE_KEYS = ("_index_sampler_state", "_sampler_iter_state")


def _holds_sampler_state(sd: Any, depth: int = 0) -> bool:
    if not isinstance(sd, Mapping) or depth > 8:
        return False
    if any(sd.get(k) is not None for k in _SAMPLER_STATE_KEYS):
        return True
    return any(_holds_sampler_state(v, depth + 1) for v in sd.values())  # with workers: under "_snapshot"


def _replays(loader: Any) -> bool:
    """Whether a new iteration of the loader's sampler gives this epoch's order again: a
    ``SequentialSampler``, or accelerate's ``SeedableRandomSampler`` (seeded by its epoch)."""
    sampler: Any = getattr(loader, "batch_sampler", None) or getattr(loader, "sampler", None)
    for _ in range(8):  # BatchSamplerShard / SkipBatchSampler hold a batch sampler, which holds the sampler
        inner = getattr(sampler, "batch_sampler", None) or getattr(sampler, "sampler", None)
        if inner is None:
            break
        sampler = inner
    if isinstance(sampler, torch.utils.data.SequentialSampler):
        return True
    return isinstance(getattr(sampler, "initial_seed", None), int) and isinstance(getattr(sampler, "epoch", None), int)


class PreparedLoaderState:
    """accelerate's prepared loader around a loader with ``state_dict()`` (torchdata's ``StatefulDataLoader``):
    that state, mid-epoch position included, and accelerate's epoch counter ``iteration``."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        state = self.loader.state_dict()  # accelerate's copy, taken before each batch it yields
        if _iterating(self.loader) and not _holds_sampler_state(state) and not _replays(self.loader):
            raise UnsupportedState(
                f"{_label(self.loader)} is being iterated and its state holds no state of its sampler (a "
                f"{_label(getattr(self.loader, 'sampler', None))} or one inside its batch sampler), so a resume "
                "would fast-forward through another order; build the loader as torchdata's StatefulDataLoader "
                "(its samplers keep their state), or save between epochs (SPEC.md §Extras)"
            )
        return {"iteration": self.loader.iteration, "loader": state}

    def check(self, sd: Any) -> None:
        if not isinstance(sd, dict) or set(sd) != {"iteration", "loader"}:
            raise StateMismatch(
                f"{_label(self.loader)}: the stored state is not a prepared loader's ({{'iteration', 'loader'}} expected)"
            )
        if isinstance(sd["iteration"], bool) or not isinstance(sd["iteration"], int) or sd["iteration"] < 0:
            raise StateMismatch(f"{_label(self.loader)}: the stored iteration is not an integer >= 0")
        if not isinstance(sd["loader"], dict):
            raise StateMismatch(f"{_label(self.loader)}: the stored loader state is not a dict")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.check(sd)
        self.loader.load_state_dict(sd["loader"])
        self.loader.iteration = sd["iteration"]
        base = self.loader.base_dataloader
        # The iterator it had when saved, made now (StatefulDataLoader: a state_dict() before __iter__ makes the
        # iterator the next __iter__ uses), and accelerate's copy of the state, which its load_state_dict leaves stale.
        self.loader.dl_state_dict = base.state_dict()


def _stateless_adapter(obj: Any) -> bool:
    """accelerate's ``DataLoaderShard`` / ``DataLoaderDispatcher`` around a plain ``DataLoader``:
    its ``state_dict()`` returns ``dl_state_dict``, which accelerate sets only around a loader
    with a ``state_dict()`` of its own (torchdata's ``StatefulDataLoader``), so here it raises
    ``AttributeError: 'DataLoader' object has no attribute 'dl_state_dict'``."""
    base = getattr(obj, "base_dataloader", None)
    return isinstance(base, torch.utils.data.DataLoader) and not callable(getattr(base, "state_dict", None))


def _stateful_adapter(obj: Any) -> bool:
    """accelerate's ``DataLoaderShard`` / ``DataLoaderDispatcher`` around a loader with ``state_dict()``."""
    base = getattr(obj, "base_dataloader", None)
    return (
        isinstance(base, torch.utils.data.DataLoader)
        and callable(getattr(base, "state_dict", None))
        and isinstance(getattr(obj, "iteration", None), int)
    )


def stateful(obj: Any) -> Any:
    """``obj`` if it has ``state_dict()``, else a Generator or DataLoader adapter, else ``obj``."""
    if _stateless_adapter(obj):
        return LoaderState(obj)
    if _stateful_adapter(obj):
        return PreparedLoaderState(obj)
    if callable(getattr(obj, "state_dict", None)):
        return obj
    if isinstance(obj, torch.Generator):
        return GeneratorState(obj)
    if isinstance(obj, torch.utils.data.DataLoader):
        return LoaderState(obj)
    return obj
