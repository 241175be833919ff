"""The trainer's update (shardtrain.trainer): a non-finite step is never applied (issue 24, docs/SHARDTRAIN-FORMATS.md §3)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from shardtrain_helpers import GROUPS_JSON, make_batch, tiny_config

from shardtrain.engine.optim import AdamW, GroupConfig, Schedule
from shardtrain.engine.partition import Partition, build_stage
from shardtrain.engine.pipeline import Pipeline
from shardtrain.engine.trainer import Trainer
from shardtrain.errors import LaunchError, NonFiniteStep


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_a_non_finite_step_is_not_applied(poison: str) -> None:
    """A NaN loss (here: a NaN weight the loss reads) or an infinite gradient stops the step
    with NonFiniteStep naming step and slot, before the optimizer touches anything. Before
    issue 24 the update was applied (NaN weights and moments) and the run went on."""
    config = tiny_config(layers=2)
    stage = build_stage(config, Partition.even(2, 1), 0, seed=3)
    opt = AdamW(
        stage.named_parameters(),
        {k: GroupConfig(**v) for k, v in GROUPS_JSON.items()},
        schedule=Schedule(warmup_steps=1, total_steps=4, min_ratio=0.1),
    )
    trainer = Trainer(Pipeline(stage, Partition.even(2, 1), 0), opt, microbatch_size=2, max_grad_norm=None)
    trainer.step(make_batch(config, seed=1))  # one finite update
    norm = dict(stage.named_parameters())["model.norm.weight"]
    if poison == "loss":
        with torch.no_grad():
            norm[0] = float("nan")
    else:
        norm.register_hook(lambda g: torch.full_like(g, float("inf")))
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    _, moments = opt.state_export()
    ages = {n: st["age"] for n, st in moments.items()}
    with pytest.raises(NonFiniteStep, match=r"step 2 \(slot 0\)"):
        trainer.step(make_batch(config, seed=2))
    after = dict(stage.named_parameters())
    assert all(
        torch.equal(
            before[n],
            after[n].detach(),
        )
        or n == "model.norm.weight"
        for n in before
    )
    assert (
        torch.equal(
            before["model.norm.weight"],
            after["model.norm.weight"].detach(),
        )
        or poison == "loss"
    )
    assert {n: st["age"] for n, st in opt.state_export()[1].items()} == ages and trainer.global_step == 1


def test_a_result_file_with_a_null_is_a_launch_error(tmp_path: object) -> None:
    """The launcher's read of a worker's result file: a NaN written as JSON null (what killed
    `train` with a ValidationError traceback) is a LaunchError naming the worker."""
    from shardtrain.run.lifecycle import RunResult, _read_results

    good = msgspec.json.encode(
        RunResult(
            rank=0,
            job="j",
            start_step=0,
            start_commit=None,
            commits=(),
            steps=(),
            parameters=1,
            parameter_bytes=4,
            peak_rss_bytes=1,
            seconds=0.5,
            estimate_bytes=1,
            used_bytes=1,
        )
    )
    out = str(tmp_path)
    with open(f"{out}/rank0.json", "wb") as f:
        f.write(good)
    with open(f"{out}/rank1.json", "wb") as f:
        f.write(good.replace(b'"seconds":0.5', b'"seconds":null'))
    assert _read_results(out, 1)[0].rank == 0
    with pytest.raises(LaunchError, match="worker 1's result file"):
        _read_results(out, 2)
