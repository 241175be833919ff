"""Garbage collection: nothing reachable and nothing young is ever deleted.

The central test pauses a save between writing its objects and moving the ref (it calls
``write_shard`` and ``write_commit`` itself): gc with a grace period deletes none of the
save's objects, and after the ref moves the store verifies clean. Without grace, after a
ref is deleted, gc removes exactly the objects only that ref's commit introduced, and a
second run deletes nothing. Also: dry runs, a young manifest protecting an old object it
deduplicated against, refusing to run when a ref's commit is unreadable, stale tmp files,
and the same on S3.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
import torch
from faults import forge_ref

import shardstore as ss
from shardstore import ObjectNotFound
from shardstore.ops.gc import gc, reachable
from shardstore.ops.transfer import commit_closure
from shardstore.store import object_key

try:
    from tests.s3_server import S3Server, s3_server  # noqa: F401  (fixture)
except ImportError:  # pragma: no cover
    from s3_server import S3Server, s3_server  # type: ignore[no-redef]  # noqa: F401

HOUR = 3600.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def age_everything(store: ss.Store, seconds: float) -> None:
    """Make every object on a local store look ``seconds`` old."""
    past = time.time() - seconds
    for oid in store.objects():
        os.utime(os.path.join(store.url, object_key(oid)), (past, past), follow_symlinks=False)


def test_paused_save_is_safe_then_verifies_clean(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    model, opt = model_and_opt(0)
    first = ss.save(store, model, opt, step=1, rng=False)
    age_everything(store, 2 * HOUR)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    # the save, paused after its objects and manifests and before its ref moves
    info = ss.CommitInfo(step=1)
    sid = ss.write_shard(store, ss.capture(model, opt, rng=False), info=info, parent=first, slot=0, slots=1)
    pending = ss.write_commit(store, [sid], info=info, parent=first)
    in_flight = commit_closure(ss.load_commit(store, pending)).ids()
    assert not in_flight <= commit_closure(ss.load_commit(store, first)).ids()

    result = gc(store, grace_seconds=HOUR, dry_run=False)
    assert result.deleted == {}
    assert all(store.has(o) for o in in_flight)
    assert set(result.kept_young) == in_flight - commit_closure(ss.load_commit(store, first)).ids()

    store.set_ref("main", pending, expected=first)
    report = ss.verify(store)
    assert report.ok, [str(p) for p in report.problems]
    assert gc(store, grace_seconds=0, dry_run=False).deleted == {}  # `first` is still reachable as the parent


def test_without_grace_deletes_exactly_the_unreachable(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    ss.save(store, *model_and_opt(1), step=1, rng=False)
    before = set(store.objects())
    ss.save(store, *model_and_opt(2), step=1, rng=False, ref="experiment")
    introduced = set(store.objects()) - before
    sizes = {o: store.object_size(o) for o in introduced}

    dry = gc(store, grace_seconds=0, dry_run=True)
    assert dry.deleted == {} and set(store.objects()) == before | introduced  # nothing reachable yet
    store.delete_ref("experiment", expected=store.ref("experiment") or "")

    dry = gc(store, grace_seconds=0, dry_run=True)
    assert dry.deleted == sizes and set(store.objects()) == before | introduced  # a dry run deletes nothing
    done = gc(store, grace_seconds=0, dry_run=False)
    assert done.deleted == sizes and done.bytes_freed == sum(sizes.values())
    assert set(store.objects()) == before
    assert ss.verify(store).ok
    again = gc(store, grace_seconds=0, dry_run=False)
    assert again.deleted == {} and again.kept_young == []


def test_grace_keeps_young_garbage_and_deletes_old(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    ss.save(store, *model_and_opt(3), step=1, rng=False)
    old = store.put(b"old garbage")
    age_everything(store, 2 * HOUR)
    young = store.put(b"young garbage")
    result = gc(store, grace_seconds=HOUR, dry_run=False)
    assert list(result.deleted) == [old] and result.kept_young == [young]
    assert store.has(young) and not store.has(old)


@pytest.mark.parametrize("grace", [float("nan"), -1.0])
def test_a_grace_period_that_is_no_duration_is_refused_before_anything(tmp_path: Any, grace: float) -> None:
    # NaN passed the `< 0` check and then compared as no grace at all: a save in progress
    # (written, no ref yet) was deleted, without the warning `--grace 0` gives.
    store = ss.open_store(str(tmp_path / "s"))
    young = store.put(b"a save in progress")
    with pytest.raises(ValueError, match="grace_seconds"):
        gc(store, grace_seconds=grace, dry_run=False)
    assert store.has(young) and list(store.storage.list("gc")) == []


def test_young_manifest_protects_old_object_it_deduplicated(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    model, opt = model_and_opt(4)
    orphan = ss.save(store, model, opt, step=1, rng=False, ref="old")
    store.delete_ref("old", expected=orphan)
    age_everything(store, 2 * HOUR)  # all of it old and unreachable
    # a new save of the same state writes no tensor bytes (they exist) and pauses before its ref
    info = ss.CommitInfo(step=1, job="again")
    sid = ss.write_shard(store, ss.capture(model, opt, rng=False), info=info, parent=None, slot=0, slots=1)
    shard = store.shard(sid)
    needed = {e.param for e in shard.entries}
    result = gc(store, grace_seconds=HOUR, dry_run=False)
    # kept as young (the save refreshed them when it found them present) or as named by its young manifest
    assert needed <= set(result.kept_named_by_young) | set(result.kept_young) and all(store.has(o) for o in needed)
    assert orphan in result.deleted  # the old commit manifest itself was garbage
    cid = ss.write_commit(store, [sid], info=info, parent=None)
    store.set_ref("main", cid, expected=None)
    assert ss.verify(store).ok


def test_refuses_when_a_ref_names_a_missing_commit(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    ss.save(store, *model_and_opt(5), step=1, rng=False)
    garbage = store.put(b"garbage")
    age_everything(store, 2 * HOUR)
    with pytest.raises(ss.GcRace, match="never written"):  # the fence refuses a ref to a missing commit
        store.set_ref("broken", "f" * 64, expected=None)
    forge_ref(store, "broken", "f" * 64)
    with pytest.raises(ObjectNotFound, match="gc refused"):
        gc(store, grace_seconds=0, dry_run=False)
    assert store.has(garbage)


def test_stale_tmp_files_are_removed(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    tmp = tmp_path / "s" / "tmp"
    tmp.mkdir(exist_ok=True)
    (tmp / "stale").write_bytes(b"x")
    (tmp / "fresh").write_bytes(b"y")
    past = time.time() - 2 * HOUR
    os.utime(tmp / "stale", (past, past))
    result = gc(store, grace_seconds=HOUR, dry_run=False)
    assert result.tmp_deleted == ["tmp/stale"]
    assert sorted(p.name for p in tmp.iterdir()) == ["fresh"]


def test_reachable_follows_present_parents(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    model, opt = model_and_opt(6)
    a = ss.save(store, model, opt, step=1, rng=False)
    with torch.no_grad():
        model[0].weight.add_(1)
    b = ss.save(store, model, opt, step=1, rng=False)
    objects, commits = reachable(store)
    assert commits == [b, a] and a in objects


def test_gc_on_memory_and_s3(s3_server: S3Server) -> None:  # noqa: F811
    for store in (
        ss.open_store(f"memory://gc-{uuid.uuid4().hex}"),
        ss.open_store(s3_server.url(), **s3_server.options),
    ):
        ss.save(store, *model_and_opt(7), step=1, rng=False)
        before = set(store.objects())
        cid = ss.save(store, *model_and_opt(8), step=1, rng=False, ref="tmpref")
        store.delete_ref("tmpref", expected=cid)
        assert gc(store, grace_seconds=HOUR, dry_run=False).deleted == {}  # all young
        result = gc(store, grace_seconds=0, dry_run=False)
        assert set(store.objects()) == before and cid in result.deleted
        assert gc(store, grace_seconds=0, dry_run=False).deleted == {}
        assert ss.verify(store).ok


def run_cli(argv: list[str]) -> int:
    """In this process, through the command line's ``main`` (which maps errors to exit codes)."""
    from shardstore_cli.shardstore_cli import main

    return main(argv)


def test_parse_duration() -> None:
    from shardstore_cli.store_commands import parse_duration

    assert [parse_duration(x) for x in ("90s", "30m", "1h", "2d", "1h30m", "45", "0s", "1.5h")] == [
        90,
        1800,
        3600,
        172800,
        5400,
        45,
        0,
        5400,
    ]
    for bad in ("", "1x", "h", "-1h", "1h 30m", "1hh"):
        with pytest.raises(argparse.ArgumentTypeError, match="invalid duration"):
            parse_duration(bad)


def test_cli_gc_handler(tmp_path: Any, capsys: Any) -> None:
    path = str(tmp_path / "s")
    store = ss.open_store(path)
    ss.save(store, *model_and_opt(9), step=1, rng=False)
    garbage = store.put(b"garbage")
    assert run_cli(["gc", path, "--dry-run", "--grace", "0s", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dry_run"] and [d["object"] for d in doc["deleted"]] == [garbage] and store.has(garbage)
    assert run_cli(["gc", path]) == 0  # default grace 1h: the garbage is young
    out = capsys.readouterr().out
    assert "deleted 0 unreachable objects" in out and "younger than 3600s" in out and store.has(garbage)
    assert run_cli(["gc", path, "--grace", "0"]) == 0
    assert f"deleted  {garbage}" in capsys.readouterr().out and not store.has(garbage)
    assert run_cli(["gc", str(tmp_path / "not-a-store")]) == 1
    assert "StoreConfigError" in capsys.readouterr().err
    assert run_cli(["gc", path, "--grace", "soon"]) == 2


def test_cli_gc_through_main_cli(tmp_path: Any) -> None:
    path = str(tmp_path / "s")
    store = ss.open_store(path)
    ss.save(store, *model_and_opt(10), step=1, rng=False)
    garbage = store.put(b"garbage")
    cmd = [sys.executable, "-m", "shardstore_cli.shardstore_cli", "gc", path, "--grace", "0s", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert [d["object"] for d in json.loads(done.stdout)["deleted"]] == [garbage] and not store.has(garbage)
    bad = subprocess.run(cmd[:-3] + ["--grace", "soon"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "invalid duration" in bad.stderr


@pytest.mark.parametrize("url", ["local", "memory"])
def test_pins_keep_objects_no_commit_names(tmp_path: Any, url: str) -> None:
    store = ss.open_store(str(tmp_path / "s") if url == "local" else f"memory://pins-{uuid.uuid4().hex}")
    kept, other, loose = store.put(b"job file"), store.put(b"tokenizer"), store.put(b"unpinned")
    assert store.pin_names() == [] and store.pins() == {}
    store.pin("jobs/abc", [other, kept, kept], expected=None)  # any order, repeats collapse
    assert store.pinned("jobs/abc") == tuple(sorted({kept, other}))
    assert store.pinned("nope") is None
    cid = ss.save(store, {"w": torch.ones(3)}, step=0, rng=False)
    result = gc(store, grace_seconds=0, dry_run=False)
    assert set(result.deleted) == {loose} and result.pinned_objects == 2
    assert store.has(kept) and store.has(other) and store.ref("main") == cid
    report = ss.verify(store)
    assert report.ok and report.objects_checked >= 2
    # a pinned object that went missing or rotted is reported by name
    store.storage.delete(object_key(other))
    problems = ss.verify(store).problems
    assert [p.kind for p in problems] == ["ObjectNotFound"] and "pinned by 'jobs/abc'" in str(problems[0])
    store.unpin("jobs/abc")
    assert gc(store, grace_seconds=0, dry_run=False).deleted.keys() == {kept}
    with pytest.raises(ss.RefNotFound):
        store.unpin("jobs/abc")


def test_pins_refuse_bad_names_ids_and_content(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    oid = store.put(b"x")
    with pytest.raises(ss.InvalidName):
        store.pin("../escape", [oid], expected=None)
    with pytest.raises(ss.InvalidName):
        store.pin("jobs/x", ["not-an-id"], expected=None)
    store.pin("jobs/x", [oid], expected=None)
    # hand-written pins that break the encoding rules: unsorted, repeated, not canonical
    bad = {
        "unsorted": {"objects": ["f" * 64, "0" * 64], "type": "pin", "version": 1},
        "repeated": {"objects": ["0" * 64, "0" * 64], "type": "pin", "version": 1},
        "version": {"objects": [], "type": "pin", "version": 2},
    }
    for name, doc in bad.items():
        path = tmp_path / "s" / "pins" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())
        with pytest.raises(ss.ManifestError, match=name if name != "version" else "version"):
            store.pinned(name)
        with pytest.raises(ss.ManifestError, match="gc refused: a pin is unreadable"):
            gc(store, grace_seconds=0, dry_run=True)
        report = ss.verify(store)
        assert not report.ok and any(f"pin {name!r}" in str(p) for p in report.problems)
        path.unlink()
    assert store.has(oid)  # no refused gc deleted anything
    assert gc(store, grace_seconds=0, dry_run=False).deleted == {}


def test_a_pin_never_hides_a_commit_problem_and_never_exceeds_the_limits(tmp_path: Any, monkeypatch: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    cid = ss.save(store, {"w": torch.ones(3)}, step=0, rng=False)
    param = store.shard(store.commit(cid).layout[0].shard).entries[0].param
    store.pin("keep", [param], expected=None)
    path = os.path.join(store.storage.root, object_key(param))
    os.chmod(path, 0o644)
    with open(path, "wb") as f:
        f.write(b"short")
    for deep in (False, True):  # the commit's own check of the object runs and names the commit
        problems = ss.verify(store, deep=deep).problems
        assert any(p.commit == cid and p.object == param for p in problems), (deep, problems)
    import shardstore.store.store as store_mod

    monkeypatch.setattr(store_mod, "MAX_ENTRIES", 2)
    ids = [store.put(bytes([i])) for i in range(3)]
    with pytest.raises(ss.ManifestError, match="exceed the limit"):
        store.pin("big", ids, expected=None)
    assert store.pinned("big") is None  # nothing unreadable was written


def seed_and_run(src: ss.Store) -> tuple[str, str]:
    """A seed commit pinned by ``references/default`` and a run two commits past it (ref main):
    what shardtrain leaves in a run's store. (seed id, head id)."""
    model, opt = model_and_opt(11)
    seed = ss.save(src, model, opt, step=1, rng=False, ref=None, parent=None)
    src.pin("references/default", [seed], expected=None)
    head = seed
    for step in (2, 3):
        with torch.no_grad():
            model[0].weight.add_(step)
        head = ss.save(src, model, opt, step=step, rng=False, ref="main", parent=head)
    return seed, head


def test_a_pinned_commit_keeps_its_closure_after_copy_with_deps(tmp_path: Any) -> None:
    """Issue 30, defect 2: a commit a pin names (copy --with-deps's references pin) keeps its
    whole closure, though no ref reaches it (the copied head's parent is absent)."""
    src, dst = ss.open_store(str(tmp_path / "src")), ss.open_store(str(tmp_path / "dst"))
    seed, head = seed_and_run(src)
    done = ss.copy_commit(src, dst, "main", ref="main", with_deps=True)
    assert done.dependencies == [seed] and not dst.has(src.commit(head).parent or "")
    seed_closure = commit_closure(ss.load_commit(dst, seed)).ids()
    age_everything(dst, 2 * HOUR)
    result = gc(dst, grace_seconds=HOUR, dry_run=False)
    assert result.deleted == {} and seed in result.commits
    assert all(dst.has(o) for o in seed_closure)
    assert ss.verify(dst, [seed]).ok and ss.verify(dst).ok


def test_a_pinned_commit_whose_closure_is_unreadable_stops_gc(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    seed, _ = seed_and_run(store)
    garbage = store.put(b"garbage")
    store.storage.delete(object_key(store.commit(seed).layout[0].shard))
    age_everything(store, 2 * HOUR)
    with pytest.raises(ObjectNotFound, match=rf"gc refused: commit {seed} \(pinned by 'references/default'\)"):
        gc(store, grace_seconds=0, dry_run=False)
    assert store.has(garbage)


def test_verify_reports_a_pinned_commit_whose_closure_is_incomplete(tmp_path: Any) -> None:
    """Issue 30, defect 2: ``verify STORE`` checks a commit a pin names as it checks one a ref
    names, so a dependency that lost an object is reported, not passed as a present pinned object."""
    store = ss.open_store(str(tmp_path / "s"))
    seed, head = seed_and_run(store)
    lost = min(
        set(commit_closure(ss.load_commit(store, seed)).data) - commit_closure(ss.load_commit(store, head)).ids()
    )
    store.storage.delete(object_key(lost))
    store.delete_ref("main", expected=head)  # only the pin names the seed now
    problems = ss.verify(store).problems
    assert [p.kind for p in problems] == ["ObjectNotFound"], problems
    assert problems[0].commit == seed and problems[0].object == lost
    assert f"commit {seed}" in str(problems[0]) and "pinned by 'references/default'" in str(problems[0])
