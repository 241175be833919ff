"""One trained store shared by the regroup and grow tests (multi-worker runs are the expensive part).

`adaptive_run` trains a tiny job uninterrupted on 2 workers (a commit after every update),
then, from that run's commits: regroups step 1 onto 3 workers and trains 2 updates there
(the new slot 2 restoring from a "host" that received only its objects with `copy --shard`),
regroups the result back onto 2 workers and trains 1 more; grows step 4 by one identity
block and trains it to the end on 2 workers and, through `train`'s own regroup, on 3.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from shardstore import copy_commit, open_store
from shardtrain.job.default_job import prepare_default
from shardtrain.reshape.grow import grow
from shardtrain.reshape.regroup import regroup
from shardtrain.run.lifecycle import RunSpec, train

TIMEOUT = 60.0


def object_files(root: Path) -> set[str]:
    """Every object file in a local store (names are ids), counted on disk."""
    return {p.name for p in (root / "objects").rglob("*") if p.is_file()}


@pytest.fixture(scope="session")
def adaptive_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    home = tmp_path_factory.mktemp("adaptive")
    # No declared replay, so no distillation term: the grow test's single-process reference is cross-entropy only.
    job = prepare_default(
        home / "job", steps_a=4, steps_b=2, batch_size=4, microbatch_size=2, eval_per_set=2, replay_per_step=0
    )
    url = str(home / "store")
    store = open_store(url)

    def run(workers: int, until: int, ref: str, resume: str | None = None, **kw: object) -> list:  # type: ignore[type-arg]
        return train(
            RunSpec(job=job, store=url, until=until, every=1, resume=resume, ref=ref, **kw),  # type: ignore[arg-type]
            workers,
            timeout=TIMEOUT,
        )

    straight = run(2, 6, "main")
    u = {c.step: c.id for c in straight[0].commits}
    files = [object_files(Path(url))]
    to3 = regroup(store, u[1], workers=3)
    files.append(object_files(Path(url)))
    host = open_store(str(home / "host2"))  # the new worker's host: only slot 2's objects
    copied = copy_commit(store, host, to3.commit, slot=2)
    wide = run(3, 3, "wide", to3.commit, slot_stores=((2, host.url),))
    w = {c.step: c.id for c in wide[0].commits}
    files.append(object_files(Path(url)))
    to2 = regroup(store, w[3], workers=2)
    files.append(object_files(Path(url)))
    narrow = run(2, 4, "narrow", to2.commit)
    n = {c.step: c.id for c in narrow[0].commits}
    grown = grow(store, u[4], 1)
    g2 = run(2, 6, "grown2", grown.commit)
    g3 = run(3, 6, "grown3", grown.commit)  # a 2-slot commit on 3 workers: train writes the repartition commit
    # The default recipe distils on declared replay (cohort B toward the end of cohort A): regroup
    # the end of cohort A onto 3 workers and train cohort B there, beside 2 workers uninterrupted.
    djob = prepare_default(home / "djob", steps_a=4, steps_b=2, batch_size=4, microbatch_size=2, eval_per_set=2)
    durl = str(home / "dstore")
    dstraight = train(RunSpec(job=djob, store=durl, until=6, every=1), 2, timeout=TIMEOUT)
    d4 = next(c.id for c in dstraight[0].commits if c.step == 4)
    dwide = train(RunSpec(job=djob, store=durl, until=6, every=1, resume=d4, ref="wide"), 3, timeout=TIMEOUT)
    return SimpleNamespace(
        dstore=open_store(durl),
        dstraight=dstraight,
        dwide=dwide,
        home=home,
        job=job,
        url=url,
        store=store,
        straight=straight,
        u=u,
        to3=to3,
        host=host,
        copied=copied,
        wide=wide,
        w=w,
        to2=to2,
        narrow=narrow,
        n=n,
        files=files,
        grown=grown,
        g2=g2,
        g3=g3,
    )
