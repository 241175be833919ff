"""Stores across hosts (issue 23, item 2): a resume refused before training when the store
lacks the commits its job depends on (a frozen distillation reference), ``shardstore copy
--with-deps`` bringing them, and workers given unrelated private run stores refused before
training."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

import shardstore as ss
from shardstore_cli.shardstore_cli import main as shardstore_main
from shardstore_cli.shardtrain_cli import main as shardtrain_main
from shardtrain.errors import WorkerFailedError
from shardtrain.run.dependencies import REFERENCES_PIN, check_shared_store
from shardtrain.workers.launch import WorkerContext, launch_local


@pytest.mark.long  # fresh processes: .ci/run's second step, for the test command's 8 minutes
def test_resume_needs_the_frozen_reference_and_copy_brings_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_dir, a, b = tmp_path / "job", str(tmp_path / "a"), str(tmp_path / "b")
    assert shardtrain_main(["prepare", "--out", str(job_dir), "--steps-a", "2", "--steps-b", "2", "--quiet"]) == 0
    job = str(job_dir / "job.json")
    # cohort B (steps 3-4) distils toward cohort A's endpoint (step 2), which this run commits
    assert shardtrain_main(["train", "--prepared", job, "--store", a, "--until", "3", "--quiet"]) == 0
    src = ss.open_store(a)
    head = src.ref("main")
    endpoint = src.commit(head).parent
    assert endpoint is not None and src.commit(endpoint).step == 2
    assert endpoint in (src.pinned(REFERENCES_PIN.format(job=src.commit(head).job)) or ())
    capsys.readouterr()
    assert shardstore_main(["copy", a, b, "main", "--ref", "main"]) == 0  # the commit alone
    assert (
        shardtrain_main(["train", "--prepared", job, "--store", b, "--until", "4", "--resume", "main", "--quiet"]) == 5
    )
    err = capsys.readouterr().err
    assert f"commit {endpoint} (cohort B's frozen reference" in err or f"commit {endpoint} (on the chain" in err, err
    assert f"shardstore copy SOURCE_STORE {ss.open_store(b).url} {head} --with-deps" in err, err
    assert ss.open_store(b).ref("main") == head  # nothing was trained
    assert shardstore_main(["copy", a, b, "main", "--with-deps", "--ref", "main"]) == 0
    assert f"with dependency commit {endpoint}" in capsys.readouterr().out
    assert (
        shardtrain_main(["train", "--prepared", job, "--store", b, "--until", "4", "--resume", "main", "--quiet"]) == 0
    )
    dst = ss.open_store(b)
    assert dst.commit(dst.ref("main")).step == 4 and dst.commit(dst.ref("main")).parent == head


def _private_store_worker(ctx: WorkerContext, root: str) -> None:
    check_shared_store(ss.open_store(f"{root}/host{ctx.rank}"), ctx.rank, ctx.world_size)


def _shared_store_worker(ctx: WorkerContext, root: str) -> None:
    check_shared_store(ss.open_store(f"{root}/shared"), ctx.rank, ctx.world_size)


@pytest.mark.long  # ~16 s: .ci/run's second step (the README's test command keeps its 8 minutes)
def test_workers_with_private_run_stores_are_refused(tmp_path: Path) -> None:
    launch_local(_shared_store_worker, 2, (str(tmp_path),), timeout=timedelta(seconds=30))  # one store: accepted
    shared = ss.open_store(str(tmp_path / "shared"))
    assert not list(shared.objects()) and not list(shared.storage.list("tmp"))  # the probe left nothing behind
    with pytest.raises(WorkerFailedError) as info:
        launch_local(_private_store_worker, 2, (str(tmp_path),), timeout=timedelta(seconds=30))
    assert sorted(info.value.failures) == [0, 1]  # every worker refuses, none trains
    for text in info.value.failures.values():
        assert text.startswith("ResumeError: slot(s) [1] cannot see the probe slot 0 just wrote"), text
        assert "--store s3://bucket/prefix" in text and "--slot-store" in text
