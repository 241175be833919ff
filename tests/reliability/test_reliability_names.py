"""Hostile names and ids, and symbolic links planted in a local store (issue 8, part 6).

Every parser (ref names, object ids, id prefixes, tensor and group names, storage keys)
and every entry point that takes a name (set_ref, ref, resolve, save with a hostile ref or
tensor name, copy_commit's ref, store URLs) refuses ``../``, absolute paths, backslashes,
NUL, percent-encoding, Unicode look-alikes, overlong names and dot segments with
``InvalidName`` (or ``TargetNotFound`` for a CLI-style target) before any path exists.

Symbolic links planted inside a store and pointing outside it — an object file, a ref,
the store config, and the directories ``objects/ab``, ``objects``, ``refs``, ``refs/runs``,
``tmp`` and ``journal`` — are refused, and nothing outside the root is read, written or
deleted: a sentinel directory outside is compared byte for byte afterwards.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import shardstore as ss
from shardstore.format.names import (
    check_group_name,
    check_key,
    check_oid,
    check_oid_prefix,
    check_ref_name,
    check_tensor_name,
)
from shardstore.ops.gc import gc

HOSTILE = [
    "../x",
    "../../etc/passwd",
    "/etc/passwd",
    "a/../../b",
    "a/./b",
    "a\\b",
    "..\\..\\x",
    "a\x00b",
    "%2e%2e/x",
    "%2e%2e%2fx",
    "ma\u0456n",
    "m\u0430in",
    "\uff0e\uff0e/x",
    "\u2024\u2024/x",
    ".",
    "..",
    "",
    " main",
    "main ",
    "a//b",
    "/",
    "a/",
    "x" * 600,
    "a/b/c/d/e",
    "main.lock",
    "C:\\x",
    "~root",
    "\nmain",
    "main\n",
    "a\tb",
]

TENSOR_OK = {"a/../../b", "a/./b", "a//b", "a/", "a/b/c/d/e", "main.lock"}


@pytest.mark.parametrize(
    "check", [check_ref_name, check_tensor_name, check_group_name, check_key, check_oid, check_oid_prefix]
)
def test_every_parser_refuses_every_hostile_name(check: Any) -> None:
    # valid by SPEC §Names: tensor names are never paths ('/' and '.' are plain characters in
    # them); a group name or key segment may end in '.lock' (only ref names may not); a key
    # has no depth limit
    allowed = {
        check_tensor_name: TENSOR_OK,
        check_group_name: {"main.lock"},
        check_key: {"a/b/c/d/e", "main.lock"},
    }.get(check, set())
    for name in HOSTILE:
        if name in allowed:
            continue
        with pytest.raises(ss.InvalidName):
            check(name)


def test_hostile_names_at_every_entry_point(tmp_path: Any) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    store = ss.open_store(str(tmp_path / "s"))
    cid = ss.save(store, {"w": torch.zeros(2)}, step=0, rng=False)
    for name in HOSTILE:
        with pytest.raises(ss.InvalidName):
            store.set_ref(name, cid, expected=None)
        with pytest.raises(ss.InvalidName):
            store.ref(name)
        with pytest.raises((ss.InvalidName, ss.TargetNotFound)):
            store.resolve(name)
        with pytest.raises(ss.InvalidName):
            ss.save(store, {"w": torch.zeros(2)}, step=0, rng=False, ref=name)
        if name not in TENSOR_OK:
            with pytest.raises(ss.InvalidName):
                ss.save(store, {name: torch.zeros(2)}, step=0, rng=False, ref=None)
        with pytest.raises(ss.InvalidName):
            ss.copy_commit(store, ss.open_store(str(tmp_path / "d")), cid, ref=name)
        with pytest.raises((ss.InvalidName, ValueError)):
            store.get(name)
    assert store.ref_names() == ["main"] and os.listdir(outside) == []
    assert sorted(os.listdir(tmp_path / "s")) == [
        "config",
        "intents",
        "journal",
        "objects",
        "refs",
        "tmp",
    ]  # intents: the gc fence


def _tree(path: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, path)] = open(p, "rb").read()
    return out


def _world(tmp_path: Any) -> tuple[ss.Store, str, str]:
    root = str(tmp_path / "s")
    store = ss.open_store(root)
    cid = ss.save(store, {"w": torch.arange(4.0)}, step=0, rng=False)
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    return store, cid, outside


def _use_store(root: str, cid: str) -> list[str]:
    """Exercise every operation; return the type names of the errors seen (all must be typed)."""
    seen = []
    ops = [
        lambda s: s.ref("main"),
        lambda s: s.ref_names(),
        lambda s: ss.verify(s),
        lambda s: ss.restore(s, cid, {"w": torch.zeros(4)}),
        lambda s: ss.save(s, {"w": torch.arange(4.0) + 1}, step=1, rng=False),
        lambda s: ss.save(s, {"w": torch.arange(4.0) + 2}, step=1, rng=False, ref="runs/x"),
        lambda s: s.put(b"fresh object bytes"),
        lambda s: gc(s, grace_seconds=0, dry_run=False),
    ]
    for op in ops:
        try:
            op(ss.open_store(root, create=False))
        except ss.ShardstoreError as e:
            seen.append(type(e).__name__)
    return seen


@pytest.mark.parametrize(
    "where", ["object", "objects/ab", "objects", "refs/main", "refs", "refs/runs", "config", "tmp", "journal"]
)
def test_symlink_planted_inside_the_store_is_never_followed(tmp_path: Any, where: str) -> None:
    store, cid, outside = _world(tmp_path)
    root = store.storage.root  # type: ignore[attr-defined]
    # the outside holds what a follower would find: the same bytes, so only a path check can refuse
    target = os.path.join(outside, "target")
    if where == "object":
        oid = cid
        os.makedirs(target)
        real = os.path.join(root, "objects", oid[:2], oid)
        with open(os.path.join(target, oid), "wb") as f:
            f.write(open(real, "rb").read())
        os.unlink(real)
        os.symlink(os.path.join(target, oid), real)
    elif where in ("refs/main", "config"):
        real = os.path.join(root, *where.split("/"))
        with open(target, "wb") as f:
            f.write(open(real, "rb").read())
        os.unlink(real)
        os.symlink(target, real)
    else:
        if where == "objects/ab":
            where = f"objects/{cid[:2]}"
        if where == "refs/runs":
            os.makedirs(os.path.join(root, "refs", "runs"))
        real = os.path.join(root, *where.split("/"))
        os.rename(real, target)  # the real contents now live outside, behind the link
        os.symlink(target, real)
    before = _tree(outside)
    errors = _use_store(root, cid)
    assert _tree(outside) == before, f"something outside the store changed through {where}"
    if where == "journal":  # the journal is advisory (issue 12, item 15): the link is refused silently, saves succeed
        assert errors == [] and not os.path.exists(os.path.join(target, f"{ss.open_store(root).ref('main')}.json"))
        return
    assert errors, f"a symlink at {where} went unnoticed"
    assert "InvalidName" in errors or "StoreConfigError" in errors or "ObjectNotFound" in errors, errors
