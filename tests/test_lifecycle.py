"""The lifecycle end to end over real Gloo in fresh worker processes: commit, crash, replace, replay.

One module-scoped run does what the seed study did at toy scale: train to step 8
committing every 4; a fresh group restores step 4 and loses worker 1 during step 6 (after
microbatch 0's forward, before the update); a replacement fetches only slot 1's objects
into its own store; survivor and replacement restore step 4 and replay to step 8. The
rejection tests then try to start runs that must be refused before any update.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

import shardstore
from shardstore import BindingError, ObjectNotFound, copy_commit, open_store
from shardstore.ops.transfer import commit_closure
from shardtrain.errors import JobError, ResumeError, RunAborted
from shardtrain.job.default_job import prepare_default
from shardtrain.job.job import JOB_FILE, decode_job, load_job
from shardtrain.job.tokenizer import TEMPLATE_FILE
from shardtrain.run.evaluate import EvalSpec, evaluate
from shardtrain.run.lifecycle import FAULT_ENV, RunSpec, train

TIMEOUT = 30.0


def _job(path: Path, **kw: object) -> str:
    return prepare_default(path, steps_a=8, steps_b=4, batch_size=4, microbatch_size=2, eval_per_set=4, **kw)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    home = tmp_path_factory.mktemp("lifecycle")
    job = _job(home / "job")
    store_url = str(home / "store")
    results = train(RunSpec(job=job, store=store_url, until=8, every=4), 2, timeout=TIMEOUT)
    commits = {c.step: c.id for c in results[0].commits}
    start = time.monotonic()
    with pytest.raises(RunAborted) as crash:
        train(
            RunSpec(job=job, store=store_url, until=8, every=4, resume=commits[4], ref="replay", message_timeout=20),
            2,
            timeout=TIMEOUT,
            env={FAULT_ENV: "slot=1,step=6,microbatch=0"},
        )
    crash_seconds = time.monotonic() - start
    store = open_store(store_url)
    refs_after_crash = store.refs()
    host_url = str(home / "host1")
    copied = copy_commit(store, open_store(host_url), commits[4], slot=1)
    replay = train(
        RunSpec(
            job=job, store=store_url, until=8, every=4, resume=commits[4], ref="replay", slot_stores=((1, host_url),)
        ),
        2,
        timeout=TIMEOUT,
    )
    return SimpleNamespace(
        home=home,
        job=job,
        store=store,
        commits=commits,
        results=results,
        crash=crash.value,
        crash_seconds=crash_seconds,
        refs_after_crash=refs_after_crash,
        host=open_store(host_url),
        copied=copied,
        replay=replay,
    )


def test_replay_reproduces_the_uninterrupted_commit(run: SimpleNamespace) -> None:
    assert [c.step for c in run.results[0].commits] == [0, 4, 8]
    assert all(r.commits == run.results[0].commits for r in run.results)  # every worker acknowledged the same ids
    assert {c.step: c.id for c in run.replay[0].commits} == {8: run.commits[8]}
    assert run.store.ref("replay") == run.store.ref("main") == run.commits[8]
    # The identical id covers Adam moments and ages, the data cursor and every slot's RNG state:
    lc = shardstore.load_commit(run.store, run.commits[8])
    assert lc.commit.parent == run.commits[4] and lc.commit.data_cursor == 8 * 4 and lc.commit.transition == "train"
    for slot, shard in lc.shards.items():
        assert {r.kind for r in shard.rng} >= {"python", "numpy", "torch"}
        assert all(e.optim is not None and e.optim.age == 8 and e.optim.exp_avg is not None for e in shard.entries)
    # ...and the replayed losses are bitwise those of the uninterrupted run.
    ref_losses = {s.step: (s.loss, s.grad_norm) for s in run.results[0].steps}
    assert {s.step: (s.loss, s.grad_norm) for s in run.replay[0].steps} == {k: ref_losses[k] for k in (5, 6, 7, 8)}


def test_lost_worker_aborts_the_group_naming_the_last_commit(run: SimpleNamespace) -> None:
    message = str(run.crash)
    assert "slot 0: run aborted during step 6" in message
    assert f"the last committed step is 4 (commit {run.commits[4]})" in message
    assert "worker 1: exited with code 3" in message
    assert run.crash_seconds < 25, run.crash_seconds
    assert "replay" not in run.refs_after_crash  # nothing uncommitted reached a ref
    assert run.refs_after_crash["main"] == run.commits[8]


def test_replacement_fetched_only_its_slot(run: SimpleNamespace) -> None:
    lc = shardstore.load_commit(run.store, run.commits[4])
    slot1 = commit_closure(lc, slot=1).data
    assert run.copied.objects_copied == len(slot1) + len(lc.shard_ids) + 1  # + the manifests
    assert all(run.host.has(o) for o in slot1)
    slot0_only = {e.param for e in lc.shards[0].entries} - set(slot1)
    assert slot0_only and not any(run.host.has(o) for o in slot0_only)
    assert not run.host.has(lc.shards[0].entries[0].param)


def test_generation_through_the_shards_matches_one_process(run: SimpleNamespace) -> None:
    two = evaluate(
        EvalSpec(store=str(run.home / "store"), commits=("replay",), cases_per_set=2, max_new_tokens=8),
        2,
        timeout=TIMEOUT,
    )
    one = evaluate(
        EvalSpec(
            store=str(run.home / "store"), commits=(run.commits[8],), job=run.job, cases_per_set=2, max_new_tokens=8
        ),
        1,
        in_process=True,
    )
    assert two.commits[0].commit == one.commits[0].commit == run.commits[8]
    assert [c.tokens for c in two.commits[0].cases] == [c.tokens for c in one.commits[0].cases]
    assert len(two.commits[0].cases) == 2 and all(c.tokens for c in two.commits[0].cases)  # dev_task only
    for a, b in zip(two.commits[0].losses, one.commits[0].losses):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)


# -- rejections: each start below must be refused before any update ---------------------------------


def _copy_store(run: SimpleNamespace, name: str, target: str) -> shardstore.Store:
    bad = open_store(str(run.home / name))
    copy_commit(run.store, bad, target, with_deps=True)  # with its frozen references: a resume needs them
    return bad


def _object_path(store: shardstore.Store, oid: str) -> Path:
    return Path(store.url.removeprefix("file://")) / "objects" / oid[:2] / oid


def test_corrupt_shard_object_is_refused_by_every_worker(run: SimpleNamespace) -> None:
    bad = _copy_store(run, "corrupt", run.commits[4])
    lc = shardstore.load_commit(bad, run.commits[4])
    victim = lc.shards[1].entries[-1]
    path = _object_path(bad, victim.param)
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[7] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ResumeError) as info:
        train(RunSpec(job=run.job, store=bad.url, until=8, resume=run.commits[4], ref="x"), 2, timeout=TIMEOUT)
    message = str(info.value)
    assert "CorruptObject" in message and victim.param in message and victim.name in message
    assert "slot 0: slot(s) [1] could not restore the start commit; nothing was trained" in message
    assert bad.ref("x") is None


def test_shard_manifest_from_another_commit_is_refused(run: SimpleNamespace) -> None:
    bad = _copy_store(run, "forged", run.commits[8])
    copy_commit(run.store, bad, run.commits[4])
    c8, c4 = (shardstore.load_commit(bad, run.commits[s]) for s in (8, 4))
    layout = (c8.commit.layout[0], msgspec.structs.replace(c8.commit.layout[1], shard=c4.shard_ids[1]))
    forged = bad.put_manifest(msgspec.structs.replace(c8.commit, layout=layout))
    with pytest.raises(BindingError, match=f"commit {forged}, shard manifest {c4.shard_ids[1]}: shard's step is 4"):
        train(RunSpec(job=run.job, store=bad.url, until=8, resume=forged, ref="x"), 2, timeout=TIMEOUT)


def test_missing_shard_manifest_is_refused(run: SimpleNamespace) -> None:
    bad = _copy_store(run, "missing", run.commits[4])
    sid = shardstore.load_commit(bad, run.commits[4]).shard_ids[1]
    _object_path(bad, sid).unlink()
    with pytest.raises(ObjectNotFound, match=f"commit {run.commits[4]}, slot 1"):
        train(RunSpec(job=run.job, store=bad.url, until=8, resume=run.commits[4], ref="x"), 2, timeout=TIMEOUT)


def test_another_job_is_refused(run: SimpleNamespace) -> None:
    other = _job(run.home / "other-job", data_seed=1)
    with pytest.raises(ResumeError, match=f"commit {run.commits[4][:12]} was made by job .*not by this job"):
        train(RunSpec(job=other, store=run.store.url, until=8, resume=run.commits[4], ref="x"), 2, timeout=TIMEOUT)


def test_a_changed_tokenizer_asset_is_refused(run: SimpleNamespace, tmp_path: Path) -> None:
    job_dir = Path(run.job).parent
    for f in job_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    template = tmp_path / TEMPLATE_FILE
    template.write_bytes(template.read_bytes().replace(b"<|end|>{% endfor %}", b"<|end|>\n{% endfor %}"))
    with pytest.raises(JobError, match=f"tokenizer asset {TEMPLATE_FILE} differs from the one the job binds"):
        train(RunSpec(job=str(tmp_path / JOB_FILE), store=run.store.url, until=8, resume=run.commits[4], ref="x"), 2)
    # Rebinding the job file to the new template makes it another job, which the commit refuses.
    job = decode_job((tmp_path / JOB_FILE).read_bytes())
    asset = next(a for a in job.tokenizer if a.name == TEMPLATE_FILE)
    import blake3

    data = template.read_bytes()
    fixed = msgspec.structs.replace(asset, blake3=blake3.blake3(data).hexdigest(), size=len(data))
    job = msgspec.structs.replace(job, tokenizer=tuple(fixed if a is asset else a for a in job.tokenizer))
    (tmp_path / JOB_FILE).write_bytes(msgspec.json.Encoder(order="sorted").encode(job))
    assert load_job(tmp_path / JOB_FILE).id != load_job(run.job).id
    with pytest.raises(ResumeError, match="was made by job"):
        train(RunSpec(job=str(tmp_path / JOB_FILE), store=run.store.url, until=8, resume=run.commits[4], ref="x"), 2)


def test_workers_naming_different_commits_are_refused(run: SimpleNamespace) -> None:
    # Slot 1's own store has a ref "main" at step 4 while the run's store has it at step 8:
    # a worker that picked "its latest" would train from another commit than its peer.
    host = open_store(str(run.home / "host-stale"))
    copy_commit(run.store, host, run.commits[4], slot=1, ref="main")
    with pytest.raises(ResumeError, match="workers name different commits for 'main'"):
        train(
            RunSpec(job=run.job, store=run.store.url, until=8, resume="main", slot_stores=((1, host.url),)),
            2,
            timeout=TIMEOUT,
        )


def test_a_run_never_moves_a_ref_it_did_not_start_from(run: SimpleNamespace) -> None:
    with pytest.raises(ResumeError, match="ref 'main' points at commit .* \\(step 8\\), not at this run's start"):
        train(RunSpec(job=run.job, store=run.store.url, until=8, resume=run.commits[4]), 2)
    with pytest.raises(ResumeError, match="not at this run's start \\(fresh\\)"):
        train(RunSpec(job=run.job, store=run.store.url, until=8), 2)


def test_start_from_an_imported_llama_commit(tmp_path: Path) -> None:
    """Weights only: AdamW state is created at the first update, and the import is the parent."""
    from safetensors.torch import save_file

    from shardstore.ops.interchange import import_directory
    from shardtrain import Partition, build_stage

    config = load_job(_job(tmp_path / "probe")).config
    full = build_stage(config, Partition.even(config.num_hidden_layers, 1), 0, seed=99)
    src = tmp_path / "hf"
    src.mkdir()
    save_file({n: p.detach().contiguous() for n, p in full.named_parameters()}, str(src / "model.safetensors"))
    (src / "config.json").write_text(msgspec.json.encode(config.to_hf_dict()).decode())
    store = open_store(str(tmp_path / "store"))
    seed = import_directory(store, str(src), ref="main")
    job = _job(tmp_path / "job", seed_commit=seed, seed_config=config.to_hf_dict())
    results = train(RunSpec(job=job, store=store.url, until=2, every=2), 2, timeout=TIMEOUT)
    assert [c.step for c in results[0].commits] == [2]
    lc = shardstore.load_commit(store, results[0].commits[0].id)
    assert lc.commit.parent == seed and store.ref("main") == lc.id
    assert all(
        e.optim is not None and e.optim.age == 2 and e.optim.birth == 0 for s in lc.shards.values() for e in s.entries
    )
    # The first update started from the imported weights: its loss is that model's loss on
    # the new records; the declared replay rows add only KL toward the reference, which is
    # the imported seed itself and so the same distribution (KL 0) at the first update.
    with torch.no_grad():
        prepared = load_job(job)
        batch = prepared.batch(0)
        step = prepared.job.schedule.steps[0]
        assert step.replay and prepared.reference_of("A").source == "seed"
        new = torch.tensor([d not in step.replay for d in step.docs])
        logits = full(batch.tokens)
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.targets, reduction="none")
        expected = float((ce * batch.weights)[new].sum() / batch.weights.sum())
    assert results[0].steps[0].loss == pytest.approx(expected, rel=1e-5)


def test_the_job_is_pinned_and_survives_gc(run: SimpleNamespace, tmp_path: Path) -> None:
    """`train` pins the job file and every asset it binds; gc keeps them, so `evaluate`
    can rebuild the job from the store alone (and after unpinning, gc removes them)."""
    import shutil

    from shardstore.ops.gc import gc
    from shardtrain.run.evaluate import job_from_store

    job = load_job(run.job)
    bound = {job.id, job.job.records.blake3, *(a.blake3 for a in job.job.tokenizer)}
    assert set(run.store.pinned(f"jobs/{job.id}") or ()) == bound
    copy = tmp_path / "store"
    shutil.copytree(run.home / "store", copy)
    store = open_store(str(copy))
    result = gc(store, grace_seconds=0, dry_run=False)
    # with the commits the run depends on, pinned as references/<job id> (tests/test_dependencies.py)
    pinned = {o for ids in store.pins().values() for o in ids}
    assert bound <= pinned and len(pinned - bound) >= 1 and result.pinned_objects == len(pinned)
    assert not pinned & set(result.deleted)
    rebuilt = job_from_store(store, job.id, str(tmp_path))
    assert rebuilt.id == job.id
    assert shardstore.verify(store).ok
    store.unpin(f"jobs/{job.id}")
    gone = gc(store, grace_seconds=0, dry_run=False)
    assert bound <= set(gone.deleted)
    with pytest.raises(JobError, match="pass --prepared"):
        job_from_store(store, job.id, str(tmp_path / "again"))


def test_two_runs_of_one_job_pin_it_concurrently(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from shardtrain.run.lifecycle import store_job_files

    job = load_job(_job(tmp_path / "job"))
    for i in range(20):
        store = open_store(str(tmp_path / f"store{i}"))
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda _: store_job_files(job, store), range(2)))  # neither raises
        assert store.pinned(f"jobs/{job.id}") is not None and job.id in store.pinned(f"jobs/{job.id}")


def test_each_cohort_finds_its_reference_on_the_run_s_chain(run: SimpleNamespace) -> None:
    """Cohort A distils toward the step-0 seed commit, cohort B toward the committed end of A."""
    from shardtrain.run.distill import find_reference, reference_steps

    job = load_job(run.job)
    assert find_reference(run.store, job, "A", run.commits[8]) == run.commits[0]
    assert find_reference(run.store, job, "A", run.commits[4]) == run.commits[0]
    assert find_reference(run.store, job, "B", run.commits[8]) == run.commits[8]  # the end of cohort A is step 8
    from shardtrain.errors import DistillError

    with pytest.raises(DistillError, match="cohort B's reference, cohort A's endpoint .step 8., is not on the chain"):
        find_reference(run.store, job, "B", run.commits[4])
    assert reference_steps(job, 0, 12) == {8} and reference_steps(job, 8, 12) == set()
