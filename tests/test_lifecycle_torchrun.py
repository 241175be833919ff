"""Under `torchrun --max-restarts`, a lost worker restarts the whole group, which resumes from
the one commit the run's ref names (`--resume auto`), and the run ends on the same commit as
an uninterrupted one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import shardstore
from shardtrain.workers.launch import free_port


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_torchrun_restart_resumes_from_the_runs_ref(tmp_path: Path) -> None:
    prep = _run("-m", "shardstore_cli.shardtrain_cli", "prepare", "--out", str(tmp_path / "job"), "--steps-a", "4", "--steps-b", "1")
    assert prep.returncode == 0, prep.stderr
    job = str(tmp_path / "job" / "job.json")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1",
           # worker 1 dies in step 3 (after committing step 2), on the first attempt only
           "SHARDTRAIN_FAULT": "slot=1,step=3,microbatch=0,attempt=0"}
    cmd = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "shardstore_cli.shardtrain_cli", "train",
           "--prepared", job, "--store", str(tmp_path / "restarted"), "--until", "4", "--every", "2",
           "--resume", "auto", "--timeout", "20"]
    restarted = _run(*cmd, env=env)
    assert restarted.returncode == 0, restarted.stderr[-4000:]
    assert "run aborted during step 3" in restarted.stderr and "the last committed step is 2" in restarted.stderr

    plain = _run("-m", "shardstore_cli.shardtrain_cli", "train", "--prepared", job, "--store", str(tmp_path / "plain"),
                 "--until", "4", "--every", "2")
    assert plain.returncode == 0, plain.stderr[-3000:]
    a, b = (shardstore.open_store(str(tmp_path / d)) for d in ("restarted", "plain"))
    assert a.ref("main") == b.ref("main")
    chain = []
    cur = a.ref("main")
    while cur is not None:
        chain.append(a.commit(cur).step)
        cur = a.commit(cur).parent
    assert chain == [4, 2, 0]  # the restarted group continued the same line of commits
    assert shardstore.verify(a).ok
