"""Wrong answers from the command line and the library's writers (issue 12, items 14-16, gc --grace 0).

- item 14: ``verify --shard K`` past the last slot, a malformed ref (``show``, ``log``,
  ``refs``, ``gc``), ``log -n -5``, ``import`` with a bad ``--step`` / ``--job``: the right
  exit code, and nothing written by a refused import;
- item 15: a failing journal (a symbolic link at ``journal/``) after the ref moved does not
  turn a successful save into an error;
- item 16: ``save(parent=<not a commit>)`` is refused before writing; two identical
  concurrent ``copy --ref`` runs both succeed; a ref naming a missing commit gets one
  answer from ``show`` and ``log``;
- ``gc --grace 0`` warns that it can delete a save in progress.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

import shardstore as ss
from shardstore.store import object_key
from shardstore_cli import shardstore_cli


def _main(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = shardstore_cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def one(tmp_path: Any) -> tuple[ss.Store, str]:
    store = ss.open_store(str(tmp_path / "s"))
    return store, ss.save(store, {"w": torch.ones(3)}, step=0, rng=False)


# -- item 14 --------------------------------------------------------------------------------------


def test_verify_shard_past_the_last_slot_is_not_found(one: Any, capsys: Any) -> None:
    store, cid = one
    assert _main(capsys, "verify", store.url, "--shard", "7")[0] == 4
    assert _main(capsys, "verify", store.url, cid, "--shard", "7")[0] == 4
    assert _main(capsys, "verify", store.url, "--shard", "0")[0] == 0


def test_a_malformed_ref_is_named_and_the_others_still_listed(one: Any, capsys: Any) -> None:
    store, cid = one
    with open(os.path.join(store.url, "refs", "broken"), "w") as f:
        f.write("junk")
    for cmd in ("show", "log"):
        code, _, err = _main(capsys, cmd, store.url, "broken")
        assert code == 1 and "'broken' is malformed" in err, (cmd, err)
    code, out, err = _main(capsys, "refs", store.url)
    assert code == 1 and f"{cid}  main" in out and "'broken'" in err
    code, _, err = _main(capsys, "gc", store.url, "--dry-run")
    assert code == 1 and "'broken' is malformed" in err and "'main'" in err


def test_log_refuses_a_negative_count(one: Any, capsys: Any) -> None:
    store, _ = one
    assert _main(capsys, "log", store.url, "-n", "-5")[0] == 2
    assert _main(capsys, "log", store.url, "-n", "0")[0] == 0


@pytest.mark.parametrize("bad", [["--step", "-1"], ["--step", str(2**63)], ["--job", "bad job!"], ["--ref", "../x"]])
def test_import_checks_its_arguments_before_writing(tmp_path: Any, capsys: Any, bad: list[str]) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"hidden_size": 2}')
    save_file({"model.norm.weight": torch.ones(2)}, str(src / "model.safetensors"))
    store = tmp_path / "store"
    code, _, err = _main(capsys, "import", str(store), str(src), *bad)
    assert code == 2, err
    assert not store.exists() or list(ss.open_store(str(store)).objects()) == []
    with pytest.raises((ss.ManifestError, ss.InvalidName)):  # the library refuses before writing too
        kw = {"--step": ("step", int), "--job": ("job", str), "--ref": ("ref", str)}[bad[0]]
        ss.ops.interchange.import_directory(ss.open_store(str(store)), str(src), **{kw[0]: kw[1](bad[1])})
    assert list(ss.open_store(str(store)).objects()) == []


# -- item 15 --------------------------------------------------------------------------------------


def test_a_failing_journal_does_not_fail_a_save(tmp_path: Any) -> None:
    store = ss.open_store(str(tmp_path / "s"))
    os.symlink(str(tmp_path), os.path.join(store.url, "journal"))  # refused as a link: InvalidName
    cid = ss.save(store, {"w": torch.ones(3)}, step=0, rng=False)  # before the fix: InvalidName after the ref moved
    assert store.ref("main") == cid and ss.verify(store).ok


@pytest.mark.parametrize(
    "note",
    [b"[" * 200_000 + b"]" * 200_000, b'{"time": NaN, "loss": NaN}', b'{"time": 1e308, "loss": -Infinity}'],
    ids=["deep", "nan", "out-of-range"],
)
def test_log_oneline_shows_nothing_for_a_journal_note_it_cannot_show(one: Any, capsys: Any, note: bytes) -> None:
    # The journal is advisory (SPEC.md §19.2): a note nested past the parser's recursion limit,
    # or holding a time gmtime cannot take, ended `log --oneline` with a traceback or an error.
    store, cid = one
    with open(os.path.join(store.url, "journal", f"{cid}.json"), "wb") as f:
        f.write(note)
    code, out, err = _main(capsys, "log", store.url, "--oneline")
    assert code == 0 and err == "" and out.startswith(f"{cid[:12]}  step      0  "), (out, err)
    code, out, err = _main(capsys, "log", store.url, "--oneline", "--json")
    assert code == 0 and err == "", err
    assert json.loads(out)["commits"][0]["time"] is None  # valid JSON: no NaN


# -- item 16 --------------------------------------------------------------------------------------


def test_save_refuses_a_parent_that_is_not_a_commit(one: Any) -> None:
    store, cid = one
    tensor = ss.load_commit(store, cid).entries()["w"].param
    before = set(store.objects())
    with pytest.raises(ss.ManifestError, match="not a commit"):
        ss.save(store, {"w": torch.zeros(3)}, step=1, rng=False, parent=tensor)
    with pytest.raises(ss.TargetNotFound):
        ss.save(store, {"w": torch.zeros(3)}, step=1, rng=False, parent="0" * 64)
    assert set(store.objects()) == before and store.ref("main") == cid


def test_identical_concurrent_copies_with_a_ref_both_succeed(one: Any, tmp_path: Any) -> None:
    """Two forked ``copy --ref main`` of the same commit, released together, 6 rounds: both
    exit 0 (before the fix the loser raised RefConflict though the ref held its commit)."""
    import multiprocessing as mp

    src, cid = one
    barrier = mp.get_context("fork").Barrier(2)
    for rnd in range(6):
        root = str(tmp_path / f"dst{rnd}")
        ss.open_store(root)
        pids = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the children
                try:
                    barrier.wait()
                    ss.copy_commit(src, ss.open_store(root, create=False), cid, ref="main", threads=1)
                    os._exit(0)
                except BaseException:
                    os._exit(3)
            pids.append(pid)
        assert [os.WEXITSTATUS(os.waitpid(p, 0)[1]) for p in pids] == [0, 0], rnd
        assert ss.open_store(root, create=False).ref("main") == cid


def test_a_ref_naming_a_missing_commit_gets_one_answer(one: Any, capsys: Any) -> None:
    store, cid = one
    os.unlink(os.path.join(store.url, object_key(cid)))
    codes = {cmd: _main(capsys, cmd, store.url, "main")[0] for cmd in ("show", "log")}
    assert codes == {"show": 1, "log": 1}, codes


# -- gc --grace 0 ---------------------------------------------------------------------------------


def test_gc_grace_zero_warns(one: Any, capsys: Any) -> None:
    store, _ = one
    code, _, err = _main(capsys, "gc", store.url, "--grace", "0")
    assert code == 0 and "warning" in err and "save in progress" in err
    code, _, err = _main(capsys, "gc", store.url, "--grace", "1h")
    assert code == 0 and "warning" not in err
