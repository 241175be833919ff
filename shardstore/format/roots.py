"""The learned-state root and the full root (SPEC.md §Roots).

The learned-state root is the BLAKE3 hash of the canonical encoding of a ``LearnedState``
document: the global step and data cursor, the model config id, the optimizer (algorithm
and named groups with their hyperparameters) and every tensor entry sorted by name
(name, dtype, shape, payload id, group, Adam birth and age, moment ids; a buffer's kind;
the per-parameter state of any other torch optimizer) and the commit-wide extras
(schedulers, scalers: SPEC.md §Extras). Tensor bytes
enter through their object ids, which are hashes of those bytes. Nothing about the layout,
the slots, RNG or per-slot extras enters it, so the same learned state split any number of ways has one
learned-state root.

The full root is the commit id: the object id of the commit manifest's canonical bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

from .manifest import ExtraEntry, LearnedState, OptimizerSpec, TensorEntry, encode, shard_version
from .tensors import hash_bytes

__all__ = ["learned_state", "learned_root"]


def learned_state(
    *,
    step: int,
    data_cursor: int | None,
    config: str | None,
    optimizer: OptimizerSpec,
    entries: Iterable[TensorEntry],
    extras: Iterable[ExtraEntry] = (),
    bands: bool = False,
) -> LearnedState:
    entries = list(entries)
    return LearnedState(
        # 4 iff a payload is chunked, else 1; a commit of version 2 or 3 (the row-band grid):
        # 3 iff a state tensor is chunked, 2 iff a payload is (SPEC.md §Versioning); never slices
        version=shard_version(entries, bands=bands),
        step=step,
        data_cursor=data_cursor,
        config=config,
        optimizer=optimizer,
        tensors=tuple(sorted(entries, key=lambda e: e.name)),
        extras=tuple(sorted(extras, key=lambda x: x.key)),
    )


def learned_root(
    *,
    step: int,
    data_cursor: int | None,
    config: str | None,
    optimizer: OptimizerSpec,
    entries: Iterable[TensorEntry],
    extras: Iterable[ExtraEntry] = (),
    bands: bool = False,
) -> str:
    """The learned-state root of the given values (see module docstring); ``bands``: of a
    commit of version 2 or 3, whose chunked payloads are on the row-band grid."""
    doc = learned_state(
        step=step,
        data_cursor=data_cursor,
        config=config,
        optimizer=optimizer,
        entries=entries,
        extras=extras,
        bands=bands,
    )
    return hash_bytes(encode(doc))
