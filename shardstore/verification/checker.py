"""Verification: every rule a commit and its shards must satisfy (SPEC.md §Verification).

Rules are written once, as generators of ``Problem`` values, and used two ways:
``verify`` collects every problem (the CLI's ``verify``), and ``load_commit`` raises the
first one before any tensor is returned (every load path). A problem carries a typed
error whose message names the commit, the object and the tensor concerned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import (
    ShardstoreError,
    TensorMismatch,
)
from ..store import Store
from .commits import Problem, read_commit
from .objects import Checked, Job, check_objects, content_problem, object_jobs, tree_problem

__all__ = ["Report", "verify"]


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


def _check_pins(
    store: Store,
    report: Report,
    deep: bool,
    threads: int,
    seen: dict[str, Checked],
    progress: Callable[[int], None] | None,
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
                seen[oid] = Checked(None, None, 0)
                jobs.append(Job(oid, None, None, f"object pinned by {name!r}", None))
    for job, found in zip(jobs, check_objects(store, jobs, deep, threads)):
        report.objects_checked += 1
        report.bytes_hashed += found.hashed
        if progress is not None:
            progress(found.hashed)
        if found.error is not None:
            report.problems.append(
                Problem(type(found.error)(f"{job.what}: object {job.oid}: {found.error}"), None, job.oid)
            )


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
        refs = "".join(f", named by ref {r!r}" for r in named_by.get(cid, []))
        lc = read_commit(store, cid, report.problems, named=refs)
        if lc is None:
            continue
        if follow_parents and lc.commit.parent is not None and store.has(lc.commit.parent):
            todo.append(lc.commit.parent)
        for lay in lc.commit.layout:  # each shard manifest counted once, read or not
            if lay.shard not in seen_objects:
                report.objects_checked += 1
                seen_objects.add(lay.shard)
        jobs = list(object_jobs(lc, slot))
        fresh: dict[str, Job] = {}
        for j in jobs:
            if j.oid not in checked and j.oid not in fresh:
                fresh[j.oid] = j
        for oid, result in zip(fresh, check_objects(store, list(fresh.values()), deep, threads)):
            checked[oid] = result
            report.objects_checked += 1
            report.bytes_hashed += result.hashed
            if progress is not None:
                progress(result.hashed)
        for oid, size, tensor, what, rule in jobs:
            # an object's own problem once, where it is first seen; every entry's rules always
            own, have, _ = checked[oid]
            if own is not None:
                err: ShardstoreError | None = own if fresh.pop(oid, None) is not None else None
            elif size is not None and have != size:
                err = TensorMismatch(f"holds {have} bytes, entry needs {size}")
            elif rule is not None and (oid, rule) not in contents:
                contents.add((oid, rule))
                err = content_problem(store, oid, rule, have)
            else:
                err = None
            if err is not None:
                t = f", tensor {tensor!r}" if tensor else ""
                report.problems.append(
                    Problem(type(err)(f"commit {cid}{t}: {what} object {oid}: {err}"), cid, oid, tensor)
                )
        if slot is None and (err := tree_problem(store, lc)) is not None:
            report.problems.append(Problem(type(err)(f"commit {cid}: {err}"), cid, None))
    if targets is None:  # after the commits, so that their own checks of shared objects run first
        _check_pins(store, report, deep, threads, checked, progress)
    return report
