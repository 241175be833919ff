"""Pipeline schedules: every schedule is complete, ordered and deadlock-free; the overlapped
one holds a bounded number of microbatches; and both give bitwise identical results, in one
process and as commit ids of 2- and 3-worker runs with a partial microbatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from shardtrain_helpers import make_batch, tiny_config

from shardtrain import Partition, build_stage
from shardtrain.engine.pipeline import Pipeline
from shardtrain.engine.schedule import BACKWARD, FORWARD, HEAD, Action, build, check, in_flight, overlapped, synchronous
from shardtrain.errors import ConfigError
from shardtrain.job.default_job import prepare_default
from shardtrain.run.lifecycle import RunSpec, train


@pytest.mark.parametrize("name", ["overlapped", "synchronous"])
def test_every_schedule_is_complete_ordered_and_deadlock_free(name: str) -> None:
    for n in range(1, 6):
        for m in range(1, 13):
            plan = build(name, n, m)
            check(plan, m)  # raises on a missing, repeated or out-of-order action, or a deadlock
            held = max(in_flight(a) for a in plan)
            assert held == m if name == "synchronous" else held <= min(m, n + 2), (name, n, m, held)


def test_overlapped_really_overlaps() -> None:
    # Slot 1 of 2 starts backwards before slot 0 has run every forward (GPipe would not).
    plan = overlapped(2, 6)
    assert plan[0].index(Action(BACKWARD, 0)) < plan[0].index(Action(FORWARD, 5))
    assert plan != synchronous(2, 6)
    assert synchronous(2, 2)[0] == (
        Action(FORWARD, 0),
        Action(FORWARD, 1),
        Action(HEAD, 0),
        Action(HEAD, 1),
        Action(BACKWARD, 0),
        Action(BACKWARD, 1),
    )


def test_check_refuses_broken_schedules() -> None:
    good = synchronous(2, 2)
    swapped = (good[0], (good[1][1], good[1][0]) + good[1][2:])
    with pytest.raises(ConfigError, match="slot 1 runs forward of microbatches \\[1, 0\\]"):
        check(swapped, 2)
    early = (good[0], (Action(BACKWARD, 0), Action(FORWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 1)))
    with pytest.raises(ConfigError, match="slot 1 runs backward of microbatch 0 before its forward"):
        check(early, 2)
    # Slot 0 waits for microbatch 0's gradient before running the head that produces it.
    stuck = (
        (
            Action(FORWARD, 0),
            Action(BACKWARD, 0),
            Action(HEAD, 0),
            Action(FORWARD, 1),
            Action(HEAD, 1),
            Action(BACKWARD, 1),
        ),
        good[1],
    )
    with pytest.raises(ConfigError, match="schedule deadlocks"):
        check(stuck, 2)
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'gpipe'"):
        build("gpipe", 2, 2)


@pytest.mark.parametrize("tied", [True, False])
def test_one_process_schedules_are_bitwise_identical(tied: bool) -> None:
    config = tiny_config(tied=tied)
    batch = make_batch(config, seed=5, rows=5)  # microbatches of 2, 2 and 1
    partition = Partition.even(4, 1)
    results = []
    for name in ("synchronous", "overlapped"):
        stage = build_stage(config, partition, 0, seed=3)
        loss = Pipeline(stage, partition, 0, schedule=name).forward_backward(batch, step=0, microbatch_size=2)
        results.append((loss, {n: p.grad for n, p in stage.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == loss_b
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


@pytest.mark.parametrize("workers", [2, pytest.param(3, marks=pytest.mark.long)])  # 3: the test budget
def test_workers_commit_identical_ids_with_either_schedule(tmp_path: Path, workers: int) -> None:
    """Several steps, a partial last microbatch (5 rows in microbatches of 2), a commit every
    step; the synchronous run also commits synchronously, the overlapped one in the background."""
    job = prepare_default(tmp_path / "job", steps_a=3, steps_b=1, batch_size=5, microbatch_size=2, eval_per_set=2)
    ids = {}
    for name, background in (("synchronous", False), ("overlapped", True)):
        results = train(
            RunSpec(job=job, store=str(tmp_path / name), until=3, every=1, schedule=name, async_commits=background),
            workers,
            timeout=60,
        )
        ids[name] = [(c.step, c.id) for c in results[0].commits]
        assert all([(c.step, c.id) for c in r.commits] == ids[name] for r in results)
    assert [s for s, _ in ids["synchronous"]] == [0, 1, 2, 3]
    assert ids["overlapped"] == ids["synchronous"]
