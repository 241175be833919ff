"""Git's ancestry suffixes on a target (SPEC.md §Refs; issue 35, item 7): ``main~1``, ``main^``,
``<commit>^``, ``main~2^``. ``shardstore diff STORE main~1 main`` is what a git user types first;
it was TargetNotFound. And the command line's ``--slot K`` (the API's and SPEC's word), with
``--shard K`` kept as its alias.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import shardstore as ss
from shardstore.format.names import split_revision
from shardstore_cli.shardstore_cli import main


@pytest.fixture
def chain(tmp_path: Any) -> tuple[ss.Store, list[str]]:
    """Three commits on ref main (steps 1, 2, 3; each changes one weight)."""
    store = ss.open_store(str(tmp_path / "store"))
    weights = {"w": torch.zeros(4), "b": torch.ones(2)}
    ids = []
    for step in (1, 2, 3):
        weights["w"] = weights["w"] + step
        ids.append(ss.save(store, weights, step=step, rng=False))
    return store, ids


@pytest.mark.parametrize(
    ("target", "want"),
    [
        ("main", ("main", 0)),
        ("main~", ("main", 1)),
        ("main~1", ("main", 1)),
        ("main~2", ("main", 2)),
        ("main^", ("main", 1)),
        ("main^1", ("main", 1)),
        ("main^^", ("main", 2)),
        ("main~1^", ("main", 2)),
        ("main^0", ("main", 0)),
        ("runs/a~10", ("runs/a", 10)),
        ("~1", ("~1", 0)),  # no base: not a revision, and no ref either
    ],
)
def test_split_revision(target: str, want: tuple[str, int]) -> None:
    assert split_revision(target) == want


def test_suffixes_walk_parent_links(chain: tuple[ss.Store, list[str]]) -> None:
    store, (c1, c2, c3) = chain
    assert store.resolve("main") == c3
    assert store.resolve("main~1") == store.resolve("main^") == store.resolve("main~") == c2
    assert store.resolve("main~2") == store.resolve("main^^") == store.resolve("main~1^") == c1
    assert store.resolve("main^0") == store.resolve("main~0") == c3
    assert store.resolve(f"{c3}^") == store.resolve(f"{c3[:12]}~1") == c2
    assert ss.load_commit(store, "main~2").commit.step == 1


@pytest.mark.parametrize("target", ["main~3", "main^^^", "main~2^", "main~99999999999999999999"])
def test_a_history_too_short_is_target_not_found(chain: tuple[ss.Store, list[str]], target: str) -> None:
    store, (c1, _, _) = chain
    with pytest.raises(ss.TargetNotFound, match=rf"history of 'main' is 3 commits long \(commit {c1} has no parent\)"):
        store.resolve(target)


def test_a_second_parent_names_nothing(chain: tuple[ss.Store, list[str]]) -> None:
    store, _ = chain
    with pytest.raises(ss.TargetNotFound, match=r"at most one parent, so \^2"):
        store.resolve("main^2")
    with pytest.raises(ss.TargetNotFound):
        store.resolve("nosuchref~1")


def test_a_parent_missing_from_the_store_is_target_not_found(tmp_path: Any, chain: tuple[ss.Store, list[str]]) -> None:
    store, (_, c2, c3) = chain
    partial = ss.open_store(str(tmp_path / "partial"))
    ss.copy_commit(store, partial, c3, ref="main")  # the commit alone: its parent stays behind
    assert not partial.has(c2)
    with pytest.raises(ss.TargetNotFound, match=f"names commit {c2}, which is not in"):
        partial.resolve("main~1")


def test_cli_diff_log_show_take_suffixes(chain: tuple[ss.Store, list[str]], capsys: Any) -> None:
    store, (c1, c2, c3) = chain
    assert main(["diff", store.url, "main~1", "main", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["a"], doc["b"]) == (c2, c3) and [t["name"] for t in doc["tensors"]] == ["w"]
    assert main(["log", store.url, "main^", "--json"]) == 0
    assert [c["id"] for c in json.loads(capsys.readouterr().out)["commits"]] == [c2, c1]
    assert main(["show", store.url, "main~2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == c1
    assert main(["diff", store.url, "main~3", "main"]) == 4  # not found
    assert "TargetNotFound" in capsys.readouterr().err


def test_slot_is_the_option_and_shard_its_alias(chain: tuple[ss.Store, list[str]], tmp_path: Any, capsys: Any) -> None:
    store, (_, _, c3) = chain
    for spelling in ("--slot", "--shard"):
        assert main(["verify", store.url, spelling, "0", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["slot"] == 0
        assert main(["verify", store.url, spelling, "1"]) == 4  # a one-slot commit has no slot 1
        assert main(["verify", store.url, spelling, "-1"]) == 2
        assert "--slot must be a slot number >= 0" in capsys.readouterr().err
        dst = tmp_path / f"copy{spelling}"
        assert main(["copy", store.url, str(dst), "main", spelling, "0", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["slot"] == 0 and ss.open_store(str(dst)).has(c3)
    from shardstore_cli.shardstore_cli import build_parser

    assert "--slot K, --shard K" in build_parser().parse_args(["verify", store.url]).parser.format_help()
