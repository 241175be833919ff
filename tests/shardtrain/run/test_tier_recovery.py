"""Recovery without a storage read, end to end over real Gloo (SPEC.md §19.3).

Each worker gets a memory tier of its own (``RunSpec.memory_tiers``: slot -> directory), which
is how one machine stands in for separate hosts: losing a "host" is deleting its directory.
The tiers keep 2 commits, so a group can be restarted from the step-2 commit after the run
reached step 4. The reference trains to step 4 committing every 2; a fresh group restores
step 2 and loses worker 1 during step 3 (after microbatch 0's forward); the restarted group
restores step 2 from its memory tiers, reading no object from the store, and reproduces the
reference's step-4 commit id. The long tests then lose a host (its tier gone: the replacement
restores from its buddy), a host whose buddy holds a corrupt replica, a host and its buddy,
and a host of three.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import shardstore
from shardstore.backends.memory_tier import MemoryTier
from shardstore_cli.shardtrain_cli import main as shardtrain_main
from shardtrain.errors import RunAborted
from shardtrain.job.default_job import prepare_default
from shardtrain.run.lifecycle import FAULT_ENV, RunResult, RunSpec, train

# Whole runs killed and recovered (~50 s on 2 cores): .ci/run's long step, for the test budget.
# The tiers' parts stay in the test command: tests/shardstore/backends/test_memory_tier.py, tests/shardstore/checkpoint/test_replicas.py.
pytestmark = pytest.mark.long

TIMEOUT = 30.0


def _spec(run: SimpleNamespace, ref: str, **kw: object) -> RunSpec:
    return RunSpec(
        job=run.job,
        store=run.url,
        until=4,
        every=2,
        resume=run.commits[2],
        ref=ref,
        memory_tiers=tuple(sorted(run.tiers.items())),
        tier_commits=2,
        **kw,  # type: ignore[arg-type]
    )


def _start(home: Path, workers: int) -> SimpleNamespace:
    job = prepare_default(home / "job", steps_a=4, steps_b=1, batch_size=4, microbatch_size=2, eval_per_set=2)
    run = SimpleNamespace(job=job, url=str(home / "store"), tiers={s: str(home / f"host{s}") for s in range(workers)})
    run.workers = workers
    run.commits = {}
    reference = train(
        RunSpec(
            job=job, store=run.url, until=4, every=2, memory_tiers=tuple(sorted(run.tiers.items())), tier_commits=2
        ),
        workers,
        timeout=TIMEOUT,
    )
    run.commits = {c.step: c.id for c in reference[0].commits}
    run.reference = reference
    with pytest.raises(RunAborted) as crash:
        train(
            _spec(run, "replay", message_timeout=15),
            workers,
            timeout=TIMEOUT,
            env={FAULT_ENV: "slot=1,step=3,microbatch=0"},
        )
    run.crash = crash.value
    return run


def _recover(run: SimpleNamespace, ref: str, lost: tuple[int, ...] = ()) -> list[RunResult]:
    for slot in lost:  # the host is gone, and its memory tier with it
        shutil.rmtree(run.tiers[slot])
    return train(_spec(run, ref), run.workers, timeout=TIMEOUT)


def _assert_recovered(run: SimpleNamespace, results: list[RunResult]) -> None:
    assert {c.step: c.id for c in results[0].commits} == {4: run.commits[4]}
    assert all(r.commits == results[0].commits and r.start_commit == run.commits[2] for r in results)
    ref_losses = {s.step: s.loss for s in run.reference[0].steps}
    assert {s.step: s.loss for s in results[0].steps} == {k: ref_losses[k] for k in (3, 4)}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    run = _start(tmp_path_factory.mktemp("tier-recovery"), 2)
    run.restarted = _recover(run, "replay")
    return run


def test_a_worker_lost_mid_update_restarts_from_its_memory_tier(two: SimpleNamespace) -> None:
    assert "worker 1: exited with code 3" in str(two.crash)
    assert all(r.restore.memory == 0 and r.restore.store == 0 for r in two.reference)  # a fresh start reads nothing
    _assert_recovered(two, two.restarted)
    for r in two.restarted:
        assert r.restore.store == 0 and r.restore.peers == 0 and r.restore.memory > 0, r.restore
        assert not r.restore_rejected and not r.tier_errors
        assert r.tier_bytes > 0
    # The journal says what each worker's host held in memory for it when the step-4 commit was asked for.
    record = json.loads((Path(two.url) / "journal" / f"{two.commits[4]}.json").read_bytes())
    assert all(w["tier_bytes"] > 0 and w["replica_bytes"] > 0 for w in record["workers"]), record
    # ... within the bound admission counted (the planner's `tier`: (K + 1) commits of its slot and of
    # the slot it is buddy of), which is no loose multiple of it.
    for w in record["workers"]:
        held = w["tier_bytes"] + w["replica_bytes"]
        assert held <= w["tier_estimate"] <= 4 * held, w


@pytest.mark.long  # .ci/run's second step (the README's test command keeps its 8 minutes)
def test_a_corrupt_object_in_a_memory_tier_is_read_from_the_store(two: SimpleNamespace) -> None:
    store = shardstore.open_store(two.url)
    lc = shardstore.load_commit(store, two.commits[2])
    victim = lc.shards[1].entries[0].param
    path = Path(two.tiers[1]) / "slot1" / "objects" / victim[:2] / victim
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    results = _recover(two, "corrupt-memory")
    _assert_recovered(two, results)
    r0, r1 = results
    assert r0.restore.store == 0 and not r0.restore_rejected
    assert r1.restore.store == store.object_size(victim)
    assert r1.restore_rejected == (
        f"object {victim}: the copy from memory tier {Path(two.tiers[1]).resolve() / 'slot1'} does not hash to its "
        f"id (its bytes hash to {shardstore.format.tensors.hash_bytes(bytes(data))}); not used",
    )


@pytest.mark.long  # ~25 s: .ci/run's second step (the README's test command keeps its 8 minutes)
def test_the_command_line_reports_restore_bytes_by_tier(
    two: SimpleNamespace, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hosts = {slot: str(tmp_path / f"host{slot}") for slot in two.tiers}  # copies: the module's tiers stay as they are
    for slot, path in two.tiers.items():
        shutil.copytree(path, hosts[slot])
    tiers = [a for slot, path in sorted(hosts.items()) for a in ("--memory-tier", f"{slot}={path}")]
    base = ["train", "--prepared", two.job, "--store", two.url, "--until", "5"]
    argv = [*base, "--memory-tier-commits", "2", *tiers]
    # Restart at step 4: both tiers hold it, so no object is read from the store.
    assert shardtrain_main([*argv, "--resume", two.commits[4], "--ref", "cli-json", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [w["restore"]["store"] for w in doc] == [0, 0] and all(w["restore"]["memory"] > 0 for w in doc)
    assert set(doc[0]["restore"]) == {"memory", "peers", "store"} and doc[0]["restore_rejected"] == []
    # The new step-5 commit's journal says the same per worker (what a torchrun group leaves to read).
    record = json.loads((Path(two.url) / "journal" / f"{doc[0]['commits'][-1]['id']}.json").read_bytes())
    got = [(w["restore_memory"], w["restore_peers"], w["restore_store"]) for w in record["workers"]]
    assert got == [(w["restore"]["memory"], 0, 0) for w in doc]
    assert shardtrain_main([*argv, "--resume", two.commits[4], "--ref", "cli-text"]) == 0
    err = capsys.readouterr().err
    for w in doc:
        kib = f"{w['restore']['memory'] / 1024:.1f} KiB" if w["restore"]["memory"] < 2**20 else "MiB"
        assert f"worker {w['rank']}: restored its slot of {two.commits[4][:12]} reading " in err and kib in err
    assert err.count("0 B from peers and 0 B from the store") == 2
    # Without a tier everything comes from the store, and is counted there.
    assert (
        shardtrain_main([*base, "--resume", two.commits[4], "--ref", "cli-off", "--memory-tier", "off", "--json"]) == 0
    )
    off = json.loads(capsys.readouterr().out)
    assert all(w["restore"]["memory"] == w["restore"]["peers"] == 0 < w["restore"]["store"] for w in off)
    assert [w["restore"]["store"] for w in off] == [w["restore"]["memory"] for w in doc]  # the same objects
    # Options no worker could use are refused before any starts.
    assert (
        shardtrain_main([*argv, "--resume", two.commits[4], "--memory-tier", "7=/tmp/x", "--quiet"]) == 5
    )  # refused (the one exit-code table)
    assert "there is no slot 7 among 2 workers" in capsys.readouterr().err
    assert (
        shardtrain_main([*argv, "--resume", two.commits[4], "--peer-replicas", "-1", "--quiet"]) == 5
    )  # refused (the one exit-code table)
    assert (
        shardtrain_main([*argv, "--resume", two.commits[4], "--memory-tier", "off", "--quiet"]) == 5
    )  # refused (the one exit-code table)
    assert "--memory-tier off turns every tier off: give it alone" in capsys.readouterr().err


@pytest.mark.long
def test_a_replacement_host_restores_from_its_buddy_with_no_store_read(two: SimpleNamespace) -> None:
    results = _recover(two, "host-lost", lost=(1,))
    _assert_recovered(two, results)
    r0, r1 = results
    assert r0.restore.store == 0 and r0.restore.peers == 0
    assert r1.restore.store == 0 and r1.restore.peers > 0, r1.restore
    assert not r1.restore_rejected
    # no tier keeps a peer's copy, so the restored commit was never recorded in the replacement's
    # tier; its first commit (step 4) wrote its closure through and is the one commit held (SPEC.md §19.3)
    tier = MemoryTier(two.tiers[1], 1, keep=2)
    assert [h.commit for h in tier.held()] == [two.commits[4]] and tier.holds(two.commits[4]) is not None


@pytest.mark.long
def test_a_buddy_sending_wrong_bytes_is_named_and_the_store_used(two: SimpleNamespace) -> None:
    store = shardstore.open_store(two.url)
    victim = shardstore.load_commit(store, two.commits[2]).shards[1].entries[-1].param
    replica = Path(two.tiers[0]) / "slot1" / "objects" / victim[:2] / victim  # slot 0's host keeps slot 1's replica
    os.chmod(replica, 0o644)
    replica.write_bytes(b"\xff" + replica.read_bytes()[1:])
    results = _recover(two, "wrong-peer", lost=(1,))
    _assert_recovered(two, results)
    r1 = results[1]
    assert r1.restore.store == store.object_size(victim) and r1.restore.peers > 0
    assert len(r1.restore_rejected) == 1
    assert r1.restore_rejected[0].startswith(f"object {victim}: the copy from peer slot 0 does not hash to its id")


@pytest.mark.long
def test_losing_a_host_and_its_buddy_falls_back_to_the_store(two: SimpleNamespace) -> None:
    results = _recover(two, "both-lost", lost=(0, 1))
    _assert_recovered(two, results)
    for r in results:
        assert r.restore.memory == 0 and r.restore.peers == 0 and r.restore.store > 0, r.restore


@pytest.mark.long
def test_three_workers_a_lost_host_restores_from_its_buddy(tmp_path: Path) -> None:
    run = _start(tmp_path, 3)
    assert "worker 1: exited with code 3" in str(run.crash)
    results = _recover(run, "host-lost", lost=(1,))
    _assert_recovered(run, results)
    assert [r.restore.store for r in results] == [0, 0, 0]
    assert results[1].restore.peers > 0 and results[0].restore.peers == results[2].restore.peers == 0
