"""Tests of the ``shardstore`` command line, run as a real process on stores built by the library.

Each corruption case gets its own copy of one library-built store; the processes run a few
at a time (every one pays the torch import), and each case then asserts the exit code and
that the output names the damaged object, its tensor and its commit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import TinyNet, make_optimizer, train_steps

import shardstore as ss
from shardstore_cli import shardstore_cli

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardstore_cli.shardstore_cli", *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_all(cmds: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {k: pool.submit(run, *c) for k, c in cmds.items()}
        return {k: f.result() for k, f in futures.items()}


def obj_path(store: Path, oid: str) -> Path:
    return store / "objects" / oid[:2] / oid


def flip(path: Path, at: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A store with two commits on 'main': one slot at step 2, then two slots at step 3."""
    path = tmp_path_factory.mktemp("cli") / "store"
    store = ss.open_store(str(path))
    model = TinyNet()
    opt = make_optimizer(model)
    train_steps(model, opt, 2)
    first = ss.save(store, model, opt, step=2, config={"hidden": 8})
    train_steps(model, opt, 1)
    names = sorted(n for n, _ in model.named_parameters())
    states = [ss.capture(model, opt, names=names[:4]), ss.capture(model, opt, names=names[4:])]
    head = ss.save_slots(store, states, info=ss.CommitInfo(step=3, config={"hidden": 8}))
    lc = ss.load_commit(store, head)
    e1 = lc.shards[1].entries[0]
    e0 = lc.shards[0].entries[1]
    info = {
        "first": first, "head": head, "shard1": lc.shard_ids[1],
        "param": e1.param, "param_tensor": e1.name, "m1": e0.optim.exp_avg, "m2": e0.optim.exp_avg_sq, "m_tensor": e0.name,
    }  # fmt: skip
    return path, info


def _case_tensor(s: Path, i: dict[str, str]) -> tuple[str, str | None, str]:
    flip(obj_path(s, i["param"]), 3)
    return i["param"], i["param_tensor"], "CorruptObject"


def _case_shard(s: Path, i: dict[str, str]) -> tuple[str, str | None, str]:
    flip(obj_path(s, i["shard1"]), 20)
    return i["shard1"], None, "CorruptObject"


def _case_commit(s: Path, i: dict[str, str]) -> tuple[str, str | None, str]:
    flip(obj_path(s, i["head"]), 30)
    return i["head"], None, "CorruptObject"


def _case_truncated(s: Path, i: dict[str, str]) -> tuple[str, str | None, str]:
    p = obj_path(s, i["m1"])
    p.write_bytes(p.read_bytes()[:-4])
    return i["m1"], i["m_tensor"], "CorruptObject"


def _case_deleted(s: Path, i: dict[str, str]) -> tuple[str, str | None, str]:
    obj_path(s, i["m2"]).unlink()
    return i["m2"], i["m_tensor"], "ObjectNotFound"


GHOST = "ab" * 32


def _case_ghost_ref(s: Path, i: dict[str, str]) -> tuple[str, str | None, str]:
    (s / "refs" / "ghost").write_text(GHOST + "\n")
    return GHOST, None, "ObjectNotFound"


CASES: dict[str, Callable[[Path, dict[str, str]], tuple[str, str | None, str]]] = {
    "tensor-flipped": _case_tensor,
    "shard-manifest-flipped": _case_shard,
    "commit-manifest-flipped": _case_commit,
    "object-truncated": _case_truncated,
    "object-deleted": _case_deleted,
    "ref-to-missing-commit": _case_ghost_ref,
}


@pytest.fixture(scope="module")
def verified(base, tmp_path_factory):
    """Run verify as a process on a fresh damaged copy of the base store per case."""
    src, info = base
    expected, stores, cmds = {}, {}, {"clean": ["verify", str(src)]}
    for name, damage in CASES.items():
        copy = tmp_path_factory.mktemp(name) / "store"
        shutil.copytree(src, copy)
        expected[name] = damage(copy, info)
        stores[name] = str(copy)
        cmds[name] = ["verify", str(copy)]
    return expected, run_all(cmds), stores


def problems(text: str) -> list[dict[str, str]]:
    """The problem blocks of verify's text output, as dicts (kind, object, tensor, commit, detail)."""
    out: list[dict[str, str]] = []
    for line in text.splitlines():
        if line.startswith("problem "):
            out.append({"kind": line.split(": ", 1)[1]})
        elif line.startswith("  ") and out:
            key, value = line.strip().split(": ", 1)
            out[-1][key] = value
    return out


def test_verify_clean(verified, base, capsys):
    _, results, _ = verified
    r = results["clean"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok: 2 commit(s)") and r.stderr == ""  # no progress bar without a terminal
    assert shardstore_cli.main(["verify", str(base[0]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["problems"] == [] and set(doc["commits"]) == {base[1]["first"], base[1]["head"]}


@pytest.mark.parametrize("case", list(CASES))
def test_verify_finds_damage(verified, base, case):
    expected, results, _ = verified
    oid, tensor, kind = expected[case]
    r = results[case]
    assert r.returncode == 3, r.stdout + r.stderr
    assert "FAILED" in r.stdout.splitlines()[-1]
    hits = [p for p in problems(r.stdout) if p["object"] == oid]
    assert hits, r.stdout
    assert hits[0]["kind"] == kind and hits[0]["tensor"] == (tensor or "-")
    if case == "ref-to-missing-commit":
        assert hits[0]["commit"] == f"{GHOST} (ref ghost)"
    else:
        assert hits[0]["commit"] == f"{base[1]['head']} (ref main)"
        assert oid in hits[0]["detail"]


def test_verify_quick_and_shard(verified, base, capsys):
    _, _, stores = verified
    main = shardstore_cli.main
    assert main(["verify", stores["object-truncated"], "--quick", "--json"]) == 3
    quick = json.loads(capsys.readouterr().out)
    assert quick["deep"] is False
    assert [p["kind"] for p in quick["problems"]] == ["TensorMismatch"] and quick["problems"][0]["object"] == base[1][
        "m1"
    ]
    assert main(["verify", stores["tensor-flipped"], "--shard", "0"]) == 0
    assert "slot 0 only" in capsys.readouterr().out
    assert main(["verify", stores["tensor-flipped"], "--shard", "1", base[1]["head"][:12], "--json"]) == 3
    assert [p["object"] for p in json.loads(capsys.readouterr().out)["problems"]] == [base[1]["param"]]


def test_inspection_commands(base, capsys):
    src, info = base
    s = str(src)
    r = run_all({"log": ["log", s], "diff": ["diff", s, info["first"], "main", "--json"]})
    assert all(p.returncode == 0 for p in r.values()), {k: p.stderr for k, p in r.items() if p.returncode}
    log = r["log"].stdout.splitlines()
    assert [line.split()[:3] for line in log[1:]] == [[info["head"], "3", "train"], [info["first"], "2", "train"]]
    d = json.loads(r["diff"].stdout)
    assert d["slots"] == [1, 2] and d["layout_changed"] and {f["name"] for f in d["fields"]} >= {"step", "parent"}

    def out(*argv: str) -> str:
        assert shardstore_cli.main(list(argv)) == 0, argv
        return capsys.readouterr().out

    show = json.loads(out("show", s, info["head"][:8], "--json"))
    assert show["id"] == info["head"] and show["refs"] == ["main"] and [s["tensors"] for s in show["layout"]] == [4, 4]
    assert show["totals"]["tensors"] == 8
    text = out("show", s, "main")
    assert "learned-state root" in text and text.splitlines()[-1].startswith("total")
    cat = json.loads(out("cat", s, info["shard1"][:10], "--json"))
    assert cat["kind"] == "ShardManifest" and cat["value"]["slot"] == 1 and cat["id"] == info["shard1"]
    assert json.loads(out("cat", s, "main"))["type"] == "commit"
    assert out("refs", s) == f"{info['head']}  main\n"
    assert json.loads(out("refs", s, "--json")) == {"refs": {"main": info["head"]}, "pins": {}, "gc_markers": []}
    assert out("diff", s, "main", "main").strip().endswith("no differences")
    assert "layout: 1 slot(s) -> 2 slot(s)" in out("diff", s, info["first"], "main", "--stats")
    assert [c["id"] for c in json.loads(out("log", s, "-n", "1", "--json"))["commits"]] == [info["head"]]


def test_exit_codes_not_found_usage_error(base, tmp_path, capsys):
    s = str(base[0])
    r = run_all(
        {"unknown-ref": ["verify", s, "nosuchref"], "no-args": ["verify"], "not-a-store": ["refs", str(tmp_path)]}
    )
    assert r["unknown-ref"].returncode == 4 and "nosuchref" in r["unknown-ref"].stderr and r["unknown-ref"].stdout == ""
    assert r["no-args"].returncode == 2 and "usage:" in r["no-args"].stderr
    assert r["not-a-store"].returncode == 1 and "StoreConfigError" in r["not-a-store"].stderr
    main = shardstore_cli.main
    assert main(["show", s, "deadbeefdeadbeef"]) == 4
    assert "TargetNotFound" in capsys.readouterr().err
    assert main(["cat", s, "00" * 32, "--json"]) == 4
    assert json.loads(capsys.readouterr().err)["error"]["exit"] == 4
    for argv in (
        ["diff", s, "main"],
        ["import", s, str(tmp_path), "--slots", "2", "--layout", "0:1,1:2"],
        ["export", s, "main", str(tmp_path), "--max-shard-size", "lots"],
        ["verify", s, "--shard", "-1"],
        [],
    ):
        assert main(argv) == 2, argv
        assert "usage:" in capsys.readouterr().err
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert (
        "exit codes:" in help_text
        and "4   not found" in help_text
        and "3   the check ran and found problems" in help_text
    )


def test_import_export_round_trip_through_cli(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(tmp_path / "src"))
    store = str(tmp_path / "store")
    imp = run("import", store, str(tmp_path / "src"), "--slots", "2", "--ref", "hf")
    assert imp.returncode == 0, imp.stderr
    cid = imp.stdout.strip()
    assert len(cid) == 64 and ss.open_store(store).ref("hf") == cid
    exp = run("export", store, "hf", str(tmp_path / "out"), "--max-shard-size", "40KB", "--json")
    assert exp.returncode == 0, exp.stderr
    assert json.loads(exp.stdout)["commit"] == cid and (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    tokens = torch.arange(20).reshape(2, 10)
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, model(tokens).logits)


def test_store_commands_plugin(monkeypatch, capsys):
    """A cli/store_commands.py exposing register(subparsers) plugs in without editing the CLI."""
    seen = []

    def register(sub) -> None:
        p = sub.add_parser("copy")
        p.add_argument("src")
        p.set_defaults(func=lambda args: seen.append(args.src) or 7)

    monkeypatch.setitem(sys.modules, "shardstore_cli.store_commands", types.SimpleNamespace(register=register))
    assert shardstore_cli.main(["copy", "x"]) == 7 and seen == ["x"]
    assert shardstore_cli.main(["nosuchcommand"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_commands_on_an_fsspec_url(trained, tmp_path, capsys):
    """A store given as an fsspec URL (memory:// is per process, so this runs in-process)."""
    url = f"memory://cli-tests/{uuid.uuid4().hex}"
    model, opt = trained
    cid = ss.save(ss.open_store(url), model, opt, step=3, config={"hidden": 8})
    main = shardstore_cli.main
    assert main(["verify", url, "--json"]) == 0 and json.loads(capsys.readouterr().out)["commits"] == [cid]
    assert main(["show", url, "main"]) == 0 and cid in capsys.readouterr().out
    assert main(["export", url, "main", str(tmp_path / "out"), "--with-optimizer", "--json"]) == 0
    assert "optimizer.exp_avg.safetensors" in json.loads(capsys.readouterr().out)["files"]
    assert main(["refs", "memory://cli-tests/nothing-here"]) == 1
    assert "not a shardstore store" in capsys.readouterr().err


def test_pins_listed_and_removed_through_the_cli(tmp_path, capsys):
    store_path = str(tmp_path / "s")
    store = ss.open_store(store_path)
    cid = ss.save(store, {"w": torch.ones(2)}, step=0, rng=False)
    job = store.put(b"a job file")
    store.pin("jobs/j1", [job], expected=None)
    assert shardstore_cli.main(["refs", store_path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"refs": {"main": cid}, "pins": {"jobs/j1": [job]}, "gc_markers": []}
    assert (
        shardstore_cli.main(["refs", store_path]) == 0
        and "pin jobs/j1: 1 objects kept by gc" in capsys.readouterr().out
    )
    assert shardstore_cli.main(["gc", store_path, "--grace", "0s", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pinned_objects"] == 1 and store.has(job)
    assert shardstore_cli.main(["unpin", store_path, "jobs/j1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"unpinned": "jobs/j1", "objects": 1}
    assert shardstore_cli.main(["unpin", store_path, "jobs/j1"]) == 4  # no such pin: not found
    assert "no pin 'jobs/j1'" in capsys.readouterr().err
    assert shardstore_cli.main(["gc", store_path, "--grace", "0s"]) == 0 and not store.has(job)


_TORCH_FREE = r"""
import json, sys
from shardstore_cli.shardstore_cli import main
store, copy, first = sys.argv[1], sys.argv[2], sys.argv[3]
runs = [["--version"], ["--help"], ["log", store], ["log", store, "--json"], ["show", store, "main"], ["refs", store],
        ["cat", store, "main"], ["diff", store, first, "main"], ["verify", store], ["verify", store, "--quick"],
        ["gc", store, "--dry-run"], ["copy", store, copy, "main"], ["unpin", store, "no-such-pin"]]
codes = []
for argv in runs:
    try:
        codes.append(main(argv))
    except SystemExit as e:  # --version and --help exit through argparse
        codes.append(e.code)
    assert "torch" not in sys.modules, f"{argv} imported torch"
print(json.dumps(codes))
"""


def test_store_only_commands_do_not_import_torch(base, tmp_path):
    """log, show, refs, cat, diff (without --stats), verify, gc, copy, unpin, --version and
    --help read manifests and hash bytes; none of them may pay torch's import (seconds), so
    the command line starts as fast as git's. One process runs them all, in order."""
    store, info = base
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_FREE, str(store), str(tmp_path / "copy"), info["first"]],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert codes[:-1] == [0] * (len(codes) - 1), (codes, proc.stderr[-2000:])
    assert codes[-1] == 4, proc.stderr  # unpin of a pin that does not exist: not found
