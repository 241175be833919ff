"""shardstore.transformers (issue 31, item 2): the Hugging Face Trainer with its checkpoints in a store.

The bitwise test runs the real Trainer three times: uninterrupted for N steps; interrupted
(the process exits right after its checkpoint at step K, mid-epoch); resumed through
``train(resume_from_checkpoint=True)`` in another fresh process, from a model built with
other weights. Every parameter, optimizer state tensor, the scheduler, the TrainerState, the
log and the RNG states must then equal the uninterrupted run's bit for bit, and the two
runs' last checkpoints must be one commit. By default the three processes are forked from
one interpreter that has imported transformers and run nothing (one import instead of three,
within the test command's budget); the ``long`` variant starts an interpreter for each.
Both sides run under ``DETERMINISTIC_ENV`` (``ATEN_CPU_CAPABILITY=default``, one thread).

This file is also the script those processes run (``__main__`` below).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import shardstore as ss
from shardstore.errors import InvalidName, StateMismatch, TargetNotFound, TensorMismatch
from shardstore.format.closure import commit_closure
from shardstore.transformers import ShardstoreTrainer, ShardstoreTrainerMixin
from shardtrain.run.lifecycle import DETERMINISTIC_ENV

REPO = Path(__file__).resolve().parents[2]
N, K = 9, 5  # steps of the run, and the checkpoint it is interrupted after (epoch 0 of 6 steps)


class Tokens(torch.utils.data.Dataset):
    """24 fixed sequences of 8 token ids: 6 optimizer steps per epoch at batch 2 and 2 accumulation steps."""

    def __init__(self, n: int = 24) -> None:
        self.ids = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 of ~9k parameters, tied embeddings, dropout 0.1 (so the RNG state matters)."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def training_args(output_dir: Path, **overrides: Any) -> TrainingArguments:
    kw: dict[str, Any] = dict(
        output_dir=str(output_dir),
        max_steps=N,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_steps=K,
        logging_steps=1,  # each log entry one step's loss: the same in a resumed run
        seed=3,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        log_level="error",
    )
    kw.update(overrides)
    return TrainingArguments(**kw)


def make_trainer(root: Path, prefix: str, *, seed: int = 0, cls: type = ShardstoreTrainer, **kw: Any) -> Any:
    args = kw.pop("args", None) or training_args(root / f"out-{prefix.replace('/', '-')}")
    model = kw.pop("model", None) or tiny_gpt2(seed)
    return cls(model=model, args=args, train_dataset=Tokens(), store=str(root / "store"), prefix=prefix, **kw)


def outputs(t: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the model and the optimizer's state, by name (for bitwise comparison)."""
    out = {f"model/{n}": v.detach().clone() for n, v in t.model.state_dict().items()}
    for i, st in t.optimizer.state_dict()["state"].items():
        out.update({f"optimizer/{i}/{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def counters(t: Any) -> dict[str, Any]:
    """The non-tensor state a resumed run must reproduce (the last log entry is the run's own timing)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in t.optimizer.state_dict()["param_groups"]]
    return {
        "global_step": t.state.global_step,
        "epoch": t.state.epoch,
        "total_flos": t.state.total_flos,
        "log_history": t.state.log_history[:-1],
        "scheduler": t.lr_scheduler.state_dict(),
        "optimizer_groups": groups,
        "python_rng": list(random.getstate()[1]),
        "numpy_rng": np.random.get_state()[1].tolist(),
    }


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


# -- the processes of the bitwise test ---------------------------------------------------------


class ExitAfterSave(TrainerCallback):
    """The process dies right after Trainer's checkpoint at ``step``: nothing else runs."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            os._exit(17)


class CountSteps(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps += 1


def run_role(role: str, root: Path) -> None:
    """One run of the bitwise test, its results written under ``root``."""
    torch.set_num_threads(1)
    count = CountSteps()
    if role == "uninterrupted":
        t = make_trainer(root, "a", callbacks=[count])
        t.train()
    elif role == "interrupted":
        t = make_trainer(root, "b", callbacks=[ExitAfterSave(K)])
        t.train()
        raise AssertionError("the interrupted run was not interrupted")
    else:  # resumed: other initial weights, which the checkpoint must replace
        t = make_trainer(root, "b", seed=99, callbacks=[count])
        t.train(resume_from_checkpoint=True)
    tensors = outputs(t)
    tensors["rng/torch"] = torch.get_rng_state()
    save_file(tensors, str(root / f"{role}.safetensors"))
    result = {**counters(t), "steps_run": count.steps, "checkpoints": t.checkpoints()}
    result["output_dir"] = sorted(os.listdir(t.args.output_dir)) if os.path.isdir(t.args.output_dir) else []
    (root / f"{role}.json").write_text(json.dumps(result))


def zygote(root: Path, roles: list[str]) -> None:
    """Fork a fresh child for each role, in order, from this process (which has run nothing)."""
    status = {}
    for role in roles:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run_role(role, root)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        status[role] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    (root / "status.json").write_text(json.dumps(status))


def _launch(argv: list[str], timeout: int = 300) -> None:
    env = {**os.environ, **DETERMINISTIC_ENV, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [sys.executable, __file__, *argv], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def check_bitwise(root: Path, status: dict[str, int]) -> None:
    assert status == {"interrupted": 17, "resumed": 0, "uninterrupted": 0}, status
    a, b = (json.loads((root / f"{r}.json").read_text()) for r in ("uninterrupted", "resumed"))
    assert (a["steps_run"], b["steps_run"]) == (N, N - K)  # the resumed run trained only what was left
    assert b["global_step"] == a["global_step"] == N
    for key in ("epoch", "total_flos", "log_history", "scheduler", "optimizer_groups", "python_rng", "numpy_rng"):
        assert a[key] == b[key], key
    assert_same_tensors(*(load_file(str(root / f"{r}.safetensors")) for r in ("uninterrupted", "resumed")))
    assert a["checkpoints"] == [[K, f"a/checkpoint-{K}"], [N, f"a/checkpoint-{N}"]]
    assert b["checkpoints"] == [[K, f"b/checkpoint-{K}"], [N, f"b/checkpoint-{N}"]]
    store = ss.open_store(str(root / "store"))
    refs = store.refs()
    assert refs[f"a/checkpoint-{K}"] == refs[f"b/checkpoint-{K}"]  # the same state: one commit
    assert refs[f"a/checkpoint-{N}"] == refs[f"b/checkpoint-{N}"]
    assert store.commit(refs[f"b/checkpoint-{N}"]).parent == refs[f"b/checkpoint-{K}"]  # the run's history
    assert a["output_dir"] == b["output_dir"] == []  # no checkpoint folder, trainer_state.json or pickle


@pytest.mark.long  # fresh processes: .ci/run's second step, for the test command's 8 minutes
def test_resume_in_a_fresh_process_is_bitwise_mid_epoch(tmp_path: Path) -> None:
    _launch(["zygote", str(tmp_path), "interrupted", "resumed", "uninterrupted"])
    check_bitwise(tmp_path, json.loads((tmp_path / "status.json").read_text()))


@pytest.mark.long  # three interpreters, each importing transformers: ~25 s of CPU
def test_resume_in_a_fresh_interpreter_is_bitwise_mid_epoch(tmp_path: Path) -> None:
    status = {}
    for role in ("interrupted", "resumed", "uninterrupted"):
        env = {**os.environ, **DETERMINISTIC_ENV, "HF_HUB_OFFLINE": "1"}
        argv = [sys.executable, __file__, "role", str(tmp_path), role]
        out = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode in (0, 17), out.stderr[-3000:]
        status[role] = out.returncode
    check_bitwise(tmp_path, status)


# -- in this process ---------------------------------------------------------------------------


class Recorder(TrainerCallback):
    """Each checkpoint's commit id as it is saved (rotation deletes the refs later)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.commits: dict[int, str] = {}

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.commits[state.global_step] = self.trainer.store.ref(self.trainer.checkpoint_ref(state.global_step))


def test_save_total_limit_deletes_refs_and_gc_reclaims_their_objects(tmp_path: Path) -> None:
    rec = Recorder()
    t = make_trainer(
        tmp_path, "runs/lim", args=training_args(tmp_path / "out", max_steps=4, save_steps=1, save_total_limit=2)
    )
    rec.trainer = t
    t.add_callback(rec)
    t.train()
    assert t.checkpoints() == [(3, "runs/lim/checkpoint-3"), (4, "runs/lim/checkpoint-4")]
    store = t.store
    assert all(store.commit(c).parent is None for c in rec.commits.values())  # no link keeps a rotated one
    gone = [rec.commits[1], rec.commits[2]]
    kept_objects = {o for s in (3, 4) for o in _closure(store, rec.commits[s])}
    only_gone = {o for c in gone for o in _closure(store, c)} - kept_objects
    assert only_gone and all(store.has(o) for o in only_gone)
    result = ss.gc(store, grace_seconds=0, dry_run=False)
    assert not any(store.has(o) for o in only_gone)  # each weight and moment only steps 1-2 held
    assert sum(result.deleted.values()) >= len(only_gone)
    assert ss.verify(store, ["runs/lim/checkpoint-3", "runs/lim/checkpoint-4"]).ok
    assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == []


def test_the_best_checkpoint_is_kept_and_loaded_at_the_end(tmp_path: Path) -> None:
    """load_best_model_at_end with save_total_limit=1: Trainer keeps the best checkpoint alone and loads it."""
    rec = Recorder()
    args = training_args(
        tmp_path / "out",
        max_steps=3,
        save_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=True,  # the highest loss: the first step's, so the best is not the last
    )
    t = make_trainer(tmp_path, "best", args=args, eval_dataset=Tokens(4))
    rec.trainer = t
    t.add_callback(rec)
    t.train()
    assert t.state.best_model_checkpoint == "best/checkpoint-1"
    assert t.checkpoints() == [(1, "best/checkpoint-1")]
    best = ss.read_state_dict(t.store, rec.commits[1])["model"]
    assert all(torch.equal(v, best[n]) for n, v in t.model.state_dict().items())
    last = ss.read_state_dict(t.store, rec.commits[3])["model"]
    assert not all(torch.equal(v, last[n]) for n, v in t.model.state_dict().items())


def _closure(store: ss.Store, commit: str) -> set[str]:
    return commit_closure(ss.load_commit(store, commit)).ids()


class HalfLossTrainer(Trainer):
    """Another Trainer subclass (as TRL's are): its own loss, and a count of its calls."""

    calls = 0

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        HalfLossTrainer.calls += 1
        loss = model(**inputs).loss * 0.5
        return (loss, None) if return_outputs else loss


class HalfLossShardstoreTrainer(ShardstoreTrainerMixin, HalfLossTrainer):
    pass


def test_the_mixin_on_another_trainer_subclass_saves_and_resumes_bitwise(tmp_path: Path) -> None:
    args = training_args(tmp_path / "out", max_steps=4, save_steps=2)
    first = make_trainer(tmp_path, "mix", cls=HalfLossShardstoreTrainer, args=args)
    first.train()
    assert HalfLossTrainer.calls == 4 * 2  # the subclass's own loss ran (4 steps of 2 micro-batches)
    assert first.checkpoints() == [(2, "mix/checkpoint-2"), (4, "mix/checkpoint-4")]
    again = make_trainer(tmp_path, "mix", seed=5, cls=HalfLossShardstoreTrainer, args=args)
    again.train(resume_from_checkpoint="mix/checkpoint-2")
    assert HalfLossTrainer.calls == 4 * 2 + 2 * 2
    assert_same_tensors(outputs(first), outputs(again))
    assert counters(first) == counters(again)

    with pytest.raises(TypeError, match="must come before"):

        class Reversed(HalfLossTrainer, ShardstoreTrainerMixin):
            pass


def test_grad_scaler_state_is_saved_and_resumed(tmp_path: Path) -> None:
    """accelerate makes no gradient scaler on the CPU (fp16 needs an accelerator); installed as
    accelerate installs one on a GPU, its scale and growth tracker go through the checkpoint."""
    args = training_args(tmp_path / "out", max_steps=4, save_steps=2, max_grad_norm=0.0)

    def scaled(seed: int) -> Any:
        t = make_trainer(tmp_path, "amp", seed=seed, args=args)
        t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
        return t

    first = scaled(0)
    first.train()
    assert first.accelerator.scaler.get_scale() == 2.0**12  # grew at each step: not its initial state
    again = scaled(1)
    again.train(resume_from_checkpoint="amp/checkpoint-2")
    assert again.accelerator.scaler.state_dict() == first.accelerator.scaler.state_dict()
    assert_same_tensors(outputs(first), outputs(again))
    plain = make_trainer(tmp_path, "amp", seed=1, args=args)  # a run without a scaler refuses a checkpoint with one
    with pytest.raises(StateMismatch, match="gradient scaler"):
        plain.train(resume_from_checkpoint="amp/checkpoint-2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One short run (4 steps, checkpoints 2 and 4) with a tokenizer, shared by the tests below."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("trained")
    vocab = {"<unk>": 0, "<pad>": 1, **{f"t{i}": i for i in range(2, 64)}}
    wordlevel = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wordlevel.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=wordlevel, unk_token="<unk>", pad_token="<pad>")
    args = training_args(root / "out", max_steps=4, save_steps=2)
    t = make_trainer(root, "run", args=args, processing_class=tok)
    t.train()
    return root, t


def test_export_pretrained_loads_bitwise_with_its_tokenizer(trained: Any, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    root, t = trained
    cid = t.export_pretrained(tmp_path / "ckpt2", target="run/checkpoint-2")
    assert cid == t.store.ref("run/checkpoint-2")
    stored = ss.read_state_dict(t.store, cid)["model"]
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt2")
    assert loaded.state_dict().keys() == stored.keys()
    assert all(torch.equal(v, stored[n]) for n, v in loaded.state_dict().items())
    assert not torch.equal(
        stored["transformer.h.0.mlp.c_fc.weight"], t.model.state_dict()["transformer.h.0.mlp.c_fc.weight"]
    )
    assert t.export_pretrained(tmp_path / "live") is None  # the live model: checkpoint 4's weights
    live = GPT2LMHeadModel.from_pretrained(tmp_path / "live")
    assert all(torch.equal(v, t.model.state_dict()[n]) for n, v in live.state_dict().items())
    tok = AutoTokenizer.from_pretrained(tmp_path / "ckpt2")
    assert tok("t5 t9 zz")["input_ids"] == t.processing_class("t5 t9 zz")["input_ids"] == [5, 9, 0]
    assert not list((tmp_path / "ckpt2").glob("*.bin"))  # no training_args.bin: no pickle


def test_resume_targets_and_checkpoints_it_cannot_take(trained: Any, tmp_path: Path) -> None:
    root, t = trained
    fresh = make_trainer(root, "run", seed=9, args=training_args(tmp_path / "o", max_steps=4, save_steps=2))
    before = {n: v.clone() for n, v in fresh.model.state_dict().items()}
    with pytest.raises(TargetNotFound):
        fresh.train(resume_from_checkpoint="run/checkpoint-3")
    with pytest.raises(TargetNotFound, match="expected True"):
        fresh.train(resume_from_checkpoint=3)  # type: ignore[arg-type]
    other = ss.save_state_dict(t.store, {"weights": torch.zeros(2)}, ref="other")
    with pytest.raises(StateMismatch, match="not a transformers.Trainer checkpoint"):
        fresh.train(resume_from_checkpoint=other[:12])
    wide = make_trainer(
        root,
        "run",
        model=GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)),
        args=training_args(tmp_path / "o", max_steps=4, save_steps=2),
    )
    wide_before = {n: v.clone() for n, v in wide.model.state_dict().items()}
    with pytest.raises(TensorMismatch, match=r"model\.transformer\.wte\.weight: the commit holds float32\[64, 16\]"):
        wide.train(resume_from_checkpoint=True)
    assert all(torch.equal(v, wide_before[n]) for n, v in wide.model.state_dict().items())  # nothing written
    assert all(torch.equal(v, before[n]) for n, v in fresh.model.state_dict().items())
    only_model = make_trainer(
        root, "slim", args=training_args(tmp_path / "o", max_steps=2, save_steps=2, save_only_model=True)
    )
    only_model.train()
    with pytest.raises(StateMismatch, match="save_only_model"):
        fresh.train(resume_from_checkpoint="slim/checkpoint-2")
    with pytest.raises(InvalidName):
        make_trainer(root, "../up")


def test_a_trainer_that_skips_an_override_fails_at_once(trained: Any, tmp_path: Path) -> None:
    """Should Trainer stop calling one of the private methods this adapter overrides, the first
    step (or the save) raises instead of resuming or saving in part."""
    root, _ = trained

    class SkipsRng(ShardstoreTrainer):
        def _load_rng_state(self, checkpoint: Any) -> None:
            return Trainer._load_rng_state(self, checkpoint)

    class SavesFiles(ShardstoreTrainer):
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            return None

    args = training_args(tmp_path / "o", max_steps=4, save_steps=2)
    with pytest.raises(StateMismatch, match=r"did not load \['rng'\]"):
        make_trainer(root, "run", cls=SkipsRng, args=args).train(resume_from_checkpoint="run/checkpoint-2")
    with pytest.raises(StateMismatch, match="without Trainer._save_checkpoint"):
        make_trainer(root, "files", cls=SavesFiles, args=args).train()


def test_the_adapter_is_a_trainer_with_the_mixin_first() -> None:
    # that importing shardstore imports no transformers: tests/shardstore/test_adapters_layer.py
    import shardstore.transformers as mod

    assert mod.ShardstoreTrainer.__mro__[1] is ShardstoreTrainerMixin and issubclass(mod.ShardstoreTrainer, Trainer)


def test_readme_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"### Using shardstore from the Hugging Face Trainer\s+.*?```python\n(.*?)```", readme, re.S)
    assert block is not None
    code = block.group(1)
    for path in ("/tmp/hf-store", "/tmp/hf-export", "/tmp/hf-output"):
        assert path in code
        code = code.replace(path, str(tmp_path / path.rsplit("/", 1)[1]))
    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - our own README
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf-export")
    assert all(torch.equal(v, ns["again"].model.state_dict()[n]) for n, v in loaded.state_dict().items())


if __name__ == "__main__":  # the bitwise test's processes: zygote ROOT ROLE... | role ROOT ROLE
    if sys.argv[1] == "zygote":
        zygote(Path(sys.argv[2]), sys.argv[3:])
    else:
        run_role(sys.argv[3], Path(sys.argv[2]))
