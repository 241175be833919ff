"""The main job as a user runs it: `shardtrain demo`, then `shardstore verify` on what it left."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain.run.demo import EVERY, STEPS_A, STEPS_B


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
def test_demo_recovers_the_uninterrupted_commit_and_leaves_a_verified_store(tmp_path: Path) -> None:
    # No timed assertion (docs/DEMO.md gives the measured wall time); the
    # timeout only bounds a hung run on a shared, loaded machine.
    proc = _cli("-m", "shardstore_cli.shardtrain_cli", "demo", "--home", str(tmp_path / "home"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    equal = [line for line in out.splitlines() if f"recovered step-{STEPS_A} commit" in line]
    assert len(equal) == 1 and " EQUALS the uninterrupted run's " in equal[0]
    ids = equal[0].split()
    assert ids[3] == ids[-1] and len(ids[3]) == 64
    # The group is lost in cohort A's last commit interval: the survivor names that interval's start.
    assert f"the last committed step is {STEPS_A - EVERY}" in out and "worker 1: exited with code 3" in out
    assert "ref 'recovery' is absent: no uncommitted update reached a ref" in out
    # Recovery without a storage read: the survivor from its memory tier, the replacement from its buddy.
    assert "bytes the recovery's restore read from the store: 0" in out
    assert re.search(
        r"worker 1 restored step \d+: 0 bytes from its memory tier, [1-9]\d* from peers, 0 from the store", out
    )
    assert "shardstore verify" in out and ": ok (" in out
    wide = [line for line in out.splitlines() if line.strip().startswith("learned-state root")]
    assert len(wide) == 1 and re.search(r" EQUALS step \d+'s ", wide[0]) and ", 0 tensor objects written" in wide[0]
    assert wide[0].split()[2] == wide[0].split()[6].rstrip(
        ";"
    )  # the repartition commit's root and cohort A's end's, printed in full
    assert "identity check: new layer 4 maps its input to itself bitwise: yes" in out
    assert "one-sided 95% bounds" in out and "generated correct" in out
    assert "committed" in proc.stderr  # the coordinator's progress lines
    store = tmp_path / "home" / "store"
    verify = _cli("-m", "shardstore_cli.shardstore_cli", "verify", str(store))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    _check_report(out, store)


def _family_rows(out: str, after: str) -> dict[str, dict[str, tuple[int, int]]]:
    """The per-family table following the line containing `after`: {commit label: {family: (right, n)}}."""
    lines = out[out.index(after) :].splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("correct answers"))
    families = lines[head].split()[2:-1]
    rows = {}
    for line in lines[head + 1 :]:
        cells = line.split()
        if not cells or "/" not in cells[-1]:
            break
        label = " ".join(cells[: -len(families) - 1])
        rows[label] = {f: tuple(map(int, c.split("/"))) for f, c in zip(families, cells[-len(families) - 1 : -1])}
    return rows  # type: ignore[return-value]


def _check_report(out: str, store: Path) -> None:
    import shardstore

    a, b = f"step {STEPS_A}", f"step {STEPS_A + STEPS_B}"
    dev = _family_rows(out, "[6/7]")
    assert set(dev) == {"seed", a, b}
    for counts in dev.values():
        assert set(counts) == {"filter", "lookup", "sort", "total"} and all(n == 16 for _, n in counts.values())
    # A family is learned in generation after cohort A: a clear majority (>= 9 of 16) of the
    # development set's filter answers right, from none at the seed (docs/DEMO.md: measured
    # 13/16 after cohort A).
    assert all(right == 0 for right, _ in dev["seed"].values()), dev["seed"]
    assert dev[a]["filter"][0] >= 9, dev[a]
    assert f"best family after cohort A: filter {dev[a]['filter'][0]}/16" in out
    # The development task loss drops, and the gain gate (upper bound below -0.001
    # nats/token) passes for both endpoints.
    gates = [line for line in out.splitlines() if line.strip().startswith(("gain ", "retention ", "generation "))]
    assert len(gates) == 9  # three gates, for A and B on the development sets and B on the finals
    assert all(" pass" in g for g in gates if g.strip().startswith("gain "))
    assert "development gates" in out and "final gates" in out and "selection " in out
    final = _family_rows(out, "[7/7]")
    assert set(final) == {"seed", b} and final[b]["filter"][0] >= 9, final
    # The references (the seed for cohort A, the end of cohort A for cohort B) wrote nothing:
    # every object in the store is reachable from a commit or pinned (jobs, selection, gate reports).
    s = shardstore.open_store(str(store), create=False)
    dry = shardstore.gc(s, grace_seconds=0, dry_run=True)
    assert not dry.deleted and not dry.kept_young, dry
    objects, pinned = set(s.objects()), {o for ids in s.pins().values() for o in ids}
    assert len(objects) == len(_reachable(s) | pinned) and objects == _reachable(s) | pinned


def _reachable(s) -> set[str]:  # type: ignore[no-untyped-def]
    import shardstore
    from shardstore.ops.transfer import commit_closure

    seen: set[str] = set()
    for head in s.refs().values():
        cid = head
        while cid is not None and cid not in seen:
            lc = shardstore.load_commit(s, cid)
            seen |= {cid, *lc.shard_ids.values(), *commit_closure(lc).data}
            cid = lc.commit.parent
    return seen


@pytest.mark.long  # ~12 s: .ci/run's second step (the README's test command keeps its 8 minutes)
def test_cli_refuses_before_training(tmp_path: Path) -> None:
    prep = _cli(
        "-m",
        "shardstore_cli.shardtrain_cli",
        "prepare",
        "--out",
        str(tmp_path / "job"),
        "--steps-a",
        "2",
        "--steps-b",
        "1",
        "--json",
    )
    assert prep.returncode == 0, prep.stderr
    job = json.loads(prep.stdout)
    assert job["steps"] == 3 and len(job["id"]) == 64
    bad = _cli(
        "-m",
        "shardstore_cli.shardtrain_cli",
        "train",
        "--prepared",
        job["job"],
        "--store",
        str(tmp_path / "s"),
        "--until",
        "9",
    )
    assert bad.returncode == 5 and "JobError: --until 9 is outside the job's schedule of 3 steps" in bad.stderr
    missing = _cli(
        "-m",
        "shardstore_cli.shardtrain_cli",
        "train",
        "--prepared",
        job["job"],
        "--store",
        str(tmp_path / "s"),
        "--until",
        "2",
        "--resume",
        "0123456789abcdef",
    )
    assert missing.returncode == 4 and "TargetNotFound" in missing.stderr
    usage = _cli("-m", "shardstore_cli.shardtrain_cli", "train", "--store", "x")
    assert usage.returncode == 2


@pytest.mark.e2e
def test_torchrun_workers_commit_what_the_local_launcher_commits(tmp_path: Path) -> None:
    import os

    from shardtrain.workers.launch import free_port

    job = str(tmp_path / "job" / "job.json")
    assert (
        _cli(
            "-m",
            "shardstore_cli.shardtrain_cli",
            "prepare",
            "--out",
            str(tmp_path / "job"),
            "--steps-a",
            "2",
            "--steps-b",
            "1",
        ).returncode
        == 0
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "shardstore_cli.shardtrain_cli",
        "train",
        "--prepared",
        job,
        "--store",
        str(tmp_path / "torchrun"),
        "--until",
        "3",
        "--every",
        "2",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    local = _cli(
        "-m",
        "shardstore_cli.shardtrain_cli",
        "train",
        "--prepared",
        job,
        "--store",
        str(tmp_path / "local"),
        "--until",
        "3",
        "--every",
        "2",
        timeout=120,
    )
    assert local.returncode == 0, local.stderr[-3000:]
    assert local.stderr.count("estimated peak") == 2 and "MiB above admission" in local.stderr  # estimate beside actual
    import shardstore

    refs = [shardstore.open_store(str(tmp_path / d)).refs() for d in ("torchrun", "local")]
    assert refs[0] == refs[1] and refs[0]["main"] in local.stdout
