"""Regroup 2 -> 3 -> 2 workers: repartition commits keep the learned state and add no tensor objects,
and training on the new layout reproduces the uninterrupted run's learned-state roots bitwise."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest
import torch

from shardstore import load_commit
from shardstore.format.manifest import decode_config
from shardtrain.engine.model import LlamaConfig
from shardtrain.errors import PartitionError, ResumeError, TransitionError
from shardtrain.reshape.regroup import layout_partition, parse_partition, regroup, rng_seed
from shardtrain.run.lifecycle import RunSpec, train


def _root(run: SimpleNamespace, cid: str) -> str:
    return run.store.commit(cid).learned_root


def _tensor_objects(run: SimpleNamespace) -> set[str]:
    out = set()
    for cid in [*run.u.values(), *run.w.values(), *run.n.values()]:
        for e in load_commit(run.store, cid).entries().values():
            out.add(e.param)
            if e.optim is not None:
                out |= {m for m in (e.optim.exp_avg, e.optim.exp_avg_sq) if m}
    return out


def test_repartition_commits_keep_the_learned_state_root_and_write_no_tensor_objects(
    adaptive_run: SimpleNamespace,
) -> None:
    run = adaptive_run
    tensors = _tensor_objects(run)
    for made, (before, after), slots in ((run.to3, run.files[0:2], 3), (run.to2, run.files[2:4], 2)):
        c = run.store.commit(made.commit)
        parent = run.store.commit(made.parent)
        assert c.transition == "repartition" and c.parent == made.parent and c.step == parent.step
        assert c.learned_root == parent.learned_root == made.learned_root
        assert c.config == parent.config and c.data_cursor == parent.data_cursor
        assert len(c.layout) == slots
        added = after - before
        assert added == set(made.new_objects)
        assert not added & tensors  # no parameter or Adam moment object was written
        manifests = {lay.shard for lay in c.layout} | {made.commit}
        rng = {
            r.object
            for slot, s in load_commit(run.store, made.commit).shards.items()
            if slot >= len(parent.layout)
            for r in s.rng
        }
        assert added <= manifests | rng and manifests <= added | before
        print(
            f"repartition {len(parent.layout)} -> {slots}: {len(before)} object files before, {len(after)} after "
            f"({len(added)} new: {len(manifests)} manifests, {len(added - manifests)} RNG objects, 0 tensor objects)"
        )
    # Slots the parent had keep its RNG objects; the new slot's are derived from (parent, slot).
    lc3, lc1 = load_commit(run.store, run.to3.commit), load_commit(run.store, run.to3.parent)
    assert [r.object for r in lc3.shards[1].rng] == [r.object for r in lc1.shards[1].rng]
    assert {r.kind for r in lc3.shards[2].rng} == {"python", "numpy", "torch"}
    # SPEC.md §15.1: s = BLAKE2b-64("shardtrain-rng-v1:<parent>:<slot>") little-endian mod 2**32, torch's state after manual_seed(s).
    digest = hashlib.blake2b(f"shardtrain-rng-v1:{run.to3.parent}:2".encode(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little") % 2**32
    assert rng_seed(run.to3.parent, 2) == seed != rng_seed(run.to3.parent, 1)
    torch_obj = {r.kind: r.object for r in lc3.shards[2].rng}["torch"]
    assert bytes(run.store.get(torch_obj)) == torch.Generator().manual_seed(seed).get_state().numpy().tobytes()


def test_training_on_3_then_2_workers_gives_the_uninterrupted_learned_state_roots(
    adaptive_run: SimpleNamespace,
) -> None:
    run = adaptive_run
    assert sorted(run.w) == [2, 3] and sorted(run.n) == [4]
    for step in (2, 3):
        assert _root(run, run.w[step]) == _root(run, run.u[step]), step
    assert _root(run, run.n[4]) == _root(run, run.u[4])
    assert run.store.commit(run.w[2]).parent == run.to3.commit and len(run.store.commit(run.w[2]).layout) == 3
    # The new slot's host received only slot 2's data objects (and every manifest), and trained from them.
    lc = load_commit(run.store, run.to3.commit)
    slot2 = {e.param for e in lc.shards[2].entries} | {
        m for e in lc.shards[2].entries if e.optim for m in (e.optim.exp_avg, e.optim.exp_avg_sq) if m
    }
    others = {e.param for s in (0, 1) for e in lc.shards[s].entries}
    held = set(run.host.objects())
    assert slot2 <= held and not (others - slot2) & held
    assert run.store.commit(run.n[4]).parent == run.to2.commit
    losses = {r.step: r.loss for r in run.straight[0].steps}
    assert [r.loss for r in run.wide[0].steps] == [losses[2], losses[3]]
    # Each worker held only its slot, and the journal has estimate beside actual for the run's last commit.
    held_params = [r.parameters for r in run.wide]
    assert len(set(held_params)) > 1 and all(r.estimate_bytes > 0 and r.used_bytes > 0 for r in run.wide)
    record = json.loads((run.home / "store" / "journal" / f"{run.w[3]}.json").read_bytes())
    assert [w["slot"] for w in record["workers"]] == [0, 1, 2]
    assert [w["parameters"] for w in record["workers"]] == held_params
    assert all(
        w["estimate"] == r.estimate_bytes and w["peak"] >= w["used"] > 0 for w, r in zip(record["workers"], run.wide)
    )
    # Every commit of a run has its time and its step's loss in the journal (issue 25: `log --oneline`).
    assert record["loss"] == losses[3] and record["time"] > 0
    first = json.loads((run.home / "store" / "journal" / f"{run.u[1]}.json").read_bytes())
    # ... and, every commit (issue 22: the seed requires both), each worker's actual peak and coverage
    assert (
        first["loss"] == losses[1] and first["step"] == 1 and all(w["peak"] >= w["used"] > 0 for w in first["workers"])
    )


def test_layout_partition_reads_the_commit_layout_and_regroup_takes_an_explicit_partition(
    adaptive_run: SimpleNamespace,
) -> None:
    run = adaptive_run
    lc = load_commit(run.store, run.to3.commit)
    config = LlamaConfig.from_hf_dict(decode_config(run.store.get(lc.commit.config)))
    assert layout_partition(config, lc).ranges == (range(0, 2), range(2, 3), range(3, 4))
    uneven = regroup(run.store, run.u[1], parse_partition("0:1,1:4", 4))
    assert run.store.commit(uneven.commit).learned_root == _root(run, run.u[1])
    assert layout_partition(config, load_commit(run.store, uneven.commit)).ranges == (range(0, 1), range(1, 4))
    assert regroup(run.store, run.u[1], workers=3).commit == run.to3.commit  # deterministic, RNG of slot 2 included
    with pytest.raises(PartitionError):
        parse_partition("0:2,3:4", 4)
    with pytest.raises(TransitionError, match="not at"):
        regroup(run.store, run.u[1], workers=3, ref="main")  # main names step 6, not step 1


def test_a_group_of_another_size_refuses_a_commit_laid_out_for_two(adaptive_run: SimpleNamespace) -> None:
    run = adaptive_run
    host = str(run.home / "host")
    with pytest.raises(ResumeError, match="run shardtrain regroup first"):
        train(RunSpec(job=run.job, store=run.url, until=5, resume=run.u[4], ref="x", slot_stores=((1, host),)), 3)


def test_cli_regroup_grow_and_plan(adaptive_run: SimpleNamespace, capsys: pytest.CaptureFixture[str]) -> None:
    from shardstore_cli.shardtrain_cli import main

    run = adaptive_run
    assert main(["regroup", "--store", run.url, "--commit", run.u[2], "--workers", "3", "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["learned_root"] == made["parent_learned_root"] == _root(run, run.u[2])
    assert made["partition"] == [[0, 2], [2, 3], [3, 4]]
    assert main(["plan", "--prepared", run.job, "--workers", "2", "--memory", "1GiB,3GiB", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert len(planned["slots"]) == 2 and planned["max_utilisation"] == max(s["utilisation"] for s in planned["slots"])
    # The memory tiers' host memory, per slot: (K + 1) commits of its own slot and of its buddy's.
    tier_args = ["--memory-tier-commits", "2", "--peer-replicas", "1"]
    assert main(["plan", "--prepared", run.job, "--workers", "2", "--memory", "1GiB,3GiB", "--json", *tier_args]) == 0
    tiered = json.loads(capsys.readouterr().out)
    stored = [12 * s["parameters"] for s in tiered["slots"]]  # float32 weights and both Adam moments
    assert [s["tier"] for s in tiered["slots"]] == [3 * (stored[0] + stored[1])] * 2
    assert [s["estimate"] for s in tiered["slots"]] == [s["estimate"] for s in planned["slots"]]
    assert main(["plan", "--prepared", run.job, "--workers", "2", "--memory", "1GiB", *tier_args]) == 0
    assert "host tiers" in capsys.readouterr().out
    assert (
        main(
            [
                "regroup",
                "--store",
                run.url,
                "--commit",
                run.u[2],
                "--plan",
                "--prepared",
                run.job,
                "--memory",
                "1GiB,3GiB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "(equal to the parent's)" in out and "layers " + ",".join(f"{a}:{b}" for a, b in planned["partition"]) in out
    assert main(["grow", "--store", run.url, "--commit", run.u[2], "--append", "2", "--workers", "3"]) == 0
    out = capsys.readouterr().out
    assert "identity check of layers 4..5: every new block maps its input to itself bitwise" in out
    assert "layout 3 workers, layers 0:2,2:4,4:6" in out
    # A partition that cannot be made is a refused transition: exit 5, as the help lists (issue 24; 4 before issue 35).
    assert main(["regroup", "--store", run.url, "--commit", run.u[2], "--partition", "0:1,2:4"]) == 5
    assert "PartitionError" in capsys.readouterr().err
    assert main(["grow", "--store", run.url, "--commit", run.u[2], "--append", "1", "--copy-from", "7"]) == 5
    assert (
        main(
            [
                "train",
                "--prepared",
                run.job,
                "--store",
                run.url,
                "--until",
                "5",
                "--resume",
                run.u[4],
                "--workers",
                "3",
                "--ref",
                "cli3",
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert f"commit {run.u[4][:12]} was laid out for 2 workers: wrote repartition commit" in out.err
    assert out.out.startswith("step 5: ") and run.store.commit(out.out.split()[2]).learned_root == _root(run, run.u[5])
    assert out.err.count("estimated peak") == 3


def test_shardstore_log_shows_the_transitions(
    adaptive_run: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardstore_cli.shardstore_cli import main

    run = adaptive_run
    assert main(["log", run.url, run.g3[0].commits[-1].id, "--json"]) == 0
    kinds = [c["transition"] for c in json.loads(capsys.readouterr().out)["commits"]]
    # newest first: two trained steps on 3 workers, the repartition train wrote, the grow, then the 2-worker run
    assert kinds[:4] == ["train", "train", "repartition", "grow"] and kinds[-1] == "init"
    assert main(["log", run.url, run.n[4]]) == 0
    out = capsys.readouterr().out
    assert out.count("repartition") == 2


def test_workers_refuse_a_commit_laid_out_for_another_count(adaptive_run: SimpleNamespace) -> None:
    """What each worker checks (under torchrun nobody regroups for it): the layout must have its group's size."""
    from shardtrain.job.job import load_job
    from shardtrain.reshape.regroup import start_layout

    run = adaptive_run
    job = load_job(run.job)
    with pytest.raises(
        ResumeError, match=r"laid out for 2 workers, this group has 3; write a repartition commit first"
    ):
        start_layout(job, run.store, run.u[4], 3)
    config, partition = start_layout(job, run.store, run.grown.commit, 2)
    assert config.num_hidden_layers == 5 and partition.ranges == (range(0, 3), range(3, 5))
    assert start_layout(job, run.store, run.to3.commit, 3)[1].num_slots == 3


def test_regrouped_distillation_gives_the_uninterrupted_roots(adaptive_run: SimpleNamespace) -> None:
    """Cohort B distils toward the end of cohort A; on 3 workers from a repartition commit of that
    end (written by train), the frozen reference is split 3 ways too, and the roots still match."""
    run = adaptive_run
    straight = {c.step: run.dstore.commit(c.id).learned_root for c in run.dstraight[0].commits}
    wide = {c.step: run.dstore.commit(c.id).learned_root for c in run.dwide[0].commits}
    assert sorted(wide) == [5, 6] and all(wide[s] == straight[s] for s in wide)
    first = run.dstore.commit(run.dwide[0].commits[0].id)
    assert run.dstore.commit(first.parent).transition == "repartition" and len(first.layout) == 3
    assert [r.loss for r in run.dwide[0].steps] == [r.loss for r in run.dstraight[0].steps if r.step > 4]


def test_repartition_keeps_commit_wide_extras_and_refuses_a_slots_own(adaptive_run: SimpleNamespace) -> None:
    """Issue 13: a scheduler's state (commit-wide) is layout-free and travels; a slot's own extras cannot."""
    import msgspec

    from shardstore import CommitInfo, write_commit
    from shardstore.state.extras import capture_extras, write_extras

    class Sched:
        def state_dict(self) -> dict:
            return {"last_epoch": 5, "base_lrs": [0.01]}

    store, lc = adaptive_run.store, load_commit(adaptive_run.store, adaptive_run.to3.parent)
    c = lc.commit
    info = CommitInfo(
        step=c.step,
        job=c.job,
        schedule=c.schedule,
        profile=c.profile,
        data_cursor=c.data_cursor,
        transition=c.transition,
        config=decode_config(store.get(c.config)),
    )
    extras = write_extras(store, capture_extras({"scheduler": Sched()}))
    store.sync()
    ids = [lc.shard_ids[s] for s in sorted(lc.shard_ids)]
    with_extras = write_commit(store, ids, info=info, parent=c.parent, extras=extras)
    made = regroup(store, with_extras, workers=3)
    new = store.commit(made.commit)
    assert new.extras == extras and new.learned_root == store.commit(with_extras).learned_root != c.learned_root
    own = store.put_manifest(msgspec.structs.replace(lc.shards[1], extras=extras))
    store.sync()
    with_own = write_commit(store, [ids[0], own], info=info, parent=c.parent)
    with pytest.raises(TransitionError, match=r"slots hold their own extras \{1: \['scheduler'\]\}"):
        regroup(store, with_own, workers=3)
