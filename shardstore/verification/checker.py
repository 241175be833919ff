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
from .commits import Problem, pinned_commits, read_commit
from .dcp import dcp_problems
from .objects import (
    Checked,
    ContentRule,
    ExpectedObject,
    check_objects,
    content_problem,
    expected_objects,
    tree_problem,
)

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
    commits: set[str],
) -> None:
    """Every pin parses and every object it names is present (and, deep, hashes to its id);
    ``commits``: the pinned commits already checked as commits (with their closures)."""
    expected: list[ExpectedObject] = []
    for name in store.pin_names():
        try:
            ids = store.pinned(name) or ()
        except ShardstoreError as e:
            report.problems.append(Problem(type(e)(f"pin {name!r}: {e}"), None, None))
            continue
        for oid in ids:
            if oid not in seen and oid not in commits:
                seen[oid] = Checked(None, None, 0)
                expected.append(ExpectedObject(oid, None, None, f"object pinned by {name!r}", None))
    for want, found in zip(expected, check_objects(store, expected, deep, threads)):
        report.objects_checked += 1
        report.bytes_hashed += found.hashed
        if progress is not None:
            progress(found.hashed)
        if found.error is not None:
            report.problems.append(
                Problem(type(found.error)(f"{want.what}: object {want.oid}: {found.error}"), None, want.oid)
            )


def _readable_pins(store: Store) -> dict[str, tuple[str, ...]]:
    """Every pin that parses (``_check_pins`` reports the others)."""
    out: dict[str, tuple[str, ...]] = {}
    for name in store.pin_names():
        try:
            out[name] = store.pinned(name) or ()
        except ShardstoreError:
            continue
    return out


def _pinned_label(p: Problem, pins: list[str]) -> Problem:
    """A problem of a commit that pins name and no ref does, saying which pins name it."""
    return Problem(type(p.error)(f"pinned by {', '.join(map(repr, pins))}: {p.error}"), p.commit, p.object, p.tensor)


def verify(
    store: Store,
    targets: Iterable[str] | None = None,
    *,
    deep: bool = True,
    slot: int | None = None,
    threads: int = 2,
    progress: Callable[[int], None] | None = None,
) -> Report:
    """Check commits (default: every commit a ref or pin names, with their present parents,
    and every other pinned object; SPEC.md §14.1, §17).

    ``deep`` re-hashes every object; otherwise only structure and sizes are checked.
    ``slot`` limits object checks to one slot's closure. Every problem is reported,
    including refs and pins that do not parse. ``progress`` is called with the byte count
    of each object checked (for progress bars).
    """
    report = Report()
    todo: list[str] = []
    named_by: dict[str, list[str]] = {}  # commit id -> the refs naming it, for messages
    pinned_by: dict[str, list[str]] = {}  # commit id -> the pins naming it
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
        pinned_by = pinned_commits(store, _readable_pins(store), threads=threads)
        todo += [cid for cid in pinned_by if cid not in named_by]  # a pinned commit keeps its closure (§14.1)
        follow_parents = True
    else:
        todo = [store.resolve(t) for t in targets]
        follow_parents = False
    seen_commits: set[str] = set()
    seen_objects: set[str] = set()  # shard manifests counted
    checked: dict[str, Checked] = {}  # object id -> what checking it found (each object read once)
    contents: set[tuple[str, ContentRule]] = set()  # (object id, content rule) already decoded
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
        expected = list(expected_objects(lc, slot))
        fresh: dict[str, ExpectedObject] = {}
        for j in expected:
            if j.oid not in checked and j.oid not in fresh:
                fresh[j.oid] = j
        for oid, result in zip(fresh, check_objects(store, list(fresh.values()), deep, threads)):
            checked[oid] = result
            report.objects_checked += 1
            report.bytes_hashed += result.hashed
            if progress is not None:
                progress(result.hashed)
        for oid, size, tensor, what, rule in expected:
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
        report.problems += dcp_problems(store, lc)  # a DCP commit's document against its entries (SPEC.md §9.4)
        if slot is None and (err := tree_problem(store, lc)) is not None:
            report.problems.append(Problem(type(err)(f"commit {cid}: {err}"), cid, None))
    only_pinned = {cid: pins for cid, pins in pinned_by.items() if cid not in named_by}
    report.problems = [
        _pinned_label(p, only_pinned[p.commit]) if p.commit in only_pinned else p for p in report.problems
    ]
    if targets is None:  # after the commits, so that their own checks of shared objects run first
        _check_pins(store, report, deep, threads, checked, progress, set(pinned_by))
    return report
