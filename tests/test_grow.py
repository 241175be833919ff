"""Grow by one identity block: same logits, unchanged old tensors, new Adam clocks, and sharded
training of the grown model matching a single-process reference grown the same way (2 and 3 workers)."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import shardstore
from shardstore import load_commit
from shardstore.ops.diff import diff
from shardtrain.engine.optim import AdamW
from shardtrain.engine.partition import Partition, build_stage
from shardtrain.engine.pipeline import Pipeline
from shardtrain.engine.trainer import Trainer
from shardtrain.errors import TransitionError
from shardtrain.job.job import load_job
from shardtrain.reshape.grow import ZEROED_SUFFIXES, grow, identity_check
from shardtrain.run.lifecycle import DETERMINISTIC_ENV
from shardtrain.workers.launch import WorkerContext, launch_local

NEW = "model.layers.4."


def _whole(job, config, store=None, cid=None, optimizer=False):  # type: ignore[no-untyped-def]
    stage = build_stage(config, Partition.even(config.num_hidden_layers, 1), 0, seed=job.job.seed.init_seed)
    opt = AdamW(stage.named_parameters(), job.groups(), schedule=job.lr_schedule()) if optimizer else None
    if cid is not None:
        shardstore.restore(store, cid, stage, opt)
    return stage, opt


def test_grown_model_computes_the_same_logits_and_keeps_every_old_tensor(adaptive_run: SimpleNamespace) -> None:
    run = adaptive_run
    job = load_job(run.job)
    g, parent = run.grown.commit, run.u[4]
    c = run.store.commit(g)
    assert c.transition == "grow" and c.parent == parent and c.step == 4 and len(c.layout) == 2
    grown_config = dataclasses.replace(job.config, num_hidden_layers=5)
    before, _ = _whole(job, job.config, run.store, parent)
    after, _ = _whole(job, grown_config, run.store, g)
    tokens = job.batch(4).tokens
    with torch.no_grad():
        assert torch.equal(after(tokens), before(tokens))  # bitwise
    d = diff(run.store, parent, g)
    assert {t.name for t in d.tensors} == {n for n, _ in after.named_parameters() if n.startswith(NEW)}
    assert all(t.status == "added" for t in d.tensors)
    old, new = load_commit(run.store, parent).entries(), load_commit(run.store, g).entries()
    assert all(new[n] == e for n, e in old.items())  # object ids, moments, births and ages unchanged
    for n, e in new.items():
        if not n.startswith(NEW):
            continue
        src = old["model.layers.3." + n[len(NEW) :]]
        assert e.optim is not None and src.optim is not None
        assert (e.optim.birth, e.optim.age, e.optim.exp_avg, e.optim.group) == (4, 0, None, src.optim.group)
        zeroed = n.endswith(ZEROED_SUFFIXES)
        assert (e.param == src.param) != zeroed  # copies are the same objects; the two projections are zero
        if zeroed:
            assert not run.store.get_tensor(e.param, e.dtype, tuple(e.shape)).any()
    assert identity_check(run.store, g, range(4, 5))
    assert not identity_check(run.store, run.g2[0].commits[-1].id, range(4, 5))  # trained: no longer the identity
    assert shardstore.verify(run.store, [g, run.g2[0].commits[-1].id, run.g3[0].commits[-1].id]).ok  # cursors included


def reference_grown(job_path: str, url: str, parent: str, out: str) -> None:
    """The single-process reference, grown by hand: the pre-growth state in one process, block 3
    copied to 4 with its output projections zeroed, old Adam state kept, new parameters at age 0;
    then the job's last two updates. Writes parameters, moments and losses to `out`."""
    job = load_job(job_path)
    store = shardstore.open_store(url)
    torch.set_num_threads(1)
    grown_config = dataclasses.replace(job.config, num_hidden_layers=5)
    old, old_opt = _whole(job, job.config, store, parent, optimizer=True)
    model, _ = _whole(job, grown_config)
    old_params = dict(old.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            src = old_params.get(n, old_params.get("model.layers.3." + n[len(NEW) :]))
            p.copy_(torch.zeros_like(p) if n.startswith(NEW) and n.endswith(ZEROED_SUFFIXES) else src)
    groups, params = old_opt.state_export()
    opt = AdamW(model.named_parameters(), job.groups(), schedule=job.lr_schedule())
    params = {
        n: params.get(
            n,
            {
                "exp_avg": None,
                "exp_avg_sq": None,
                "age": 0,
                "group": params["model.layers.3." + n[len(NEW) :]]["group"] if n.startswith(NEW) else None,
            },
        )
        for n, _ in model.named_parameters()
    }
    opt.state_import(groups, params)
    trainer = Trainer(
        Pipeline(model, Partition.even(5, 1), 0),
        opt,
        microbatch_size=job.job.recipe.microbatch_size,
        max_grad_norm=job.max_grad_norm(),
        global_step=4,
    )
    losses = [trainer.step(job.batch(s)).loss for s in (4, 5)]
    _, state = opt.state_export()
    tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, st in state.items():
        tensors[f"exp_avg/{n}"], tensors[f"exp_avg_sq/{n}"] = st["exp_avg"], st["exp_avg_sq"]
        tensors[f"age/{n}"] = torch.tensor([st["age"]])
    save_file(tensors, out, metadata={"losses": json.dumps(losses)})


def _reference_worker(ctx: WorkerContext, job_path: str, url: str, parent: str, out: str) -> None:
    reference_grown(job_path, url, parent, out)


def test_sharded_grown_training_matches_a_single_process_reference(adaptive_run: SimpleNamespace) -> None:
    run = adaptive_run
    out = str(run.home / "reference.safetensors")
    # Its own process, under the workers' numerical profile (DETERMINISTIC_ENV pins the CPU
    # kernels at torch's import; this test process may use others).
    launch_local(
        _reference_worker,
        1,
        (run.job, run.url, run.u[4], out),
        env=DETERMINISTIC_ENV,
        timeout=timedelta(seconds=60),
        join_timeout=120,
    )
    with safe_open(out, "pt") as f:
        ref_losses = json.loads(f.metadata()["losses"])
    saved = load_file(out)
    ref = {n: t for n, t in saved.items() if "/" not in n}
    ref_state = {
        n: {"exp_avg": saved[f"exp_avg/{n}"], "exp_avg_sq": saved[f"exp_avg_sq/{n}"], "age": int(saved[f"age/{n}"])}
        for n in ref
    }
    control = [r.loss for r in run.straight[0].steps if r.step in (5, 6)]
    for workers, results in ((2, run.g2), (3, run.g3)):
        losses = [r.loss for r in results[0].steps]
        print(f"{workers} workers: grown losses {losses}, reference {ref_losses}, fixed-depth control {control}")
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        final = load_commit(run.store, results[0].commits[-1].id)
        assert len(final.shards) == workers
        worst = 0.0
        for n, e in final.entries().items():
            pairs = [(e.param, ref[n])]
            assert e.optim is not None and e.optim.age == ref_state[n]["age"] == (2 if n.startswith(NEW) else 6)
            assert e.optim.birth == (4 if n.startswith(NEW) else 0)
            pairs += [(e.optim.exp_avg, ref_state[n]["exp_avg"]), (e.optim.exp_avg_sq, ref_state[n]["exp_avg_sq"])]
            for oid, want in pairs:
                got = run.store.get_tensor(oid, e.dtype, tuple(e.shape))
                # Relative in norm, as in test_shardtrain_pipeline: this process's kernels are not the
                # workers' (ATEN_CPU_CAPABILITY), and Adam's m / sqrt(v) magnifies a few elements' last bits.
                err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
                if err > worst:
                    worst, where = err, (n, oid == e.param)
        print(
            f"{workers} workers: worst relative difference of parameters and moments {worst:.3g} ({where if worst else '-'})"
        )
        assert worst <= 1e-5
    assert ref_losses[0] == control[0]  # the first update after growth sees the same function and batch
    assert run.store.commit(run.g3[0].commits[0].id).parent != run.grown.commit  # train regrouped it first
    assert run.store.commit(run.store.commit(run.g3[0].commits[0].id).parent).transition == "repartition"


def test_grow_refuses_bad_arguments(adaptive_run: SimpleNamespace) -> None:
    run = adaptive_run
    with pytest.raises(TransitionError, match="--copy-from 9"):
        grow(run.store, run.u[4], 1, copy_from=9)
    with pytest.raises(TransitionError, match="--append"):
        grow(run.store, run.u[4], 0)


def test_a_reference_too_shallow_for_the_workers_is_refused_before_they_start(adaptive_run: SimpleNamespace) -> None:
    """Issue 24: grow the 4-layer distillation job in cohort A (step 2) by one block, then train
    on 5 workers: cohort A's reference (the 4-layer seed) cannot be split 5 ways. That
    was found inside step 1 after every worker started (RunAborted, exit 3, advising a resume
    that failed the same way); now `train` refuses it first (DistillError, exit 5) and
    writes nothing."""
    from shardstore_cli.shardtrain_cli import main

    run = adaptive_run
    d2 = next(c.id for c in run.dstraight[0].commits if c.step == 2)
    grown = grow(run.dstore, d2, 1)
    before = set(run.dstore.objects()), run.dstore.refs()
    argv = [
        "train",
        "--prepared",
        str(run.home / "djob" / "job.json"),
        "--store",
        run.dstore.url,
        "--until",
        "4",
        "--every",
        "1",
        "--resume",
        grown.commit,
        "--workers",
        "5",
        "--ref",
        "grown5",
        "--quiet",
    ]
    assert main(argv) == 5
    assert (set(run.dstore.objects()), run.dstore.refs()) == before


def test_evaluate_checks_the_commits_belong_to_the_prepared_job_before_any_worker(
    adaptive_run: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24: `evaluate --prepared JOB` with another job's commit is refused (ResumeError,
    exit 5) in the launcher; before, workers started and built their stages first."""
    import sys

    from shardtrain.errors import ResumeError

    ev = sys.modules["shardtrain.run.evaluate"]  # the package re-exports the function under the module's name

    run = adaptive_run
    d2 = next(c.id for c in run.dstraight[0].commits if c.step == 2)  # the distillation job's commit
    monkeypatch.setattr(ev, "launch_local", lambda *a, **k: pytest.fail("a worker was started"))
    with pytest.raises(ResumeError, match=f"commit {d2[:12]} was made by job"):
        ev.evaluate(ev.EvalSpec(store=run.dstore.url, commits=(d2,), job=run.job), 2)


def _as_format_1(store: shardstore.Store, cid: str) -> str:
    """Commit ``cid`` (one slot) as format 1's writer left such a state: every payload one object
    of its whole bytes, whatever its size, in version-1 manifests (``tests/test_legacy_store.py``)."""
    import msgspec

    from shardstore.format.grid import read_whole
    from shardstore.format.manifest import FORMAT_VERSION, is_chunked
    from shardstore.format.roots import learned_root

    lc = load_commit(store, cid)
    (shard,) = lc.shards.values()
    entries = []
    for e in shard.entries:
        if is_chunked(e.param):
            whole = read_whole(store, e.param, e.dtype, tuple(e.shape), what=e.name)
            e = msgspec.structs.replace(e, param=store.put_tensors([whole])[0])
        entries.append(e)
    sid = store.put_manifest(msgspec.structs.replace(shard, version=FORMAT_VERSION, entries=tuple(entries)))
    c = lc.commit
    root = learned_root(step=c.step, data_cursor=c.data_cursor, config=c.config, optimizer=c.optimizer, entries=entries)
    layout = (msgspec.structs.replace(c.layout[0], shard=sid),)
    return store.put_manifest(msgspec.structs.replace(c, version=FORMAT_VERSION, layout=layout, learned_root=root))


def test_a_grow_of_a_format_1_commit_keeps_version_1_with_a_zero_projection_over_the_block_bound() -> None:
    """SPEC.md §5.1 (issue 35, item 6): a transition keeps its parent's grid, and version 1's is one
    object per tensor, whatever its size. A format-1 commit whose ``o_proj`` is 1040 x 1040 float32
    (4,326,400 bytes, over the 4 MiB bound) grows into a version-1 commit whose new zero projection
    is one object of 4,326,400 zero bytes. Before, the zero projection was cut into row bands and the
    grow failed on its own shard manifest (GridError: the copied ``q_proj``, one object over the
    bound, in a manifest the bands made version 2)."""
    import blake3

    from shardtrain.engine.model import LlamaConfig

    config = LlamaConfig(vocab_size=8, hidden_size=1040, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=1)  # fmt: skip
    store = shardstore.open_store("memory://grow-format-1")
    stage = build_stage(config, Partition.even(1, 1), 0, seed=0)
    saved = shardstore.save(store, stage, step=0, config=config.to_hf_dict(), rng=False, ref=None, transition="init")
    parent = _as_format_1(store, saved)
    assert store.commit(parent).version == 1 and shardstore.verify(store, [parent]).ok
    grown = grow(store, parent, 1).commit
    lc = load_commit(store, grown)
    assert lc.commit.version == 1 and {s.version for s in lc.shards.values()} == {1}
    o_proj = lc.entries()["model.layers.1.self_attn.o_proj.weight"]
    assert o_proj.param == blake3.blake3(bytes(1040 * 1040 * 4)).hexdigest()  # one object: the zero bytes
    assert (
        lc.entries()["model.layers.1.self_attn.q_proj.weight"].param
        == lc.entries()["model.layers.0.self_attn.q_proj.weight"].param
    )
    assert shardstore.verify(store, [grown]).ok and identity_check(store, grown, range(1, 2))
