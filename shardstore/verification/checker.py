"""Verification: every rule a commit and its shards must satisfy (SPEC.md §Verification).

Rules are written once, as generators of ``Problem`` values, and used two ways:
``verify`` collects every problem (the CLI's ``verify``), and ``load_commit`` raises the
first one before any tensor is returned (every load path). A problem carries a typed
error whose message names the commit, the object and the tensor concerned.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import (
    BindingError,
    CorruptObject,
    CursorError,
    GridError,
    LayoutError,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    ShardstoreError,
    TensorMismatch,
)
from ..format.grid import grid_problems, payload_blocks
from ..format.manifest import MAX_MANIFEST_BYTES, CommitManifest, ShardManifest, TensorEntry, decode_config, tensor_payloads
from ..format.rng import MAX_RNG_BYTES, check_rng
from ..format.roots import learned_root
from ..format.slices import commit_slice_problems, entry_objects, shard_slice_problems, slot_needs
from ..state.extras import extra_objects, extras_rules, read_extra_state
from ..store import Store
from .rules import commit_rules, shard_rules, state_problems

__all__ = ["Problem", "Report", "LoadedCommit", "shard_problems", "commit_problems", "load_commit", "verify"]


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
class Report:
    """What ``verify`` found: problems, and how much it checked."""

    commits: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    objects_checked: int = 0
    bytes_hashed: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


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


def _sorted_unique(names: list[str]) -> bool:
    return all(a < b for a, b in zip(names, names[1:]))


def shard_problems(shard: ShardManifest, sid: str, commit_id: str | None = None) -> Iterator[Problem]:
    """Rules a shard manifest must satisfy on its own."""

    def p(err: type[ShardstoreError], msg: str, tensor: str | None = None) -> Problem:
        where = f"shard manifest {sid}" + (f" of commit {commit_id}" if commit_id else "")
        t = f", tensor {tensor!r}" if tensor else ""
        return Problem(err(f"{where}{t}: {msg}"), commit_id, sid, tensor)

    if shard.slot >= shard.slots:
        yield p(LayoutError, f"slot {shard.slot} is not below slot count {shard.slots}")
    names = [e.name for e in shard.entries]
    if not _sorted_unique(names):
        yield p(ManifestError, "tensor entries are not sorted by name and unique (SPEC.md §Shard manifest)")
    gnames = [g.name for g in shard.groups]
    if not _sorted_unique(gnames):
        yield p(ManifestError, "optimizer groups are not sorted by name and unique")
    kinds = [r.kind for r in shard.rng]
    if not _sorted_unique(kinds):
        yield p(ManifestError, "RNG entries are not sorted by kind and unique")
    if shard.algorithm == "none" and shard.groups:
        yield p(ManifestError, "algorithm 'none' with optimizer groups")
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
    for e in shard.entries:
        for role, payload, dtype in tensor_payloads(e):
            for msg in grid_problems(payload, dtype, e.shape):
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


def commit_problems(commit: CommitManifest, cid: str, shards: dict[int, ShardManifest], shard_ids: dict[int, str]) -> Iterator[Problem]:
    """Rules binding a commit to its shard manifests, and the learned-state root."""

    def p(err: type[ShardstoreError], msg: str, obj: str | None = None, tensor: str | None = None) -> Problem:
        t = f", tensor {tensor!r}" if tensor else ""
        o = f", shard manifest {obj}" if obj and obj != cid else ""
        return Problem(err(f"commit {cid}{o}{t}: {msg}"), cid, obj or cid, tensor)

    versions = {s.version for s in shards.values()}
    if len(shards) == len(commit.layout) and versions and commit.version != max(versions):
        yield p(ManifestError, f"commit has version {commit.version} but its shard manifests need version {max(versions)} (SPEC.md §Versioning)")
    slots = [lay.slot for lay in commit.layout]
    if slots != list(range(len(slots))):
        yield p(LayoutError, f"layout slots {slots} are not exactly 0..{len(slots) - 1} in order (SPEC.md §Commit manifest)")
    gnames = [g.name for g in commit.optimizer.groups]
    if not _sorted_unique(gnames):
        yield p(ManifestError, "optimizer groups are not sorted by name and unique")
    groups = {g.name: g for g in commit.optimizer.groups}
    for err, msg, obj in commit_rules(commit, shards):  # the torch form and extras (SPEC.md §9a, §9c)
        yield p(err, msg, obj)
    owners: dict[str, int] = {}
    for lay in commit.layout:
        if not _sorted_unique(list(lay.tensors)):
            yield p(ManifestError, f"slot {lay.slot}'s tensor list is not sorted and unique")
        for name in lay.tensors:
            if name in owners:
                yield p(LayoutError, f"owned twice, by slots {owners[name]} and {lay.slot} (SPEC.md §Layout)", tensor=name)
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
                yield p(BindingError, f"shard's {fieldname} is {have!r} but the commit's is {want!r} (SPEC.md §Binding)", sid)
        for g in shard.groups:
            if groups.get(g.name) != g:
                yield p(BindingError, f"group {g.name!r} differs from the commit's optimizer group of that name", sid)
            used_groups.add(g.name)
        names = [e.name for e in shard.entries]
        if names != list(lay.tensors):
            missing = sorted(set(lay.tensors) - set(names))
            extra = sorted(set(names) - set(lay.tensors))
            yield p(LayoutError, f"layout of slot {lay.slot} and its shard disagree: in layout only {missing[:5]}, in shard only {extra[:5]}", sid)
        all_entries.extend(shard.entries)
    if set(groups) - used_groups and len(shards) == len(commit.layout):
        yield p(ManifestError, f"optimizer groups {sorted(set(groups) - used_groups)} are used by no tensor")
    yield from _sizes_agree(cid, all_entries)
    if len(shards) == len(commit.layout):
        for msg, tensor, slot in commit_slice_problems(shards, {e.name: e for e in all_entries}):
            yield p(LayoutError, msg, shard_ids.get(slot), tensor)
        c = commit
        root = learned_root(step=c.step, data_cursor=c.data_cursor, config=c.config, optimizer=c.optimizer, entries=all_entries, extras=c.extras)
        if root != commit.learned_root:
            yield p(ManifestError, f"learned-state root is {commit.learned_root} but the shards give {root} (SPEC.md §Roots)")


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
        named = [(oid, n) for _, p, d in tensor_payloads(e) for oid, _box, n in payload_blocks(p, d, e.shape)]  # blocks too
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


def _raise_first(problems: Iterable[Problem]) -> None:
    for prob in problems:
        raise prob.error


def load_commit(store: Store, target: str) -> LoadedCommit:
    """Resolve ``target``, read and structurally verify the commit and all its shard manifests.

    Raises the first problem found. Reads manifests only (never tensor payloads).
    """
    cid = store.resolve(target)
    try:
        commit = store.commit(cid)
    except ShardstoreError as e:
        via = f" (named by {target!r})" if target != cid else ""
        raise type(e)(f"commit {cid}{via}: {e}") from None
    _raise_first(repeated_shards(commit, cid))
    shards: dict[int, ShardManifest] = {}
    ids: dict[int, str] = {}
    for lay in commit.layout:
        try:
            shard = store.shard(lay.shard)
        except ShardstoreError as e:
            raise type(e)(f"commit {cid}, slot {lay.slot}: {e}") from None
        _raise_first(shard_problems(shard, lay.shard, cid))
        shards[lay.slot] = shard
        ids[lay.slot] = lay.shard
    _raise_first(commit_problems(commit, cid, shards, ids))
    return LoadedCommit(cid, commit, shards, ids)


#: (object id, expected size or None, tensor name, what, content rule: None, "config", "rng:<kind>" or "extra:<tensors>")
Job = tuple[str, int | None, str | None, str, str | None]


def _object_jobs(lc: LoadedCommit, slot: int | None) -> Iterator[Job]:
    """One job for every object the commit references (an object named twice: two jobs)."""
    if lc.commit.config is not None:
        yield lc.commit.config, None, None, "model config", "config"
    for oid, size, what, rule in extra_objects(lc.commit.extras, ""):
        yield oid, size, None, what, rule
    needs = slot_needs(lc.shards, slot) if slot is not None else None  # the slot-K selection (SPEC.md §Slices held)
    for s, shard in sorted(lc.shards.items()):
        if slot is None or s == slot:
            for r in shard.rng:
                yield r.object, None, None, f"RNG state {r.kind} of slot {s}", f"rng:{r.kind}"
            for oid, size, what, rule in extra_objects(shard.extras, f" of slot {s}"):
                yield oid, size, None, what, rule
        for e in shard.entries:
            if needs is not None and e.name not in needs:
                continue
            for oid, n, what in entry_objects(e, needs[e.name] if needs is not None else None):
                yield oid, n, e.name, what, None


#: What checking one object found: (error or None, its actual size or None, bytes hashed).
Checked = tuple[ShardstoreError | None, int | None, int]


def _check_objects(store: Store, jobs: list[Job], deep: bool, threads: int) -> list[Checked]:
    """``_check_object`` for each job, in the jobs' order, ``threads`` objects at a time.

    The largest objects start first, so that the pool does not end on one big object while
    the other threads idle. Each object is hashed by one thread, unless there are fewer
    objects than threads: then each gets its share of BLAKE3's own threads.
    """
    threads = max(1, threads)
    each = max(1, threads // len(jobs)) if jobs else 1
    order = sorted(range(len(jobs)), key=lambda i: -(jobs[i][1] or 0))
    results: list[Checked] = [(None, None, 0)] * len(jobs)

    def one(i: int) -> None:
        results[i] = _check_object(store, jobs[i][0], deep, each)

    if threads == 1 or len(jobs) <= 1:
        for i in order:
            one(i)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(one, order))
    return results


def _check_object(store: Store, oid: str, deep: bool, threads: int = 1) -> Checked:
    """Presence and (deep) hash of one object, and its actual size; the size rules of the
    entries naming it are checked by the caller, every entry against the same object."""
    try:
        if deep:
            got, n = store.hash_object(oid, threads=threads)  # streamed, never a full copy
            if got != oid:
                return CorruptObject(f"its {n} bytes hash to {got}"), n, n
            return None, n, n
        have = store.object_size(oid)
        if have is None:
            return ObjectNotFound("missing from the store"), None, 0
        return None, have, 0
    except ObjectNotFound:
        return ObjectNotFound("missing from the store"), None, 0
    except ShardstoreError as e:
        return e, None, 0


def _content_problem(store: Store, oid: str, rule: str, have: int | None) -> ShardstoreError | None:
    """Decode a model config or RNG object as its load path will (bounded first): what a
    restore would refuse, verify reports (SPEC.md §17)."""
    limit = MAX_RNG_BYTES if rule.startswith("rng:") else MAX_MANIFEST_BYTES
    if have is not None and have > limit:
        return ObjectTooLarge(f"{have} bytes, over the {limit}-byte limit of its kind (SPEC.md §Limits)")
    try:
        if rule == "config":
            decode_config(store.get(oid, limit=MAX_MANIFEST_BYTES), what="model config")
        elif rule.startswith("extra:"):  # a state document, with placeholders for its tensors (SPEC.md §Extras)
            read_extra_state(store.get(oid, limit=MAX_MANIFEST_BYTES), [None] * int(rule[6:]), "state document")  # type: ignore[list-item]
        else:
            check_rng({rule[4:]: store.get(oid, limit=MAX_RNG_BYTES)}, raw_kinds=False)
    except ShardstoreError as e:
        return e
    return None


def _check_pins(
    store: Store, report: Report, deep: bool, threads: int, seen: dict[str, Checked], progress: Callable[[int], None] | None
) -> None:
    """Every pin parses and every object it names is present (and, deep, hashes to its id)."""
    jobs: list[Job] = []
    for name in store.pin_names():
        try:
            ids = store.pinned(name) or ()
        except ShardstoreError as e:
            report.problems.append(Problem(type(e)(f"pin {name!r}: {e}"), None, None))
            continue
        for oid in ids:
            if oid not in seen:
                seen[oid] = (None, None, 0)
                jobs.append((oid, None, None, f"object pinned by {name!r}", None))
    for (oid, _size, _tensor, what, _rule), (err, _have, n) in zip(jobs, _check_objects(store, jobs, deep, threads)):
        report.objects_checked += 1
        report.bytes_hashed += n
        if progress is not None:
            progress(n)
        if err is not None:
            report.problems.append(Problem(type(err)(f"{what}: object {oid}: {err}"), None, oid))


def verify(
    store: Store,
    targets: Iterable[str] | None = None,
    *,
    deep: bool = True,
    slot: int | None = None,
    threads: int = 2,
    progress: Callable[[int], None] | None = None,
) -> Report:
    """Check commits (default: every commit reachable from refs, with their present parents,
    and every pinned object).

    ``deep`` re-hashes every object; otherwise only structure and sizes are checked.
    ``slot`` limits object checks to one slot's closure. Every problem is reported,
    including refs and pins that do not parse. ``progress`` is called with the byte count
    of each object checked (for progress bars).
    """
    report = Report()
    todo: list[str] = []
    named_by: dict[str, list[str]] = {}  # commit id -> the refs naming it, for messages
    if targets is None:
        for name in store.ref_names():
            try:
                cid = store.ref(name)
            except ShardstoreError as e:
                report.problems.append(Problem(type(e)(f"ref {name!r}: {e}"), None, None))
                continue
            if cid is not None:
                todo.append(cid)
                named_by.setdefault(cid, []).append(name)
        follow_parents = True
    else:
        todo = [store.resolve(t) for t in targets]
        follow_parents = False
    seen_commits: set[str] = set()
    seen_objects: set[str] = set()  # shard manifests counted
    checked: dict[str, Checked] = {}  # object id -> what checking it found (each object read once)
    contents: set[tuple[str, str]] = set()  # (object id, content rule) already decoded
    while todo:
        cid = todo.pop(0)
        if cid in seen_commits:
            continue
        seen_commits.add(cid)
        report.commits.append(cid)
        report.objects_checked += 1
        try:
            commit = store.commit(cid)
        except ShardstoreError as e:
            refs = "".join(f", named by ref {r!r}" for r in named_by.get(cid, []))
            report.problems.append(Problem(type(e)(f"commit {cid}{refs}: {e}"), cid, cid))
            continue
        if follow_parents and commit.parent is not None and store.has(commit.parent):
            todo.append(commit.parent)
        repeated = list(repeated_shards(commit, cid))
        if repeated:
            report.problems.extend(repeated)
            continue
        shards: dict[int, ShardManifest] = {}
        ids: dict[int, str] = {}
        for lay in commit.layout:
            if lay.shard not in seen_objects:
                report.objects_checked += 1
                seen_objects.add(lay.shard)
            try:
                shard = store.shard(lay.shard)
            except ShardstoreError as e:
                report.problems.append(Problem(type(e)(f"commit {cid}, slot {lay.slot}, shard manifest {lay.shard}: {e}"), cid, lay.shard))
                continue
            shards[lay.slot] = shard
            ids[lay.slot] = lay.shard
            report.problems.extend(shard_problems(shard, lay.shard, cid))
        report.problems.extend(commit_problems(commit, cid, shards, ids))
        lc = LoadedCommit(cid, commit, shards, ids)
        jobs = list(_object_jobs(lc, slot))
        fresh: dict[str, Job] = {}
        for j in jobs:
            if j[0] not in checked and j[0] not in fresh:
                fresh[j[0]] = j
        for oid, result in zip(fresh, _check_objects(store, list(fresh.values()), deep, threads)):
            checked[oid] = result
            report.objects_checked += 1
            report.bytes_hashed += result[2]
            if progress is not None:
                progress(result[2])
        for oid, size, tensor, what, rule in jobs:
            # an object's own problem once, where it is first seen; every entry's rules always
            own, have, _ = checked[oid]
            if own is not None:
                err: ShardstoreError | None = own if fresh.pop(oid, None) is not None else None
            elif size is not None and have != size:
                err = TensorMismatch(f"holds {have} bytes, entry needs {size}")
            elif rule is not None and (oid, rule) not in contents:
                contents.add((oid, rule))
                err = _content_problem(store, oid, rule, have)
            else:
                err = None
            if err is not None:
                t = f", tensor {tensor!r}" if tensor else ""
                report.problems.append(Problem(type(err)(f"commit {cid}{t}: {what} object {oid}: {err}"), cid, oid, tensor))
    if targets is None:  # after the commits, so that their own checks of shared objects run first
        _check_pins(store, report, deep, threads, checked, progress)
    return report
