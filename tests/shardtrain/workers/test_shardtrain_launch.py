"""Launching: torchrun's environment, the local launcher, and failure reporting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from shardtrain_helpers import (
    DETERMINISTIC_ENV,
    aborting_worker,
    environment_worker,
    failing_worker,
    job_spec,
    lingering_thread_worker,
    read_results,
    train_worker,
)

from shardtrain import LaunchError, WorkerFailedError, free_port, init_from_env, launch_local
from shardtrain.errors import ResumeError, RunAborted, qualified_name
from shardtrain.run.lifecycle import raise_failure
from shardtrain.workers.launch import WorkerContext

# tests/shardtrain_helpers.py, a script here; run from the repository root (its directory, tests/, holds
# tests/shardtrain/, which would hide the shardtrain package from a process that has only tests/ on its path).
REPO = Path(__file__).resolve().parents[3]
HELPERS = REPO / "tests" / "shardtrain_helpers.py"


def test_missing_torchrun_variables_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(
        LaunchError,
        match=r"missing launch environment variables \['WORLD_SIZE', 'LOCAL_RANK', "
        r"'MASTER_ADDR', 'MASTER_PORT'\]",
    ):
        init_from_env()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "x"}, "must be integers"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "invalid RANK=2 / WORLD_SIZE=2"),
    ],
)
def test_invalid_torchrun_variables(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    base = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in {**base, **env}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(LaunchError, match=message):
        init_from_env()


def test_worker_exceptions_reach_the_caller() -> None:
    with pytest.raises(WorkerFailedError) as info:
        launch_local(failing_worker, 2, (1,), env=DETERMINISTIC_ENV, timeout=timedelta(seconds=30), join_timeout=90)
    assert list(info.value.failures) == [1]
    assert info.value.failures[1].startswith("ValueError: boom on rank 1")
    # What it raised is recorded by class, for routing: a ValueError, not a LaunchError.
    assert info.value.ranks_raising(ValueError) == [1] and info.value.ranks_raising(LaunchError) == []
    with pytest.raises(LaunchError):
        launch_local(failing_worker, 0)


class StartRefused(ResumeError):
    """A refusal class the lifecycle does not list by name: routed by its base."""


class ResumeErrorLookalike(ValueError):
    """Named like a refusal, but no ResumeError."""


def _refusing_worker(ctx: WorkerContext) -> None:
    raise StartRefused(f"slot {ctx.rank} refuses its start")


def _mro(cls: type) -> tuple[str, ...]:
    return tuple(qualified_name(c) for c in cls.__mro__)


def test_failures_are_routed_by_the_class_raised_not_by_the_text() -> None:
    """Before, the lifecycle routed by the first word of each worker's text: a subclass of
    ResumeError raised by every worker was not a refused start, and a ValueError whose class
    name began with "ResumeError" was one."""
    with pytest.raises(WorkerFailedError) as info:
        launch_local(_refusing_worker, 1, env=DETERMINISTIC_ENV, timeout=timedelta(seconds=30), join_timeout=90)
    assert info.value.ranks_raising(ResumeError) == [0] and info.value.ranks_raising(RunAborted) == []
    with pytest.raises(ResumeError, match="slot 0 refuses its start"):
        raise_failure(info.value)
    lookalike = WorkerFailedError(
        {0: "ResumeErrorLookalike: no", 1: "ResumeErrorLookalike: no"},
        {0: _mro(ResumeErrorLookalike), 1: _mro(ResumeErrorLookalike)},
    )
    with pytest.raises(WorkerFailedError):
        raise_failure(lookalike)
    lost = WorkerFailedError({0: "RunAborted: slot 0: run aborted", 1: "exited with code 3"}, {0: _mro(RunAborted)})
    with pytest.raises(RunAborted, match="worker 1: exited with code 3"):
        raise_failure(lost)


def test_a_worker_killed_by_a_signal_is_named_with_its_python_stack_and_when(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(WorkerFailedError) as info:
        launch_local(
            aborting_worker,
            2,
            (1,),
            env=DETERMINISTIC_ENV,
            timeout=timedelta(seconds=10),
            join_timeout=90,
            failure_grace=15,
        )
    assert info.value.failures[1] == "killed by SIGABRT (exit code -6)"
    assert 0 not in info.value.failures  # the survivor finished its own work and was not blamed
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "in aborting_worker" in err
    with pytest.raises(WorkerFailedError) as info:
        launch_local(
            aborting_worker, 2, (0, True), env=DETERMINISTIC_ENV, timeout=timedelta(seconds=10), join_timeout=90
        )
    assert info.value.failures == {0: "finished its work, then killed by SIGABRT (exit code -6) while shutting down"}


def test_a_worker_waits_for_threads_it_left_running(tmp_path: Path) -> None:
    """Workers skip interpreter shutdown when they finish, but not the threads they started."""
    launch_local(
        lingering_thread_worker,
        2,
        (str(tmp_path),),
        env=DETERMINISTIC_ENV,
        timeout=timedelta(seconds=30),
        join_timeout=90,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late-0.txt", "late-1.txt"]


@pytest.mark.long  # .ci/run's second step (the README's test command keeps its 8 minutes)
def test_run_worker_teardown_leaves_no_group_threads(tmp_path: Path) -> None:
    """After `run_worker` returns, the group's native threads are gone, even when the worker
    imported torch._dynamo after the group existed (a torch optimizer does). Left running,
    a Gloo thread can need the GIL during interpreter shutdown, which aborts the process
    ("terminate called without an active exception"); the CI failure this guards against."""
    port = str(free_port())
    code = "import json, shardtrain_helpers as h; print(json.dumps(h.threads_left_after_run_worker()))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "PYTHONPATH": str(HELPERS.parent),
            },
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        left = json.loads(out.strip().splitlines()[-1])
        assert not {"pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv"} & set(left), left


@pytest.mark.long  # .ci/run's second step (the README's test command keeps its 8 minutes)
def test_torchrun_path_matches_the_local_launcher(tmp_path: Path) -> None:
    """Two workers under torchrun train bitwise like one worker under the local launcher."""
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "local").mkdir()
    ranges = [(0, 2), (2, 4)]
    env = {**os.environ, **DETERMINISTIC_ENV, "PYTHONPATH": str(REPO)}
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
        str(HELPERS),
        job_spec(tmp_path / "torchrun", ranges=ranges, steps=2),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launch_local(
        train_worker,
        1,
        (job_spec(tmp_path / "local", ranges=[(0, 4)], steps=2),),
        env=DETERMINISTIC_ENV,
        timeout=timedelta(seconds=60),
        join_timeout=120,
    )
    a, a_meta = read_results(tmp_path / "torchrun", 2)
    b, b_meta = read_results(tmp_path / "local", 1)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)
    assert a_meta[0]["results"] == b_meta[0]["results"]


def test_forked_workers_see_what_spawned_workers_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Workers forked from the server get the launcher's environment as it is *now* (not the
    server's), the launch's extra variables, and the launcher's current stdout; a launch
    whose import-time variables differ from the server's is spawned instead, and one that
    differs only in a variable torch reads at run time (lightning's) is still forked."""
    from shardtrain.workers import forkserver

    if not forkserver.start(DETERMINISTIC_ENV):
        pytest.skip("no forkserver here")
    assert forkserver.context(DETERMINISTIC_ENV).get_start_method() == "forkserver"
    assert forkserver.context({**DETERMINISTIC_ENV, "OMP_NUM_THREADS": "2"}).get_start_method() == "spawn"
    assert forkserver.context({**DETERMINISTIC_ENV, "ATEN_CPU_CAPABILITY": "avx2"}).get_start_method() == "spawn"
    nvml = {
        **DETERMINISTIC_ENV,
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
    }  # what importing lightning sets: read at run time
    assert forkserver.context(nvml).get_start_method() == "forkserver"
    monkeypatch.setenv("SHARDTRAIN_TEST_SET_AFTER_THE_SERVER", "parent")
    monkeypatch.delenv("SHARDTRAIN_TEST_REMOVED", raising=False)
    names = [
        "SHARDTRAIN_TEST_SET_AFTER_THE_SERVER",
        "SHARDTRAIN_TEST_EXTRA",
        "SHARDTRAIN_TEST_REMOVED",
        "ATEN_CPU_CAPABILITY",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
    ]
    launch_local(
        environment_worker,
        2,
        (str(tmp_path), names),
        env={**nvml, "SHARDTRAIN_TEST_EXTRA": "launch"},
        timeout=timedelta(seconds=30),
        join_timeout=90,
    )
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"env-{rank}.json").read_text())
        assert seen == {
            "rank": str(rank),
            "env": {
                "SHARDTRAIN_TEST_SET_AFTER_THE_SERVER": "parent",
                "SHARDTRAIN_TEST_EXTRA": "launch",
                "SHARDTRAIN_TEST_REMOVED": None,
                "ATEN_CPU_CAPABILITY": "default",
                "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
            },
        }, seen
    out = capfd.readouterr().out
    assert "worker 0 says hello on stdout" in out and "worker 1 says hello on stdout" in out
