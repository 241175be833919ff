"""Which fields of a manifest hold tensor payloads, and the format version they need
(SPEC.md §Chunked payloads, §Versioning).

A manifest carries the lowest version that can express it, so state that uses nothing new
encodes (and hashes) exactly as before: verify, gc, copy and the version rule all go through
``tensor_payloads`` / ``state_payloads`` here, so a new kind of tensor is one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ..tensors import expected_nbytes
from .schema import (
    CHUNKED_VERSION,
    FORMAT_VERSION,
    STATE_CHUNKED_VERSION,
    TILE_VERSION,
    ExtraEntry,
    Payload,
    Slice,
    TensorEntry,
)

__all__ = [
    "extra_objects",
    "TREE_KEY",
    "is_chunked",
    "tensor_payloads",
    "state_payloads",
    "shard_version",
    "legal_versions",
    "banded",
]


def is_chunked(payload: "Payload | None") -> bool:
    return payload is not None and not isinstance(payload, str)


def tensor_payloads(e: TensorEntry) -> list[tuple[str, Payload, str]]:
    """(role, payload, dtype) of every tensor payload an entry names, parameter first.

    The one place that knows which fields of a tensor entry hold payloads: verify, gc,
    copy and the version rule go through it, so a new kind of tensor is one line here.
    """
    out: list[tuple[str, Payload, str]] = [("param", e.param, e.dtype)]
    o = e.optim
    if o is not None and o.moment_dtype is not None:
        for role in ("exp_avg", "exp_avg_sq"):
            m = getattr(o, role)
            if m is not None:
                out.append((role, m, o.moment_dtype))
    return out


def state_payloads(e: TensorEntry) -> list[tuple[str, Payload, str, tuple[int, ...]]]:
    """(state key, payload, dtype, shape) of every torch-form state tensor of an entry, in key order."""
    return [] if e.state is None else [(t.key, t.object, t.dtype, tuple(t.shape)) for t in e.state.tensors]


def _any_chunked(entries: "tuple[TensorEntry, ...] | list[TensorEntry]") -> bool:
    return any(is_chunked(p) for e in entries for _, p, _ in tensor_payloads(e)) or any(
        is_chunked(p) for e in entries for _, p, _, _ in state_payloads(e)
    )


def shard_version(
    entries: "tuple[TensorEntry, ...] | list[TensorEntry]", slices: "tuple[Slice, ...]" = (), *, bands: bool = False
) -> int:
    """The version a writer gives these entries (and a shard manifest's slices): 4 iff any
    payload is chunked (the tile grid), else 3 iff slices are recorded, else 1. The
    learned-state document passes entries only.

    ``bands``: the rule of versions 2 and 3, whose chunked payloads are on the row-band grid
    (what they wrote, still read): 3 iff a torch-form state tensor is chunked or slices are
    recorded, else 2 iff a payload is chunked, else 1."""
    if not bands:
        if _any_chunked(entries):
            return TILE_VERSION
        return STATE_CHUNKED_VERSION if slices else FORMAT_VERSION
    if slices or any(is_chunked(p) for e in entries for _, p, _, _ in state_payloads(e)):
        return STATE_CHUNKED_VERSION
    return CHUNKED_VERSION if any(is_chunked(p) for e in entries for _, p, _ in tensor_payloads(e)) else FORMAT_VERSION


def legal_versions(
    entries: "tuple[TensorEntry, ...] | list[TensorEntry]", slices: "tuple[Slice, ...]" = ()
) -> tuple[int, ...]:
    """The versions a reader accepts for these entries: the writer's, and the version 2 or 3
    that wrote them on the row-band grid (which grid the payloads follow is checked by the
    version found: ``banded``)."""
    return tuple(sorted({shard_version(entries, slices), shard_version(entries, slices, bands=True)}))


def banded(version: int) -> bool:
    """Whether a manifest of ``version`` puts its chunked payloads on the row-band grid (2, 3)."""
    return version < TILE_VERSION


#: The commit-wide extra holding a state dict's tree (SPEC.md §9.6): its document is read by the tree's grammar.
TREE_KEY = "state_dict"


def extra_objects(extras: Iterable[ExtraEntry], where: str) -> Iterator[tuple[str, int | None, str, int | None]]:
    """(object id, byte size or None, what, placeholders) of every object the extras name
    (verify, copy, gc): placeholders is a state document's number of tensors (verify decodes
    it with that many), None for a tensor."""
    for x in extras:
        yield x.state, None, f"state document of extra {x.key!r}{where}", len(x.tensors)
        for t in x.tensors:
            yield t.object, expected_nbytes(t.dtype, t.shape), f"tensor {t.key} of extra {x.key!r}{where}", None
