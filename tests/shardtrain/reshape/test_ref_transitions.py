"""Transitions on a ref (issue 25): ``shardtrain regroup/grow --commit REF`` move REF by
compare-and-swap, and warn when nothing names the commit they make (the ref locks themselves:
tests/shardstore/backends/test_ref_locks.py)."""

from __future__ import annotations

import json
from typing import Any

import shardstore as ss


def _llama_store(tmp_path: Any) -> tuple[ss.Store, str]:
    from shardtrain_helpers import tiny_config

    from shardtrain.engine.partition import Partition, build_stage

    config = tiny_config(layers=2)
    store = ss.open_store(str(tmp_path / "llama"))
    return store, ss.save(
        store, build_stage(config, Partition.even(2, 1), 0, seed=0), step=0, config=config.to_hf_dict(), rng=False
    )


def test_regroup_and_grow_of_a_ref_move_that_ref_and_warn_when_nothing_names_the_result(
    tmp_path: Any, capsys: Any
) -> None:
    from shardstore_cli.shardtrain_cli import main

    store, cid = _llama_store(tmp_path)
    assert main(["regroup", "--store", store.url, "--commit", "main", "--workers", "2", "--json"]) == 0
    out = capsys.readouterr()
    moved = json.loads(out.out)["commit"]
    assert store.ref("main") == moved and "warning" not in out.err  # moved by compare-and-swap from cid
    assert main(["grow", "--store", store.url, "--commit", cid, "--append", "1", "--json"]) == 0
    out = capsys.readouterr()
    grown = json.loads(out.out)["commit"]
    assert store.ref("main") == moved and grown not in store.ref_names()
    assert f"no ref names the new commit {grown}" in out.err and "gc" in out.err
    assert main(["grow", "--store", store.url, "--commit", "main", "--append", "1", "--ref", "big", "--json"]) == 0
    assert store.ref("big") == json.loads(capsys.readouterr().out)["commit"] and store.ref("main") == moved
