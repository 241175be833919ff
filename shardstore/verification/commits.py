"""Reading a commit and its shard manifests, and their structural checks (SPEC.md §16, §17):
everything about a commit that can be judged from its manifests alone, before any tensor
byte is read. ``load_commit`` raises the first problem; ``verify`` collects them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import (
    BindingError,
    CursorError,
    GridError,
    LayoutError,
    ManifestError,
    ObjectNotFound,
    ShardstoreError,
    TensorMismatch,
)
from ..format.canonical import sorted_unique
from ..format.grid import grid_problems, payload_blocks
from ..format.manifest import (
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    CommitManifest,
    ShardManifest,
    TensorEntry,
    banded,
    decode_manifest,
    shard_version,
    tensor_payloads,
)
from ..format.roots import learned_root
from ..format.slices import commit_slice_problems, shard_slice_problems
from ..state.extras import extras_rules
from ..store import Store
from .rules import commit_rules, shard_rules, state_problems

__all__ = [
    "Problem",
    "LoadedCommit",
    "shard_problems",
    "commit_problems",
    "repeated_shards",
    "load_commit",
    "read_commit",
    "pinned_commits",
]

#: The algorithms of the canonical Adam form (SPEC.md §9), which a writer names only over Adam groups (§12).
_ADAM = ("adam", "adamw")


@dataclass(frozen=True)
class Problem:
    """One thing wrong, with the typed error that describes it."""

    error: ShardstoreError
    commit: str | None = None
    object: str | None = None
    tensor: str | None = None

    @property
    def kind(self) -> str:
        return type(self.error).__name__

    def __str__(self) -> str:
        return str(self.error)


@dataclass
class LoadedCommit:
    """A commit and its shard manifests, all structurally verified."""

    id: str
    commit: CommitManifest
    shards: dict[int, ShardManifest]
    shard_ids: dict[int, str]

    def entries(self) -> dict[str, TensorEntry]:
        return {e.name: e for s in self.shards.values() for e in s.entries}

    def owner(self) -> dict[str, int]:
        return {name: lay.slot for lay in self.commit.layout for name in lay.tensors}


def shard_problems(shard: ShardManifest, sid: str, commit_id: str | None = None) -> Iterator[Problem]:
    """Rules a shard manifest must satisfy on its own."""

    def p(err: type[ShardstoreError], msg: str, tensor: str | None = None) -> Problem:
        where = f"shard manifest {sid}" + (f" of commit {commit_id}" if commit_id else "")
        t = f", tensor {tensor!r}" if tensor else ""
        return Problem(err(f"{where}{t}: {msg}"), commit_id, sid, tensor)

    if shard.slot >= shard.slots:
        yield p(LayoutError, f"slot {shard.slot} is not below slot count {shard.slots}")
    names = [e.name for e in shard.entries]
    if not sorted_unique(names):
        yield p(ManifestError, "tensor entries are not sorted by name and unique (SPEC.md §Shard manifest)")
    gnames = [g.name for g in shard.groups]
    if not sorted_unique(gnames):
        yield p(ManifestError, "optimizer groups are not sorted by name and unique")
    kinds = [r.kind for r in shard.rng]
    if not sorted_unique(kinds):
        yield p(ManifestError, "RNG entries are not sorted by kind and unique")
    if shard.algorithm == "none" and shard.groups:
        yield p(ManifestError, "algorithm 'none' with optimizer groups")
    if shard.algorithm in _ADAM and not shard.groups:
        yield p(
            ManifestError,
            f"algorithm {shard.algorithm!r} with no optimizer groups: a writer writes 'none' (SPEC.md §Binding)",
        )
    used: set[str] = set()
    for e in shard.entries:
        o = e.optim
        if o is None:
            continue
        used.add(o.group)
        if shard.algorithm == "none":
            yield p(ManifestError, "optimizer state under algorithm 'none'", e.name)
        if o.group not in gnames:
            yield p(ManifestError, f"group {o.group!r} is not among the shard's groups {gnames}", e.name)
        if o.birth + o.age != shard.step:
            yield p(
                CursorError,
                f"Adam age {o.age} does not equal global step {shard.step} minus birth {o.birth} (SPEC.md §Optimizer state)",
                e.name,
            )
        has = (o.exp_avg is not None, o.exp_avg_sq is not None)
        if has[0] != has[1]:
            yield p(ManifestError, "exactly one Adam moment is present", e.name)
        if o.age > 0 and not has[0]:
            yield p(CursorError, f"Adam age {o.age} > 0 but no moments are stored", e.name)
        if has[0] != (o.moment_dtype is not None):
            yield p(ManifestError, "moment_dtype must be set exactly when moments are present", e.name)
    whole = (
        shard.version == FORMAT_VERSION
    )  # version 1: a tensor of any size may be one object, as format 1 wrote it (SPEC.md §5.1)
    for e in shard.entries:
        for role, payload, dtype in tensor_payloads(e):
            for msg in grid_problems(payload, dtype, e.shape, bands=banded(shard.version), whole=whole):
                yield p(GridError, f"{role} payload: {msg} (SPEC.md §Chunked payloads)", e.name)
        for msg in state_problems(e, shard.version):
            yield p(GridError, f"{msg} (SPEC.md §Chunked payloads)", e.name)
    if set(gnames) - used:
        yield p(ManifestError, f"groups {sorted(set(gnames) - used)} are not used by any tensor entry")
    for err, msg, tensor in shard_rules(shard):  # buffers and the torch form (SPEC.md §Buffers, §Optimizer state)
        yield p(err, msg, tensor)
    for msg in extras_rules(shard.extras):
        yield p(ManifestError, msg)
    for msg in shard_slice_problems(shard):
        yield p(ManifestError, msg)


def commit_problems(
    commit: CommitManifest, cid: str, shards: dict[int, ShardManifest], shard_ids: dict[int, str]
) -> Iterator[Problem]:
    """Rules binding a commit to its shard manifests, and the learned-state root."""

    def p(err: type[ShardstoreError], msg: str, obj: str | None = None, tensor: str | None = None) -> Problem:
        t = f", tensor {tensor!r}" if tensor else ""
        o = f", shard manifest {obj}" if obj and obj != cid else ""
        return Problem(err(f"commit {cid}{o}{t}: {msg}"), cid, obj or cid, tensor)

    versions = {s.version for s in shards.values()}
    if len(shards) == len(commit.layout) and versions and commit.version != max(versions):
        yield p(
            ManifestError,
            f"commit has version {commit.version} but its shard manifests need version {max(versions)} (SPEC.md §Versioning)",
        )
    slots = [lay.slot for lay in commit.layout]
    if slots != list(range(len(slots))):
        yield p(
            LayoutError, f"layout slots {slots} are not exactly 0..{len(slots) - 1} in order (SPEC.md §Commit manifest)"
        )
    gnames = [g.name for g in commit.optimizer.groups]
    if not sorted_unique(gnames):
        yield p(ManifestError, "optimizer groups are not sorted by name and unique")
    if commit.optimizer.algorithm in _ADAM and not gnames:
        yield p(
            ManifestError,
            f"algorithm {commit.optimizer.algorithm!r} with no optimizer groups: a writer writes 'none' (SPEC.md §Binding)",
        )
    groups = {g.name: g for g in commit.optimizer.groups}
    for err, msg, obj in commit_rules(commit, shards):  # the torch form and extras (SPEC.md §9.1, §9.3)
        yield p(err, msg, obj)
    owners: dict[str, int] = {}
    for lay in commit.layout:
        if not sorted_unique(list(lay.tensors)):
            yield p(ManifestError, f"slot {lay.slot}'s tensor list is not sorted and unique")
        for name in lay.tensors:
            if name in owners:
                yield p(
                    LayoutError, f"owned twice, by slots {owners[name]} and {lay.slot} (SPEC.md §Layout)", tensor=name
                )
            else:
                owners[name] = lay.slot
    all_entries: list[TensorEntry] = []
    used_groups: set[str] = set()
    for lay in commit.layout:
        sid = lay.shard
        shard = shards.get(lay.slot)
        if shard is None:
            continue  # reported by the caller as a missing object
        binding = {
            "job": (shard.job, commit.job),
            "step": (shard.step, commit.step),
            "parent": (shard.parent, commit.parent),
            "config": (shard.config, commit.config),
            "slot": (shard.slot, lay.slot),
            "slots": (shard.slots, len(commit.layout)),
        }
        if (shard.groups or shard.torch_optimizer is not None) and shard.algorithm != commit.optimizer.algorithm:
            binding["algorithm"] = (shard.algorithm, commit.optimizer.algorithm)
        for fieldname, (have, want) in binding.items():
            if have != want:
                yield p(
                    BindingError,
                    f"shard's {fieldname} is {have!r} but the commit's is {want!r} (SPEC.md §Binding)",
                    sid,
                )
        for g in shard.groups:
            if groups.get(g.name) != g:
                yield p(BindingError, f"group {g.name!r} differs from the commit's optimizer group of that name", sid)
            used_groups.add(g.name)
        names = [e.name for e in shard.entries]
        if names != list(lay.tensors):
            missing = sorted(set(lay.tensors) - set(names))
            extra = sorted(set(names) - set(lay.tensors))
            yield p(
                LayoutError,
                f"layout of slot {lay.slot} and its shard disagree: in layout only {missing[:5]}, in shard only {extra[:5]}",
                sid,
            )
        if banded(shard.version) and not banded(commit.version) and shard_version(shard.entries, bands=True) > 1:
            yield p(
                BindingError,
                f"shard of version {shard.version} puts chunked payloads on the row-band grid, "
                f"but the commit is version {commit.version} (the tile grid): a commit uses one grid (SPEC.md §Versioning)",
                sid,
            )
        all_entries.extend(shard.entries)
    if set(groups) - used_groups and len(shards) == len(commit.layout):
        yield p(ManifestError, f"optimizer groups {sorted(set(groups) - used_groups)} are used by no tensor")
    yield from _sizes_agree(cid, all_entries)
    if len(shards) == len(commit.layout):
        for msg, tensor, slot in commit_slice_problems(shards, {e.name: e for e in all_entries}):
            yield p(LayoutError, msg, shard_ids.get(slot), tensor)
        c = commit
        root = learned_root(
            step=c.step,
            data_cursor=c.data_cursor,
            config=c.config,
            optimizer=c.optimizer,
            entries=all_entries,
            extras=c.extras,
            bands=banded(c.version),
        )
        if root != commit.learned_root:
            yield p(
                ManifestError,
                f"learned-state root is {commit.learned_root} but the shards give {root} (SPEC.md §Roots)",
            )


def repeated_shards(commit: CommitManifest, cid: str) -> Iterator[Problem]:
    """A shard manifest binds one slot (its ``slot`` field), so a layout naming one shard
    manifest in several slots can never verify: refused before any shard manifest is read."""
    seen: dict[str, int] = {}
    for lay in commit.layout:
        if lay.shard in seen:
            yield Problem(
                LayoutError(f"commit {cid}: slots {seen[lay.shard]} and {lay.slot} name the same shard manifest {lay.shard} (SPEC.md §Layout)"),
                cid, lay.shard,
            )  # fmt: skip
            return
        seen[lay.shard] = lay.slot


def _sizes_agree(cid: str, entries: Iterable[TensorEntry]) -> Iterator[Problem]:
    """Every entry naming one object implies the same byte size (the object has one size)."""
    sizes: dict[str, tuple[int, str]] = {}
    for e in entries:
        named = [
            (oid, n) for _, p, d in tensor_payloads(e) for oid, _box, n in payload_blocks(p, d, e.shape)
        ]  # blocks too
        for oid, n in named:
            first = sizes.setdefault(oid, (n, e.name))
            if first[0] != n:
                yield Problem(
                    TensorMismatch(
                        f"commit {cid}, tensor {e.name!r}: object {oid} is named with {n} bytes here and with {first[0]} bytes "
                        f"by tensor {first[1]!r}; an object has one size (SPEC.md §Verification)"
                    ),
                    cid, oid, e.name,
                )  # fmt: skip


def read_commit(store: Store, cid: str, found: list[Problem] | None, *, named: str = "") -> LoadedCommit | None:
    """Read commit ``cid`` and its shard manifests, checking each structurally.

    With ``found`` None, the first problem is raised (``load_commit``); otherwise every
    problem is appended to ``found`` and None returned when the commit cannot be read as a
    whole (``verify``). ``named`` says which refs or target name the commit, for messages.
    """

    def report(problems: Iterable[Problem]) -> bool:
        problems = list(problems)
        if found is None and problems:
            raise problems[0].error
        if found is not None:
            found.extend(problems)
        return bool(problems)

    try:
        commit = store.commit(cid)
    except ShardstoreError as e:
        report([Problem(type(e)(f"commit {cid}{named}: {e}"), cid, cid)])
        return None
    if report(repeated_shards(commit, cid)):
        return None
    shards: dict[int, ShardManifest] = {}
    ids: dict[int, str] = {}
    for lay in commit.layout:
        try:
            shard = store.shard(lay.shard)
        except ShardstoreError as e:
            report(
                [Problem(type(e)(f"commit {cid}, slot {lay.slot}, shard manifest {lay.shard}: {e}"), cid, lay.shard)]
            )
            continue
        shards[lay.slot] = shard
        ids[lay.slot] = lay.shard
        report(shard_problems(shard, lay.shard, cid))
    report(commit_problems(commit, cid, shards, ids))
    return LoadedCommit(cid, commit, shards, ids)


def load_commit(store: Store, target: str) -> LoadedCommit:
    """Resolve ``target``, read and structurally verify the commit and all its shard manifests.

    Raises the first problem found. Reads manifests only (never tensor payloads).
    """
    cid = store.resolve(target)
    lc = read_commit(store, cid, None, named=f" (named by {target!r})" if target != cid else "")
    assert lc is not None  # with found=None every problem raises
    return lc


def _is_commit(store: Store, oid: str) -> bool | None:
    """Whether object ``oid`` is a commit manifest (its bytes decode as one); None if it is absent."""
    size = store.object_size(oid)
    if size is None:
        return None
    if size > MAX_MANIFEST_BYTES:
        return False  # no reader accepts a manifest this large
    try:
        raw = store.get(oid, verify=False, limit=MAX_MANIFEST_BYTES)  # a rotted commit still names its closure
    except ObjectNotFound:
        return None
    try:
        decode_manifest(raw, CommitManifest, what=f"object {oid}")
    except ShardstoreError:
        return False  # a job file, a tokenizer, tensor bytes: kept as the object it is
    return True


def pinned_commits(
    store: Store, pins: Mapping[str, Iterable[str]], known: dict[str, bool] | None = None, *, threads: int = 4
) -> dict[str, list[str]]:
    """The commits among the objects ``pins`` (pin name → object ids) name, each with the
    names of the pins naming it: a pinned commit keeps its whole closure, as one a ref names
    does (SPEC.md §14.1), so gc walks it and ``verify`` checks it.

    An object is a commit if it is present, at most ``MAX_MANIFEST_BYTES`` and decodes as a
    commit manifest (every other pinned object is read once, bounded; an absent one is left
    out: there is nothing of it to keep or check). ``known`` caches that verdict by object
    id across calls (an object's bytes never change)."""
    names: dict[str, list[str]] = {}
    for name in sorted(pins):
        for oid in pins[name]:
            names.setdefault(oid, []).append(name)
    cache: dict[str, bool] = {} if known is None else known
    fresh = [oid for oid in sorted(names) if oid not in cache]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:  # a GET each on S3; at most threads × 64 MiB held
        for oid, verdict in zip(fresh, pool.map(lambda o: _is_commit(store, o), fresh)):
            if verdict is not None:
                cache[oid] = verdict
    return {oid: names[oid] for oid in sorted(names) if cache.get(oid, False)}
