"""Under `torchrun --max-restarts`, a lost worker restarts the whole group, which resumes from
the one commit the run's ref names (`--resume auto`), and the run ends on the same commit as
an uninterrupted one: here with two nodes (two torchrun agents, one worker each, a c10d
rendezvous on 127.0.0.1) and a worker lost on each node in turn.

Each node's agent counts only its own workers' failures (TORCHELASTIC_RESTART_COUNT), and
the agent of node rank 0 keeps the workers' store of earlier rounds: before the workers
agreed on their keys through the store (`shardtrain.launch.attempt_prefix`), the restarted
nodes waited under different per-count prefixes until they timed out (issue 23). A lost
node replaced by a fresh agent is tested in tests/test_multihost.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardstore
from shardtrain.workers.launch import free_port


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def agent_command(job: str, store: str, port: int, *, is_host: bool, until: int = 4) -> list[str]:
    """One node's torchrun agent of a two-node job (one worker per node)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "two-nodes",
        "--rdzv-conf",
        f"is_host={str(is_host).lower()}",
        "--monitor-interval",
        "0.2",
        "-m",
        "shardstore_cli.shardtrain_cli",
        "train",
        "--prepared",
        job,
        "--store",
        store,
        "--until",
        str(until),
        "--every",
        "1",
        "--resume",
        "auto",
        "--timeout",
        "20",
    ]


@pytest.mark.e2e
def test_two_node_restarts_resume_from_the_runs_ref(tmp_path: Path) -> None:
    prep = _run(
        "-m",
        "shardstore_cli.shardtrain_cli",
        "prepare",
        "--out",
        str(tmp_path / "job"),
        "--steps-a",
        "4",
        "--steps-b",
        "1",
    )
    assert prep.returncode == 0, prep.stderr
    job = str(tmp_path / "job" / "job.json")
    store, port = str(tmp_path / "restarted"), free_port()
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}
    # Node A's worker dies in step 2 while node B's hangs (so node B's agent stops it: a
    # membership change, which its restart count does not count); in the restarted group
    # node B's worker dies in step 3.
    a_env = {**env, "SHARDTRAIN_FAULT": f"slot=*,step=2,microbatch=0,once={tmp_path / 'lost-a'}"}
    b_env = {
        **env,
        "SHARDTRAIN_FAULT": f"slot=*,step=2,microbatch=0,once={tmp_path / 'hung-b'},hang=1;"
        f"slot=*,step=3,microbatch=0,once={tmp_path / 'lost-b'}",
    }
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]  # files, not pipes: a full pipe would block an agent
    agents = [
        subprocess.Popen(
            agent_command(job, store, port, is_host=host), env=e, stdout=log.open("w"), stderr=subprocess.STDOUT
        )
        for host, e, log in ((True, a_env, logs[0]), (False, b_env, logs[1]))
    ]
    try:
        codes = [p.wait(timeout=240) for p in agents]
    finally:
        for p in agents:
            p.kill()
    assert codes == [0, 0], "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    assert all((tmp_path / f).exists() for f in ("lost-a", "hung-b", "lost-b"))  # every fault fired

    plain = _run(
        "-m",
        "shardstore_cli.shardtrain_cli",
        "train",
        "--prepared",
        job,
        "--store",
        str(tmp_path / "plain"),
        "--until",
        "4",
        "--every",
        "1",
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    s, p = (shardstore.open_store(str(tmp_path / d)) for d in ("restarted", "plain"))
    assert s.ref("main") == p.ref("main")
    chain = []
    cur = s.ref("main")
    while cur is not None:
        chain.append(s.commit(cur).step)
        cur = s.commit(cur).parent
    assert chain == [4, 3, 2, 1, 0]  # the restarted groups continued one line of commits
    assert shardstore.verify(s).ok
