"""Background commits over real Gloo: the same commit ids as synchronous commits (and the
synchronous schedule), and a worker lost while a commit is being written.

One module-scoped set of runs of a 2-worker job whose batches of 5 rows split into
microbatches of 2, 2 and 1: the reference trains to step 4 with the synchronous schedule
and synchronous commits; a second run from scratch (overlapped schedule, background
commits) loses worker 1 as the commit of step 2 reaches its acknowledgement, after the
coordinator wrote the commit manifest; the replay resumes from the run's ref.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import shardstore
from shardstore import open_store
from shardtrain.errors import JobError, RunAborted
from shardtrain.job.default_job import prepare_default
from shardtrain.run.committer import COMMIT_FAULT_ENV
from shardtrain.run.lifecycle import RunSpec, train

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    home = tmp_path_factory.mktemp("committer")
    job = prepare_default(home / "job", steps_a=4, steps_b=1, batch_size=5, microbatch_size=2, eval_per_set=2)
    reference = train(
        RunSpec(job=job, store=str(home / "reference"), until=4, every=2, schedule="synchronous", async_commits=False),
        2,
        timeout=TIMEOUT,
    )
    url = str(home / "store")
    with pytest.raises(RunAborted) as crash:
        train(
            RunSpec(job=job, store=url, until=4, every=2, message_timeout=20),
            2,
            timeout=TIMEOUT,
            env={COMMIT_FAULT_ENV: "slot=1,step=2,phase=acknowledge"},
        )
    store = open_store(url)
    refs_after_crash = store.refs()
    ids = {c.step: c.id for c in reference[0].commits}
    had_step2_manifest = store.has(ids[2])  # before the replay writes it again
    replay = train(RunSpec(job=job, store=url, until=4, every=2, resume="main"), 2, timeout=TIMEOUT)
    return SimpleNamespace(
        job=job,
        reference=ids,
        crash=crash.value,
        store=store,
        refs_after_crash=refs_after_crash,
        had_step2_manifest=had_step2_manifest,
        replay=replay,
    )


def test_a_worker_lost_mid_commit_leaves_the_ref_on_the_previous_commit(runs: SimpleNamespace) -> None:
    c0, c2 = runs.reference[0], runs.reference[2]
    message = str(runs.crash)
    assert "worker 1: exited with code 3" in message
    assert f"the last committed step is 0 (commit {c0})" in message
    assert runs.refs_after_crash == {"main": c0}
    # The coordinator had written the step-2 commit manifest (the same bytes as the reference's),
    # but not every slot acknowledged it, so no ref named it.
    assert runs.had_step2_manifest and c2 not in runs.refs_after_crash.values()


def test_replay_after_the_lost_commit_reproduces_the_uninterrupted_ids(runs: SimpleNamespace) -> None:
    """Overlapped schedule + background commits give the synchronous run's ids, bit for bit."""
    assert [c.step for c in runs.replay[0].commits] == [2, 4]
    assert all(r.commits == runs.replay[0].commits for r in runs.replay)
    assert {c.step: c.id for c in runs.replay[0].commits} == {2: runs.reference[2], 4: runs.reference[4]}
    assert runs.store.ref("main") == runs.reference[4]
    lc = shardstore.load_commit(runs.store, runs.reference[4])
    assert lc.commit.parent == runs.reference[2] and shardstore.verify(runs.store).ok


def test_a_malformed_commit_fault_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardtrain.run.committer import commit_fault_from_env

    monkeypatch.setenv(COMMIT_FAULT_ENV, "slot=1,step=2,phase=later")
    with pytest.raises(JobError, match="phase must be one of"):
        commit_fault_from_env()
    monkeypatch.setenv(COMMIT_FAULT_ENV, "slot=1,phase=acknowledge")
    with pytest.raises(JobError, match="expected slot=S,step=N,phase=P"):
        commit_fault_from_env()
