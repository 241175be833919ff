"""Ready for a GPU (issue 33, item 5): what one CUDA device must show, in one run of under 10
minutes, printed as one table. Not a test; it exits 1 if a check fails, and on a machine
without CUDA it says so and exits 0.

1. **The bf16-autocast profile on CUDA** (``shardtrain.engine.profile``), on a small untied
   Llama built by ``shardtrain.engine.partition.build_stage``:
   - *parity*: one forward and backward of a batch through the one-slot pipeline under the
     profile's autocast, against Hugging Face's ``LlamaForCausalLM`` holding the same weights
     under the same autocast on the same device (loss and global gradient norm, relative
     difference within ``PARITY``); the FP32 run of the same model must be ``AUTOCAST_GAP``
     times farther (autocast really acts). Skipped without transformers.
   - *bitwise replay*: three updates trained twice from the same seed in this process, with
     ``torch.use_deterministic_algorithms`` (``CUBLAS_WORKSPACE_CONFIG`` is set before torch
     loads CUDA), each committed with ``shardstore.save``: the same learned-state root and
     the same commit id.
2. **A 2-worker pipeline** (``shardtrain.workers.launch_local``): NCCL, one device each,
   where two devices exist; else Gloo with both workers on the one device (NCCL refuses two
   ranks on one device; Gloo has no point-to-point for CUDA tensors, so each message goes
   through host memory: ``engine.messages.Channel``). Three updates against the one-worker
   run on the same device: losses and gradient norms within ``PIPE_TOL`` relative.
3. **Save and restore of CUDA tensors against DCP**, the state of a model trained one step
   (weights and both moments on the device): ``shardstore.AsyncSaver`` (its staging arena is
   pinned host memory when the state is on CUDA) then ``shardstore.restore`` into fresh CUDA
   tensors, against ``dcp.async_save`` with ``DefaultStager(StagingOptions(use_pinned_memory=True))``
   then ``dcp.load``: the time the caller is blocked, the save's total, the restore, and
   whether every restored tensor is bitwise the saved one.
4. **Peak device memory against the planner's estimate**: ``torch.cuda.max_memory_allocated``
   over two updates of a one-slot model (bf16-autocast, with and without recomputation)
   against ``shardtrain.reshape.planner.MemoryModel.estimate(...).modelled`` (its terms
   without the CPU reserve); passes within ``MEMORY_BAND``.

    python benchmarks/gpu_check.py                  # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu     # the same logic on the CPU, tiny sizes (the smoke test)
"""

from __future__ import annotations

import os

# Deterministic cuBLAS needs this before torch initialises CUDA (bitwise replay, check 1).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardstore as ss  # noqa: E402
from shardtrain.engine.batch import Batch  # noqa: E402
from shardtrain.engine.model import LlamaConfig  # noqa: E402
from shardtrain.engine.optim import AdamW, GroupConfig, Schedule  # noqa: E402
from shardtrain.engine.partition import Partition, build_stage  # noqa: E402
from shardtrain.engine.pipeline import Pipeline  # noqa: E402
from shardtrain.engine.profile import Profile, compute_context  # noqa: E402
from shardtrain.engine.trainer import Trainer  # noqa: E402
from shardtrain.reshape.planner import MemoryModel  # noqa: E402
from shardtrain.workers.launch import WorkerContext, launch_local  # noqa: E402

#: Relative difference of the loss and the gradient norm, shardtrain against transformers under one
#: autocast. A weight's gradient leaves a bf16 product rounded to bf16, so kernels that differ in
#: shape or order (padded against trimmed sequences, the backward split per layer) move the norm
#: by ~2e-5 on this CPU (the loss: bit for bit with equal shapes); the FP32 run is ~8e-4 away.
PARITY = {"cpu": 1e-4, "cuda": 1e-3}
AUTOCAST_GAP = 3.0  # the FP32 run must be this many times farther than the bf16 difference
PIPE_TOL = 1e-5  # relative: 2 workers against 1 on one device (FP32 sums in another order)
MEMORY_BAND = (0.75, 1.25)  # estimate / measured peak
BF16 = Profile(name="bf16-autocast")
GROUPS = {
    "decay": GroupConfig(lr=3e-3, weight_decay=0.1),
    "no_decay": GroupConfig(lr=3e-3, weight_decay=0.0),
}


@dataclass(frozen=True)
class Sizes:
    """The model and batch of each check: small ones for parity, replay and the pipeline; a
    larger one for memory and the checkpoint (where a device's figures mean something)."""

    small: LlamaConfig
    large: LlamaConfig
    rows: int
    seq: int
    microbatch: int


def _config(hidden: int, layers: int, vocab: int, heads: int, kv: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=11 * hidden // 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


def sizes(device: torch.device) -> Sizes:
    if device.type == "cuda":
        return Sizes(_config(256, 4, 2048, 8, 4), _config(1024, 12, 32000, 16, 4), rows=8, seq=512, microbatch=4)
    return Sizes(_config(64, 2, 256, 4, 2), _config(64, 2, 256, 4, 2), rows=4, seq=32, microbatch=2)


@dataclass
class Row:
    check: str
    result: str
    ok: bool | None  # None: not run here (said why in ``result``)


def make_batch(config: LlamaConfig, *, seed: int, rows: int, seq: int) -> Batch:
    """Right-padded sequences of unequal lengths, an unweighted prompt prefix and varied weights."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(rows, seq, dtype=torch.int64)
    targets = torch.zeros(rows, seq, dtype=torch.int64)
    weights = torch.zeros(rows, seq, dtype=torch.float32)
    for r in range(rows):
        length = int(torch.randint(seq // 2, seq + 1, (1,), generator=g))
        ids = torch.randint(1, config.vocab_size, (length + 1,), generator=g)
        tokens[r, :length], targets[r, :length] = ids[:-1], ids[1:]
        prompt = int(torch.randint(1, length // 2 + 1, (1,), generator=g))
        weights[r, prompt:length] = 0.25 + 1.75 * torch.rand(length - prompt, generator=g)
    return Batch(tokens, targets, weights)


def trainer_for(config: LlamaConfig, device: torch.device, *, seed: int, profile: Profile | None, microbatch: int,
                recompute: bool = False) -> Trainer:  # fmt: skip
    """A one-slot trainer of the whole model on ``device``."""
    part = Partition.from_ranges([(0, config.num_hidden_layers)], config.num_hidden_layers)
    stage = build_stage(config, part, 0, seed=seed, device=device)
    pipe = Pipeline(stage, part, 0, compute=compute_context(profile, device), recompute=recompute)
    opt = AdamW(stage.named_parameters(), GROUPS, schedule=Schedule(warmup_steps=1, total_steps=8, min_ratio=0.1))
    return Trainer(pipe, opt, microbatch_size=microbatch, max_grad_norm=1.0)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def grad_norm(module: torch.nn.Module) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in module.parameters()])))


# -- 1. the profile: parity and bitwise replay -----------------------------------------------------------


def shardtrain_step(config: LlamaConfig, device: torch.device, batch: Batch, profile: Profile | None, mb: int):
    """(loss, gradient norm) of one forward and backward of the one-slot pipeline, and its stage."""
    trainer = trainer_for(config, device, seed=7, profile=profile, microbatch=mb)
    stage = trainer.pipeline.stage
    stage.zero_grad(set_to_none=True)
    loss = trainer.pipeline.forward_backward(batch, step=0, microbatch_size=mb)
    return float(loss), grad_norm(stage), stage


def hf_step(hf: Any, batch: Batch, device: torch.device, autocast: bool) -> tuple[float, float]:
    """The same step through transformers' model (test_own_model.py's loss: weighted CE over the weight sum)."""
    hf.zero_grad(set_to_none=True)
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else torch.enable_grad()
    with ctx:
        logits = hf(input_ids=batch.tokens.to(device)).logits  # (B, T, V)
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch.targets.to(device).flatten(), reduction="none"
        )
    weights = batch.weights.to(device)
    loss = (ce * weights.flatten()).sum() / weights.sum()
    loss.backward()
    return float(loss.detach()), grad_norm(hf)


def check_parity(device: torch.device, s: Sizes) -> list[Row]:
    try:
        from transformers import LlamaConfig as HFConfig
        from transformers import LlamaForCausalLM
    except ImportError:
        return [Row("bf16-autocast parity with transformers", "skipped: transformers is not installed", None)]
    # One microbatch: under autocast a weight's gradient comes out of a bf16 product, so the
    # pipeline's per-microbatch gradients, each rounded to bf16 before they are summed in FP32,
    # would differ from transformers' whole-batch one by bf16 rounding (~1e-5 in the norm).
    batch = make_batch(s.small, seed=11, rows=s.rows, seq=s.seq)
    ours_bf16 = shardtrain_step(s.small, device, batch, BF16, s.rows)
    ours_fp32 = shardtrain_step(s.small, device, batch, None, s.rows)
    hf = LlamaForCausalLM(HFConfig(**s.small.to_hf_dict())).to(device)
    missing, unexpected = hf.load_state_dict(ours_bf16[2].state_dict(), strict=False)
    if missing or any(k in dict(hf.named_parameters()) for k in unexpected):
        return [Row("bf16-autocast parity with transformers", f"weights do not map: missing {missing[:3]}", False)]
    theirs = hf_step(hf, batch, device, autocast=True)
    tol = PARITY[device.type]
    d_loss, d_norm = rel(ours_bf16[0], theirs[0]), rel(ours_bf16[1], theirs[1])
    d_fp32 = rel(ours_fp32[1], theirs[1])
    ok = d_loss <= tol and d_norm <= tol and d_fp32 > AUTOCAST_GAP * max(d_loss, d_norm)
    return [Row("bf16-autocast parity with transformers (one step)",
                f"loss {d_loss:.1e}, grad norm {d_norm:.1e} relative (≤ {tol:.0e}); the FP32 run's norm is "
                f"{d_fp32:.1e} away (> {AUTOCAST_GAP:.0f}× that: autocast acts)", ok)]  # fmt: skip


def train_and_commit(config: LlamaConfig, device: torch.device, s: Sizes, root: Path, name: str) -> tuple[str, str]:
    """Three updates from seed 3 under the profile, committed: (learned-state root, commit id)."""
    trainer = trainer_for(config, device, seed=3, profile=BF16, microbatch=s.microbatch)
    for step in range(3):
        trainer.step(make_batch(config, seed=100 + step, rows=s.rows, seq=s.seq))
    store = ss.open_store(str(root / name))
    cid = ss.save(store, trainer.pipeline.stage, trainer.optimizer, step=3, rng=False, profile="bf16-autocast")
    return store.commit(cid).learned_root, cid


def check_replay(device: torch.device, s: Sizes, root: Path) -> list[Row]:
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        a, b = (train_and_commit(s.small, device, s, root, f"replay-{i}") for i in range(2))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    same = a == b
    return [Row("bf16-autocast bitwise replay (3 updates, twice)",
                f"learned-state root {a[0][:12]}… {'=' if a[0] == b[0] else '≠'} {b[0][:12]}…; "
                f"commit id {'the same' if a[1] == b[1] else 'differs'}", same)]  # fmt: skip


# -- 2. the 2-worker pipeline ------------------------------------------------------------------------------


def pipeline_worker(ctx: WorkerContext, spec: str) -> None:
    """One slot of a pipeline of ``ctx.world_size``; writes its steps' (loss, grad norm) as JSON."""
    cfg = json.loads(spec)
    config = LlamaConfig.from_hf_dict(cfg["config"])
    device = torch.device(cfg["device"]) if cfg["device"] else ctx.device
    part = Partition.even(config.num_hidden_layers, ctx.world_size)
    stage = build_stage(config, part, ctx.rank, seed=3, device=device)
    pipe = Pipeline(stage, part, ctx.rank, compute=compute_context(BF16, device))
    opt = AdamW(stage.named_parameters(), GROUPS, schedule=Schedule(warmup_steps=1, total_steps=8, min_ratio=0.1))
    trainer = Trainer(pipe, opt, microbatch_size=cfg["microbatch"], max_grad_norm=1.0)
    steps = []
    for step in range(3):
        r = trainer.step(make_batch(config, seed=100 + step, rows=cfg["rows"], seq=cfg["seq"]))
        steps.append([r.loss, r.grad_norm])
    Path(cfg["out"], f"{ctx.world_size}-rank{ctx.rank}.json").write_text(json.dumps(steps))


def check_pipeline(device: torch.device, s: Sizes, root: Path) -> list[Row]:
    """Two workers against one, each in processes of their own with the same environment
    (``ATEN_CPU_CAPABILITY=default``: on the CPU, kernels must not depend on the machine)."""
    two = device.type == "cuda" and torch.cuda.device_count() >= 2
    backend = "nccl" if two else "gloo"
    where = {True: "cuda:0 and cuda:1", False: "cuda:0, both workers" if device.type == "cuda" else "cpu"}[two]
    spec = {"config": s.small.to_hf_dict(), "out": str(root), "rows": s.rows, "seq": s.seq, "microbatch": s.microbatch,
            "device": "cuda:0" if device.type == "cuda" and not two else None}  # fmt: skip
    env = {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    launch_local(pipeline_worker, 2, (json.dumps(spec),), backend=backend, env=env, timeout=timedelta(seconds=240))
    wall = time.perf_counter() - t
    one = {**spec, "device": "cuda:0" if device.type == "cuda" else None}
    launch_local(pipeline_worker, 1, (json.dumps(one),), backend=backend, env=env, timeout=timedelta(seconds=240))
    got, want = (json.loads((root / f"{n}-rank0.json").read_text()) for n in (2, 1))
    worst = max(rel(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
    return [Row(f"2-worker pipeline, {backend} on {where} (3 updates)",
                f"losses and grad norms within {worst:.1e} of 1 worker (≤ {PIPE_TOL:.0e}); {wall:.1f} s with start-up",
                worst <= PIPE_TOL)]  # fmt: skip


# -- 3. save and restore of CUDA tensors, against DCP ------------------------------------------------------


def trained_state(config: LlamaConfig, device: torch.device, s: Sizes, seed: int) -> Trainer:
    trainer = trainer_for(config, device, seed=seed, profile=BF16, microbatch=s.microbatch)
    trainer.step(make_batch(config, seed=5, rows=s.rows, seq=s.seq))
    return trainer


def flat_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Weights and both moments by name (the live tensors)."""
    out = {f"model/{n}": p.detach() for n, p in trainer.pipeline.stage.named_parameters()}
    _, params = trainer.optimizer.state_export()
    for n, st in params.items():
        out[f"exp_avg/{n}"], out[f"exp_avg_sq/{n}"] = st["exp_avg"], st["exp_avg_sq"]
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_checkpoint(device: torch.device, s: Sizes, root: Path) -> list[Row]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    src = trained_state(s.large, device, s, seed=1)
    want = {k: v.clone() for k, v in flat_state(src).items()}
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    rows = []
    # shardstore: AsyncSaver (pinned arena for CUDA state), then restore into a fresh model on the device
    store = ss.open_store(str(root / "store"))
    saver = ss.AsyncSaver(store)
    sync(device)
    t0 = time.perf_counter()
    saver.save(src.pipeline.stage, src.optimizer, step=1, rng=False)
    blocked = time.perf_counter() - t0
    cid = saver.close()
    total = time.perf_counter() - t0
    dst = trained_state(s.large, device, s, seed=2)
    sync(device)
    t0 = time.perf_counter()
    ss.restore(store, cid, dst.pipeline.stage, dst.optimizer)
    sync(device)
    restored = time.perf_counter() - t0
    same = all(torch.equal(flat_state(dst)[k], v) for k, v in want.items())
    rows.append(_ckpt_row("shardstore AsyncSaver + restore", nbytes, blocked, total, restored, same, device))
    # DCP: async_save with a pinned-memory stager, then load into a fresh model's tensors
    path = str(root / "dcp")
    sd = flat_state(src)
    cuda = device.type == "cuda"  # pinned memory and non-blocking copies need the accelerator
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_non_blocking_copy=cuda))
    sync(device)
    t0 = time.perf_counter()
    pending = dcp.async_save(sd, checkpoint_id=path, async_stager=stager)
    blocked = time.perf_counter() - t0
    done = getattr(pending, "upload_completion", pending)
    done.result()
    total = time.perf_counter() - t0
    stager.close()
    dst = trained_state(s.large, device, s, seed=3)
    into = flat_state(dst)
    sync(device)
    t0 = time.perf_counter()
    dcp.load(into, checkpoint_id=path)
    sync(device)
    restored = time.perf_counter() - t0
    same = all(torch.equal(flat_state(dst)[k], v) for k, v in want.items())
    rows.append(_ckpt_row("dcp.async_save (pinned stager) + dcp.load", nbytes, blocked, total, restored, same, device))
    return rows


def _ckpt_row(name: str, nbytes: int, blocked: float, total: float, restored: float, same: bool, device) -> Row:
    mib = nbytes / 2**20
    return Row(f"{name}, {mib:.0f} MiB on {device.type}",
               f"caller blocked {blocked:.2f} s, save {total:.2f} s, restore {restored:.2f} s; "
               f"{'every tensor bitwise equal' if same else 'RESTORED TENSORS DIFFER'}", same)  # fmt: skip


# -- 4. peak device memory against the planner -----------------------------------------------------------


def check_memory(device: torch.device, s: Sizes) -> list[Row]:
    if device.type != "cuda":
        return [Row("peak device memory against the planner", "skipped: CUDA only (tests/shardtrain/reshape/test_planner.py checks the "
                    "CPU estimate against the peak resident set)", None)]  # fmt: skip
    rows = []
    for recompute in (False, True):
        model = MemoryModel(s.large, seq_len=s.seq, microbatch_size=s.microbatch, microbatches=s.rows // s.microbatch,
                            autocast=True, recompute=recompute, reserve=0)  # fmt: skip
        est = model.estimate(0, range(s.large.num_hidden_layers)).modelled
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        trainer = trainer_for(s.large, device, seed=4, profile=BF16, microbatch=s.microbatch, recompute=recompute)
        for step in range(2):  # the moments exist from the first update on
            trainer.step(make_batch(s.large, seed=200 + step, rows=s.rows, seq=s.seq))
        peak = torch.cuda.max_memory_allocated(device) - base
        del trainer
        ratio = est / peak
        rows.append(Row(f"peak device memory, bf16-autocast{' +recompute' if recompute else ''}",
                        f"estimate {est / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB: {ratio:.2f} "
                        f"(band {MEMORY_BAND[0]}–{MEMORY_BAND[1]})", MEMORY_BAND[0] <= ratio <= MEMORY_BAND[1]))  # fmt: skip
    return rows


# -- the table -----------------------------------------------------------------------------------------------


def table(rows: list[Row], device: torch.device, wall: float) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (--device cpu: the logic only)"
    lines = [f"gpu_check on {name}; torch {torch.__version__}; {wall:.0f} s", "",
             "| check | result | pass |", "|---|---|---|"]  # fmt: skip
    for r in rows:
        mark = "yes" if r.ok else ("—" if r.ok is None else "**no**")
        lines.append(f"| {r.check} | {r.result} | {mark} |")
    return "\n".join(lines)


def run(device: torch.device, root: Path) -> list[Row]:
    s = sizes(device)
    rows: list[Row] = []
    rows += check_parity(device, s)
    rows += check_replay(device, s, root)
    rows += check_pipeline(device, s, root)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # DCP's async save wants a group
    try:
        rows += check_checkpoint(device, s, root)
    finally:
        dist.destroy_process_group()
    rows += check_memory(device, s)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: run the logic on tiny sizes")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: needs a CUDA device (torch.cuda.is_available() is False); nothing was checked.")
        return 0
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    root = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.dir))
    t = time.perf_counter()
    try:
        rows = run(device, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(rows, device, time.perf_counter() - t))
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
