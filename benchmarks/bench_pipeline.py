"""Step time and bytes exchanged per step of the shardtrain pipeline on 1, 2 and 3 workers.

Not a test. Trains a small Llama on synthetic batches with the local launcher (Gloo on
127.0.0.1, one thread per worker) and prints one table: median step time (min-max) over
the timed steps, the ratio to the 1-worker pipeline, point-to-point bytes sent per step
summed over all workers (headers and payloads), and the collective payload per step (the
gathered gradient-norm vector and the shared loss). A plain single-process step
(whole-model autograd + torch.optim.AdamW, same model and data) is measured in the same
run as a named peer.

    python benchmarks/bench_pipeline.py [--steps 6] [--warmup 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

from shardtrain import (
    AdamW,
    Batch,
    GroupConfig,
    LlamaConfig,
    Partition,
    Pipeline,
    Schedule,
    Trainer,
    WorkerContext,
    build_stage,
    canonical_parameter_names,
    launch_local,
)

CONFIG = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                     tie_word_embeddings=True)
ROWS, SEQ, MICROBATCH = 8, 64, 2
GROUPS = {"decay": GroupConfig(lr=1e-3, weight_decay=0.1), "no_decay": GroupConfig(lr=1e-3)}
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def make_batch(step: int) -> Batch:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ + 1), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (ROWS,), generator=g)
    weights = (torch.arange(SEQ)[None, :] < lengths[:, None]).float()  # (B, T) right padding
    return Batch(seq[:, :-1].contiguous(), seq[:, 1:].contiguous(), weights)


def bench_worker(ctx: WorkerContext, out_dir: str, steps: int, warmup: int) -> None:
    torch.set_num_threads(1)
    partition = Partition.even(CONFIG.num_hidden_layers, ctx.world_size)
    stage = build_stage(CONFIG, partition, ctx.rank, seed=0)
    pipe = Pipeline(stage, partition, ctx.rank, timeout=ctx.timeout)
    opt = AdamW(stage.named_parameters(), GROUPS, schedule=Schedule(0, warmup + steps))
    trainer = Trainer(pipe, opt, microbatch_size=MICROBATCH, max_grad_norm=1.0)
    times, sent = [], []
    for step in range(warmup + steps):
        batch = make_batch(step)
        before = pipe.bytes_sent
        t0 = time.perf_counter()
        trainer.step(batch)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            sent.append(pipe.bytes_sent - before)
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps({"times": times, "sent": sent}))


def monolithic(steps: int, warmup: int) -> list[float]:
    """The peer: whole model in one process, plain autograd and torch.optim.AdamW."""
    torch.set_num_threads(1)
    model = build_stage(CONFIG, Partition.even(CONFIG.num_hidden_layers, 1), 0, seed=0)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), foreach=False)
    times = []
    for step in range(warmup + steps):
        b = make_batch(step)
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(b.tokens)  # (B, T, V)
        ce = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), b.targets.reshape(-1), reduction="none")
        ((ce * b.weights.reshape(-1)).sum() / b.weights.sum()).backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    n_params = len(canonical_parameter_names(CONFIG))
    rows = []
    base = None
    for n in (1, 2, 3):
        with tempfile.TemporaryDirectory() as d:
            launch_local(bench_worker, n, (d, args.steps, args.warmup), env=ENV, timeout=timedelta(seconds=120))
            ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(n)]
        step_times = [max(r["times"][i] for r in ranks) for i in range(args.steps)]  # slowest worker's view
        p2p = statistics.median(sum(r["sent"][i] for r in ranks) for i in range(args.steps))
        # all_gather of the (P,) float64 norm vector from every rank, plus the float64 loss broadcast.
        coll = 0 if n == 1 else n * n_params * 8 + 8
        med = statistics.median(step_times)
        base = base or med
        rows.append((f"shardtrain pipeline, {n} worker{'s' if n > 1 else ''}", med, min(step_times),
                     max(step_times), med / base, p2p, coll))
    mono = monolithic(args.steps, args.warmup)
    rows.append(("peer: monolithic autograd + torch AdamW", statistics.median(mono), min(mono), max(mono),
                 statistics.median(mono) / base, 0, 0))
    n_weights = sum(p.numel() for p in build_stage(CONFIG, Partition.even(6, 1), 0, seed=0).parameters())
    print(f"model: {CONFIG.num_hidden_layers} layers, hidden {CONFIG.hidden_size}, {n_weights:,} parameters; "
          f"batch {ROWS} x {SEQ}, microbatch {MICROBATCH}; torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"1 thread per worker; {args.steps} timed steps after {args.warmup} warm-up")
    print(f"{'run':42s} {'step ms (median)':>16s} {'min-max':>15s} {'vs 1 worker':>11s} "
          f"{'p2p bytes/step':>15s} {'collective bytes/step':>21s}")
    for name, med, lo, hi, ratio, p2p, coll in rows:
        print(f"{name:42s} {med * 1e3:16.1f} {f'{lo * 1e3:.1f}-{hi * 1e3:.1f}':>15s} {ratio:11.2f} "
              f"{int(p2p):15,d} {coll:21,d}")


if __name__ == "__main__":
    main()
