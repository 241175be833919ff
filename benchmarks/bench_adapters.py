"""The framework adapters against each framework's own checkpoint files (issue 31, item 5).

Not a test. One model of ``--mib`` MiB of training state (float32 weights and both AdamW
moments: a stack of square linear layers), trained one step through each framework, then,
interleaved, ``--reps`` times (each repetition in another order):

- **Lightning**: ``trainer.save_checkpoint`` through Lightning's default ``TorchCheckpointIO``
  (``torch.save`` of the checkpoint dict) against ``shardstore.lightning.ShardstoreCheckpointIO``;
  restore: the plugin's ``load_checkpoint`` then ``load_state_dict`` of the module and the
  optimizer (what ``fit(ckpt_path=...)`` does before training), page cache dropped first;
- **Hugging Face Trainer**: ``Trainer._save_checkpoint`` (safetensors weights, ``optimizer.pt``,
  scheduler, RNG, ``trainer_state.json``) against ``shardstore.transformers.ShardstoreTrainer``'s
  (a commit); restore: ``train(resume_from_checkpoint=...)`` of each, Trainer's own resume path,
  with the one step left to train (the same work on both sides), page cache dropped first. The
  restore time is that of the resume's own work inside that call: the methods through which
  Trainer loads a checkpoint (``RESUME``: on each side the ones its resume runs through, summed,
  outermost calls only); the whole call (Trainer's setup, the resume, one training step) is a
  column of its own.

Then the frozen half: half the layers stop training, one more step, and a second save of
each: the bytes it writes (the new checkpoint's files; the store's new objects) against the
changed half. Every restore is compared bitwise with the state saved.

    python benchmarks/bench_adapters.py [--mib 256] [--reps 3] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _dist_bench import ROOT, can_drop, commit, load, rotated
from _results import write_block

import shardstore as ss

MIB = 1 << 20
WIDTH = 1024  # each layer a WIDTH x WIDTH float32 matrix: 4 MiB, 12 MiB of training state with its moments
# The methods a resume does its work in (transformers 5.24.0), timed inside ``train(resume_from_checkpoint=...)``:
# Trainer's reads of the checkpoint directory, and the adapter's overrides of them (the commit is read once,
# by ``_read_tree``). What else ``train`` does (building the optimizer and data loader, the Accelerator's
# preparation, the training step, finalising) is the same on both sides and is not restore.
RESUME = {
    "Trainer": (
        "_load_from_checkpoint",  # model.safetensors into the model
        "_load_optimizer_and_scheduler",  # optimizer.pt, scheduler.pt
        "_load_scaler",
        "_load_rng_state",  # rng_state.pth
        "_init_training_state",  # trainer_state.json (and the callbacks' state)
    ),
    "ShardstoreTrainer": (
        "_resolve",  # the ref
        "_open",  # the commit: its manifests and tree, read and checked once
        "_load_resumed_model",
        "_load_optimizer_and_scheduler",
        "_load_scaler",
        "_load_rng_state",
        "_init_training_state",
    ),
}
MARKERS = (
    "<!-- bench_adapters:begin -->",
    "<!-- bench_adapters:end -->",
    "## Framework adapters against the frameworks' own checkpoints",
)


def _layers(mib: int) -> int:
    return max(2, -(-mib // 12))


def _drop(enabled: bool) -> None:
    if enabled:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def _tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(path) for n in ns)


def _store_bytes(store: ss.Store) -> int:
    return sum(store.object_size(o) or 0 for o in store.objects())


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _Clock:
    """Wall time and the process's CPU time (all its threads) spent inside the calls it wraps,
    summed (a wrapped call inside another counts once)."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.cpu = 0.0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t0
                self.cpu += time.process_time() - c0
                self._depth -= 1

        return timed


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(p.detach().clone())
        if p in opt.state:
            out += [opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _freeze_half(model: torch.nn.Module) -> int:
    """Stop the first half of the layers training; the bytes of state that still change."""
    layers = list(model.modules())[1:] if not hasattr(model, "net") else list(model.net)
    half = len(layers) // 2
    changed = 0
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            p.requires_grad_(i >= half)
            changed += 0 if i < half else 3 * p.numel() * p.element_size()
    return changed


# -- Lightning -------------------------------------------------------------------------------


def lightning(args: argparse.Namespace, work: str, drop_ok: bool) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from shardstore.lightning import ShardstoreCheckpointIO

    n = _layers(args.mib)

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n)))

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters()], lr=1e-3)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, WIDTH)), batch_size=4)
    module = Stack()
    trainer = pl.Trainer(
        max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False
    )
    trainer.fit(module, data)
    opt = trainer.optimizers[0]
    saved = _state(module, opt)
    ios = {
        "TorchCheckpointIO (torch.save)": TorchCheckpointIO(),
        # module=: a resume reads the weights into the module's own tensors (shardstore/lightning.py)
        "ShardstoreCheckpointIO": ShardstoreCheckpointIO(os.path.join(work, "lightning-store"), module=module),
    }
    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "restore": [], "cpu": [], "call": []} for m in ios}
    for rep in range(args.reps):
        for name in rotated(list(ios), rep):
            io = ios[name]
            path = os.path.join(work, "lightning", f"rep{rep}-{'ss' if 'Shard' in name else 'torch'}.ckpt")
            trainer.strategy.checkpoint_io = io
            times[name]["save"].append(_timed(lambda: trainer.save_checkpoint(path)))
            with torch.no_grad():
                for p in module.parameters():
                    p.zero_()
            _drop(drop_ok)

            def restore(io: Any = io, path: str = path) -> None:
                ckpt = io.load_checkpoint(path)
                module.load_state_dict(ckpt["state_dict"])
                opt.load_state_dict(ckpt["optimizer_states"][0])

            c0 = time.process_time()
            times[name]["restore"].append(_timed(restore))
            times[name]["cpu"].append(time.process_time() - c0)
            times[name]["call"].append(times[name]["restore"][-1])  # the restore is the whole call
            if not _same(_state(module, opt), saved):
                raise SystemExit(f"Lightning, {name}: the restore differs from the state saved")
    # the frozen half: one more step, then a second save of each
    changed = _freeze_half(module)
    opt.zero_grad(set_to_none=True)  # Lightning leaves the last step's gradients in place
    loss = module.net(torch.randn(4, WIDTH)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    second: dict[str, int] = {}
    for name, io in ios.items():
        trainer.strategy.checkpoint_io = io
        path = os.path.join(work, "lightning", f"second-{'ss' if 'Shard' in name else 'torch'}.ckpt")
        if isinstance(io, ShardstoreCheckpointIO):
            before = _store_bytes(io.store)
            trainer.save_checkpoint(path)
            second[name] = _store_bytes(io.store) - before
        else:
            trainer.save_checkpoint(path)
            second[name] = _tree_bytes(path)
    state = sum(t.numel() * t.element_size() for t in saved)
    return {"times": times, "second": second, "changed": changed, "state": state}


# -- the Hugging Face Trainer ------------------------------------------------------------------


def hugging_face(args: argparse.Namespace, work: str, drop_ok: bool) -> dict[str, Any] | None:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerState, TrainingArguments
        from transformers.utils import logging as hf_logging

        from shardstore.transformers import ShardstoreTrainer
    except ImportError as e:  # the adapter not installed: said in the table
        return {"skipped": str(e)}
    hf_logging.set_verbosity_error()
    layers = max(1, -(-(args.mib - 48) // 145))  # at least --mib: ~145 MiB of state a layer, ~48 MiB the rest

    def model() -> Any:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=2048,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=64,
        )
        return LlamaForCausalLM(config)

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 2048, (64, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def arguments(out: str, steps: int) -> Any:
        return TrainingArguments(
            out,
            max_steps=steps,
            save_strategy="no",
            per_device_train_batch_size=2,
            use_cpu=True,
            report_to="none",
            disable_tqdm=True,
            logging_strategy="no",
        )

    out = os.path.join(work, "hf")
    trainers = {
        "Trainer (safetensors + optimizer.pt)": Trainer(model=model(), args=arguments(out, 1), train_dataset=Tokens()),
        "ShardstoreTrainer": ShardstoreTrainer(
            model=model(), args=arguments(out + "-ss", 1), train_dataset=Tokens(), store=os.path.join(work, "hf-store")
        ),
    }
    for t in trainers.values():
        t.train()
    clock = _Clock()
    for t in trainers.values():  # each instance's resume methods, timed (an instance attribute shadows the class's)
        for method in RESUME[type(t).__name__]:
            setattr(t, method, clock.wrap(getattr(t, method)))
    load_from_json = TrainerState.__dict__["load_from_json"]  # Trainer.train reads trainer_state.json itself too
    TrainerState.load_from_json = classmethod(clock.wrap(load_from_json.__func__))
    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "restore": [], "cpu": [], "call": []} for m in trainers}
    try:
        for rep in range(args.reps):
            for name in rotated(list(trainers), rep):
                t = trainers[name]
                step = 100 + rep
                t.state.global_step = step
                times[name]["save"].append(_timed(lambda t=t: t._save_checkpoint(t.model, None)))
                target = (
                    t.checkpoint_ref(step)
                    if isinstance(t, ShardstoreTrainer)
                    else os.path.join(out, f"checkpoint-{step}")
                )
                with torch.no_grad():
                    for p in t.model.parameters():
                        p.zero_()
                _drop(drop_ok)
                # Trainer's own resume: load everything, then the one step left (the same for both)
                t.args.max_steps = step + 1
                clock.spent = clock.cpu = 0.0
                call = _timed(lambda t=t, target=target: t.train(resume_from_checkpoint=target))
                times[name]["call"].append(call)
                times[name]["restore"].append(clock.spent)
                times[name]["cpu"].append(clock.cpu)
            # Both trainers started equal and each resumed its own checkpoint and took the same step:
            # a restore that lost anything leaves the two apart.
            a, b = (_state(t.model, t.optimizer) for t in trainers.values())
            if not _same(a, b):
                raise SystemExit("Hugging Face Trainer: the two resumed runs differ (a restore lost state)")
    finally:
        TrainerState.load_from_json = load_from_json
    # the frozen half: half the parameters stop training, one more step, a second save of each
    second: dict[str, int] = {}
    changed = 0
    for name, t in trainers.items():
        m = t.model
        frozen = [m.model.embed_tokens, *m.model.layers[: max(1, layers // 2)]]
        for module in frozen:
            for p in module.parameters():
                p.requires_grad_(False)
        t.optimizer.zero_grad(set_to_none=True)
        t.state.global_step = 999  # the first of the two saves
        t._save_checkpoint(m, None)
        batch = Tokens()[0]
        m(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        changed = sum(3 * p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
        t.state.global_step = 1000
        if isinstance(t, ShardstoreTrainer):
            before = _store_bytes(t.store)
            t._save_checkpoint(m, None)
            second[name] = _store_bytes(t.store) - before
        else:
            t._save_checkpoint(m, None)
            second[name] = _tree_bytes(os.path.join(out, "checkpoint-1000"))
    state = sum(3 * p.numel() * p.element_size() for p in trainers["ShardstoreTrainer"].model.parameters())
    return {"times": times, "second": second, "changed": changed, "state": state}


# -- tables ------------------------------------------------------------------------------------


def _rows(framework: str, result: dict[str, Any], ours: str, peer: str) -> tuple[list[str], list[str]]:
    lines = []
    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in result["times"].items()}
    for m, t in result["times"].items():
        s, r, u, c = t["save"], t["restore"], t["cpu"], t["call"]
        lines.append(
            f"| {framework} | {m} | {statistics.median(s):.2f} ({min(s):.2f}–{max(s):.2f}) | "
            f"{statistics.median(r):.2f} ({min(r):.2f}–{max(r):.2f}) | {statistics.median(u):.2f} | "
            f"{statistics.median(c):.2f} ({min(c):.2f}–{max(c):.2f}) | {result['second'][m] / MIB:.1f} |"
        )
    save = med[peer]["save"] / med[ours]["save"]
    restore = med[peer]["restore"] / med[ours]["restore"]
    cpu = med[peer]["cpu"] / med[ours]["cpu"]
    frozen = result["second"][ours]
    changed = result["changed"]
    targets = [
        f"| {framework}: save ≥ 1.0× {peer} | {save:.2f}× | {'yes' if save >= 1 else '**no**'} |",
        f"| {framework}: restore ≥ 1.0× {peer} | {restore:.2f}× | {'yes' if restore >= 1 else '**no**'} |",
        f"| {framework}: restore CPU time, {peer} ÷ ours (no target; robust to load) | {cpu:.2f}× | — |",
        f"| {framework}: the second save writes the frozen half zero times | {frozen / MIB:.1f} MiB written for a "
        f"{changed / MIB:.1f} MiB changed half ({peer}: {result['second'][peer] / MIB:.1f} MiB) | "
        f"{'yes' if frozen < changed + 8 * MIB else '**no**'} |",
    ]
    return lines, targets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="training state, MiB (weights and both AdamW moments)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warm", action="store_true", help="never drop the page cache (smoke runs)")
    ap.add_argument("--results", default=None, help="write the table into this RESULTS.md")
    args = ap.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    drop_ok = not args.warm and can_drop()
    start = load()
    work = tempfile.mkdtemp(prefix="bench-adapters-", dir=os.path.dirname(ROOT))
    rows: list[str] = []
    targets: list[str] = []
    state = ""
    try:
        got = lightning(args, work, drop_ok)
        r, t = _rows("Lightning", got, "ShardstoreCheckpointIO", "TorchCheckpointIO (torch.save)")
        rows += r
        targets += t
        state = f"Lightning {got['state'] / MIB:.0f} MiB ({_layers(args.mib)} layers of {WIDTH}×{WIDTH} float32)"
        hf = hugging_face(args, work, drop_ok)
        if hf is None or "skipped" in hf:
            rows.append(f"| Hugging Face Trainer | skipped: {hf['skipped'] if hf else 'no adapter'} | | | | | |")
        else:
            r, t = _rows("Hugging Face Trainer", hf, "ShardstoreTrainer", "Trainer (safetensors + optimizer.pt)")
            rows += r
            targets += t
            state += f", Hugging Face {hf['state'] / MIB:.0f} MiB (a Llama of 1024 wide)"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"`python benchmarks/bench_adapters.py --mib {args.mib} --reps {args.reps}`",
        "",
        f"commit {commit()}; {os.cpu_count()} cores ({platform.processor() or platform.machine()}); load average "
        f"{start} at the start, {load()} at the end; torch {torch.__version__}; training state (weights and both "
        f"AdamW moments): {state}.",
        "Page cache before each restore: " + ("dropped (as root)." if drop_ok else "NOT dropped (warm)."),
        "Medians of the repetitions (min–max), interleaved. Lightning: every restore compared bitwise with the state saved; Hugging Face: the two trainers, equal before, compared bitwise after each resumed its own checkpoint and took the step left.",
        "",
        "Restore: Lightning, the plugin's load_checkpoint and the module's and optimizer's load_state_dict (the "
        "whole call); Hugging Face, the resume's own work inside train(resume_from_checkpoint=...): the methods "
        "Trainer loads a checkpoint through and the adapter's overrides of them (RESUME in the script), summed. "
        "The whole call (Trainer's setup, the resume, the one step left, finalising) is its own column.",
        "",
        "Restore CPU s: the process's CPU time (every thread) over the same span, median; on a loaded machine the "
        "figure the load moves least.",
        "",
        "| framework | checkpoint | save s | restore s | restore CPU s | whole call s | second save, half frozen: "
        "MiB written |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "**targets** (issue 31, item 5)",
        "",
        "| target | figure | met |",
        "|---|---|---|",
        *targets,
    ]
    text = "\n".join(lines)
    print(text)
    if args.results:
        write_block(args.results, *MARKERS, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
