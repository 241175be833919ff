"""A job's files and two commits of it in a store, shared by the roles tests
(tests/shardtrain/job/test_roles.py) and the gate command's test (tests/shardtrain/run/test_gates.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import shardstore
from shardtrain.engine.partition import Partition, build_stage
from shardtrain.job.default_job import prepare_default
from shardtrain.job.job import load_job
from shardtrain.run.evaluate import EvalSpec, evaluate
from shardtrain.run.lifecycle import store_job_files


@pytest.fixture(name="run")
def roles_run(tmp_path: Path) -> SimpleNamespace:
    """A job's files and two commits of it in a store (saved in this process: no training needed)."""
    job = load_job(
        prepare_default(
            tmp_path / "job", steps_a=2, steps_b=1, batch_size=4, replay_per_step=1, eval_per_set=4, retention_per_set=2
        )
    )
    store = shardstore.open_store(str(tmp_path / "store"))
    store_job_files(job, store)
    commits = []
    for step, seed in ((0, 1), (1, 2)):
        model = build_stage(job.config, Partition.even(job.config.num_hidden_layers, 1), 0, seed=seed)
        commits.append(
            shardstore.save(
                store,
                model,
                step=step,
                job=job.id,
                config=job.hf_config(),
                rng=False,
                transition="init" if step == 0 else "train",
            )
        )
    return SimpleNamespace(job=job, store=store, commits=commits, url=str(tmp_path / "store"))


def eval_role(run: SimpleNamespace, role: str):  # type: ignore[no-untyped-def]
    """The in-process evaluation of ``run``'s commits in ``role``."""
    spec = EvalSpec(store=run.url, commits=tuple(run.commits), cases_per_set=1, max_new_tokens=2, role=role)
    return evaluate(spec, 1, in_process=True)
