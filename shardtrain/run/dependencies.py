"""What a run needs from its store besides its start commit, checked before any update (issue 23).

A run that resumes at commit C needs, besides C's own closure:

- the frozen reference of every cohort it will still train that distils (``distill``):
  the job's seed (the run's ``init`` commit at the root of C's chain, or the imported
  seed commit) or an earlier cohort's endpoint, found on C's chain of commits as the
  distiller finds it; a reference the run itself will commit (an endpoint after C) is
  not needed yet;
- every commit on C's chain down to those references (the walk reads their manifests).

`missing_dependencies` lists what of that the store lacks, with what each commit is for;
`check_dependencies` refuses (ResumeError, exit 5) naming them and the command that brings
them: ``shardstore copy SOURCE STORE C --with-deps``, which copies C with the commits the
pin ``references/<job id>`` names. A run keeps that pin (`pin_references`): the seed, the
init commit and every cohort endpoint it commits, as each lands.

`check_shared_store` makes sure every worker's run store is one store: slot 0 writes a
probe under ``tmp/`` and every worker must find it; workers whose ``--store`` is a private
directory of their own host are refused before training, instead of failing mid-commit.
"""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from shardstore import LoadedCommit, Store, load_commit
from shardstore.errors import ObjectNotFound, ShardstoreError
from shardstore.ops.transfer import commit_closure
from shardtrain.errors import ResumeError
from shardtrain.job.job import PreparedJob

__all__ = ["REFERENCES_PIN", "missing_dependencies", "check_dependencies", "pin_references", "check_shared_store"]

REFERENCES_PIN = "references/{job}"


def _present(store: Store, cid: str) -> bool:
    """Whether commit ``cid`` and every object of its closure are in ``store`` (manifests read, data looked up)."""
    try:
        closure = commit_closure(load_commit(store, cid))
    except ObjectNotFound:
        return False
    with ThreadPoolExecutor(max_workers=16) as pool:
        return all(pool.map(store.has, sorted(closure.data)))


def missing_dependencies(store: Store, job: PreparedJob, start: LoadedCommit | None, until: int) -> list[str]:
    """One line per commit the run needs that ``store`` lacks (see module docstring)."""
    if (
        job.job.seed.kind == "import"
        and job.job.seed.commit is not None
        and (start is None or start.commit.transition != "import")
    ):
        if not _present(store, job.job.seed.commit):
            return [f"commit {job.job.seed.commit} (the job's imported seed commit)"]
    if start is None or start.commit.transition == "import":
        return []
    first = start.commit.step
    cohorts = list(dict.fromkeys(s.cohort for s in job.job.schedule.steps[first:until]))
    missing: list[str] = []
    for cohort in cohorts:
        ref = job.reference_of(cohort)
        if ref is None or (ref.source == "seed" and job.job.seed.kind == "import"):
            continue  # no reference, or the imported seed checked above
        want = None if ref.source == "seed" else job.cohort_end(ref.of or "")
        if want is not None and want > first:
            continue  # this run commits it before cohort `cohort` trains
        what = "the seed" if want is None else f"cohort {ref.of}'s endpoint (step {want})"
        cid: str | None = start.id
        while cid is not None:
            try:
                c = store.commit(cid)
            except ObjectNotFound:
                missing.append(
                    f"commit {cid} (on the chain from {start.id[:12]} to cohort {cohort}'s reference, {what})"
                )
                break
            if (want is None and (c.parent is None or c.transition in ("init", "import"))) or c.step == want:
                if not _present(store, cid):
                    missing.append(f"commit {cid} (cohort {cohort}'s frozen reference, {what}): objects missing")
                break
            cid = c.parent
    return list(dict.fromkeys(missing))


def check_dependencies(store: Store, job: PreparedJob, start: LoadedCommit | None, until: int) -> None:
    """ResumeError naming every commit the run needs that ``store`` lacks, and the command that brings them."""
    missing = missing_dependencies(store, job, start, until)
    if missing:
        target = start.id if start is not None else job.job.seed.commit
        raise ResumeError(
            f"store {store.url} lacks commits this run depends on, refused before training: "
            f"{'; '.join(missing)}; bring them with: shardstore copy SOURCE_STORE {store.url} {target} "
            f"--with-deps (or copy each commit named)"
        )


def pin_references(store: Store, job: PreparedJob, commits: list[str]) -> None:
    """Add ``commits`` (the seed, the init commit, cohort endpoints) to the job's references pin."""
    if commits:
        store.add_to_pin(REFERENCES_PIN.format(job=job.id), commits, attempts=14)


def check_shared_store(store: Store, rank: int, world: int) -> None:
    """Collective: ResumeError on every worker unless all of them see the probe slot 0 wrote.

    The probe is a scratch key under ``tmp/`` (never an object: it must leave the store as
    it was), removed by slot 0 once every worker has looked."""
    if world == 1:
        return
    token = bytearray(32)
    if rank == 0:
        token[:] = secrets.token_hex(16).encode()
        try:
            store.storage.write_once(f"tmp/probe-shardtrain-{token.decode()}", b"")
            store.sync()
        except (ShardstoreError, OSError):
            token[:] = b"0" * 32  # nobody will find it: every worker refuses below, slot 0 with the others
    probe = torch.tensor(list(token), dtype=torch.uint8)
    dist.broadcast(probe, src=0)
    key = f"tmp/probe-shardtrain-{bytes(probe.tolist()).decode()}"
    try:
        seen = store.storage.exists(key)
    except (ShardstoreError, OSError):
        seen = False
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(flags, torch.tensor([int(seen)], dtype=torch.int64))
    if rank == 0:
        try:
            store.storage.delete(key)
        except (ShardstoreError, OSError):
            pass  # a stale probe under tmp/ is harmless; gc removes it
    blind = [r for r, f in enumerate(flags) if not int(f.item())]
    if blind:
        raise ResumeError(
            f"slot(s) {blind} cannot see the probe slot 0 just wrote to its run store (slot {rank}'s is "
            f"{store.url}): the workers were given different stores (a private directory on each host?). "
            f"Every commit goes to the run's store, so all nodes need one shared store: pass the same "
            f"--store s3://bucket/prefix (or a shared filesystem) on every node; per-host copies are for "
            f"restoring only (shardstore copy --slot K, then --slot-store K=DIR)"
        )
