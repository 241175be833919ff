"""The manifest rules a reader checks beyond each field's own constraint: buffers, the torch
form of optimizer state, state tensors' payloads and the extras binding a commit to its
shards (SPEC.md §Optimizer state, §Buffers, §Extras, §Binding).

``verification.checker`` reports what they yield as problems; a restore refuses on the first.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..errors import BindingError, ManifestError, ShardstoreError
from ..format.canonical import in_int_range, sorted_unique
from ..format.grid import grid_problems
from ..format.manifest import (
    STATE_CHUNKED_VERSION,
    CommitManifest,
    ShardManifest,
    TensorEntry,
    TorchOptimizer,
    banded,
    is_chunked,
    state_payloads,
)
from ..format.tensors import FLOAT_DTYPES
from ..state.extras import extras_rules

__all__ = ["state_problems", "shard_rules", "commit_rules"]


def state_problems(e: TensorEntry, version: int) -> Iterator[str]:
    """What is wrong with the payloads of an entry's state tensors in a manifest of ``version``:
    from version 3 they follow the canonical grid (SPEC.md §Chunked payloads: the row-band grid in
    version 3, the tile grid from version 4); before, each is one object whatever its size
    (what versions 1 and 2 wrote, still read)."""
    for key, payload, dtype, shape in state_payloads(e):
        if version >= STATE_CHUNKED_VERSION:
            for msg in grid_problems(payload, dtype, shape, bands=banded(version)):
                yield f"optimizer state {key!r} payload: {msg}"
        elif is_chunked(payload):  # the version rule reports it too; say which tensor
            yield f"optimizer state {key!r} is chunked in a version {version} manifest (chunked state needs version {STATE_CHUNKED_VERSION})"


def shard_rules(shard: ShardManifest) -> Iterator[tuple[type[ManifestError], str, str | None]]:
    """Structural rules of buffers and of the torch form in one shard manifest: (error, message, tensor)."""
    spec = shard.torch_optimizer
    if (shard.algorithm == "torch") != (spec is not None):
        yield (
            ManifestError,
            "torch_optimizer must be present exactly under algorithm 'torch' (SPEC.md §Optimizer state)",
            None,
        )
    if spec is not None and shard.groups:
        yield ManifestError, "algorithm 'torch' with Adam groups", None
    gnames = [g.name for g in spec.groups] if spec is not None else []
    if not sorted_unique(gnames):
        yield ManifestError, "torch optimizer groups are not sorted by name and unique", None
    for msg in _hyper_rules(spec):
        yield ManifestError, msg, None
    used: set[str] = set()
    for e in shard.entries:
        if e.kind == "buffer" and (e.optim is not None or e.state is not None):
            yield ManifestError, "a buffer has optimizer state (SPEC.md §Buffers)", e.name
        if e.optim is not None and shard.algorithm == "torch":
            yield ManifestError, "Adam state under algorithm 'torch'", e.name
        st = e.state
        if st is None:
            continue
        used.add(st.group)
        if shard.algorithm != "torch":
            yield ManifestError, f"torch-form optimizer state under algorithm {shard.algorithm!r}", e.name
        if st.group not in gnames:
            yield ManifestError, f"group {st.group!r} is not among the shard's torch optimizer groups {gnames}", e.name
        tkeys, skeys = [t.key for t in st.tensors], [x.key for x in st.scalars]
        if not (sorted_unique(tkeys) and sorted_unique(skeys)) or set(tkeys) & set(skeys):
            yield (
                ManifestError,
                "optimizer state keys are not sorted, unique and each either a tensor or a scalar",
                e.name,
            )
        for x in st.scalars:
            if not in_int_range(
                x.value
            ):  # the writer's range (``torch_optim._scalar``), enforced when reading too (SPEC.md §9.1)
                yield (
                    ManifestError,
                    f"optimizer state {x.key!r}: integer {x.value} is outside the 64-bit range -2^63 <= n < 2^64",
                    e.name,
                )
            kind = (
                None
                if x.dtype is None
                else ("bool" if x.dtype == "bool" else ("real" if x.dtype in FLOAT_DTYPES else "int"))
            )
            have = (
                "bool"
                if isinstance(x.value, bool)
                else ("int" if isinstance(x.value, int) else ("real" if isinstance(x.value, str) else None))
            )
            if kind is not None and have != kind:
                yield (
                    ManifestError,
                    f"optimizer state {x.key!r}: a {x.dtype} 0-d tensor must hold a {kind}, not {have}",
                    e.name,
                )
    if set(gnames) - used:
        yield (
            ManifestError,
            f"torch optimizer groups {sorted(set(gnames) - used)} are not used by any tensor entry",
            None,
        )


def _hyper_rules(spec: TorchOptimizer | None) -> Iterator[str]:
    for g in spec.groups if spec is not None else ():
        for k, v in sorted(g.hyper.items()):
            if not in_int_range(v):
                yield f"torch optimizer group {g.name!r}: hyperparameter {k!r} holds an integer outside the 64-bit range -2^63 <= n < 2^64"


def commit_rules(
    commit: CommitManifest, shards: Mapping[int, ShardManifest]
) -> Iterator[tuple[type[ShardstoreError], str, str | None]]:
    """Rules of the torch form and extras binding a commit to its shards: (error, message, shard manifest id)."""
    spec = commit.optimizer.torch_optimizer
    tgroups = {g.name: g for g in spec.groups} if spec is not None else {}
    if (commit.optimizer.algorithm == "torch") != (spec is not None) or (spec is not None and commit.optimizer.groups):
        yield (
            ManifestError,
            "torch_optimizer must be present exactly under algorithm 'torch', without Adam groups",
            None,
        )
    if spec is not None and [g.name for g in spec.groups] != sorted(tgroups):
        yield ManifestError, "torch optimizer groups are not sorted by name and unique", None
    for msg in _hyper_rules(spec):
        yield ManifestError, msg, None
    for msg in extras_rules(commit.extras):
        yield ManifestError, msg, None
    used: set[str] = set()
    sids = {lay.slot: lay.shard for lay in commit.layout}
    for slot, shard in sorted(shards.items()):
        t = shard.torch_optimizer
        if t is None:
            continue
        if spec is None or t.class_name != spec.class_name:
            want = spec.class_name if spec else None
            yield (
                BindingError,
                f"shard's optimizer class is {t.class_name!r} but the commit's is {want!r} (SPEC.md §Binding)",
                sids.get(slot),
            )
        for g in t.groups:
            if tgroups.get(g.name) != g:
                yield (
                    BindingError,
                    f"group {g.name!r} differs from the commit's torch optimizer group of that name",
                    sids.get(slot),
                )
            used.add(g.name)
    if set(tgroups) - used and len(shards) == len(commit.layout):
        yield ManifestError, f"torch optimizer groups {sorted(set(tgroups) - used)} are used by no tensor", None
