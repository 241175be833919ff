"""shardtrain pipeline: throughput per schedule and worker count, the stall per commit, and
greedy generation with and without the KV cache. Not a test.

Three parts, each one table of ratios against peers measured in the same run:

- ``throughput``: tokens/s of a full update (forward, backward, clipping, AdamW) for 1, 2
  and 3 local workers (Gloo on 127.0.0.1, one thread each), with the ``synchronous`` and
  the ``overlapped`` schedule. One launch per worker count runs both schedules step by
  step in turn (A B A B ...), and the launches go round twice (1 2 3 1 2 3); medians of the
  slowest worker's step time, with min-max. Also per step: the share of its step the most
  blocked worker spent waiting in receives, the CPU time of the busiest worker (on a machine
  shared with other work, wall-clock speedups understate what the schedule allows; the
  1-minute load average is printed), the cores the workers really got (their CPU seconds
  per second of step), and the point-to-point bytes.
- ``stall``: 2 workers train and commit every other step, alternately with synchronous
  commits (``save_distributed`` in the step loop) and background commits
  (``shardtrain.run.committer``: one staging copy, the protocol in a background thread); the
  stall is the time the step loop is blocked in the commit call. Each is paired with a
  memcpy of the slot's state (weights and both Adam moments) into an already-touched
  buffer, measured right before it. The first background commit (which allocates the
  staging arena) is reported apart. The update time of a step overlapping a background
  write is reported next to that of a quiet step (the write competes for the cores).
- ``generate``: greedy generation in one process through ``shardtrain.engine.ring.Ring``,
  with its per-layer KV cache against recomputing the whole prefix for every new token,
  at 64 and 256 new tokens (no stop token), alternating the two methods.

    python benchmarks/bench_pipeline.py [--part throughput,stall,generate] [--steps 6] [--reps 3]
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

import shardstore
from shardstore import CommitInfo
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
    launch_local,
)
from shardtrain.engine.ring import Ring
from shardtrain.run.committer import Committer

# Big enough that compute, not per-message or per-op overhead, decides the step time.
CONFIG = LlamaConfig(
    vocab_size=2048,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
ROWS, SEQ, MICROBATCH = 8, 128, 2
GROUPS = {"decay": GroupConfig(lr=1e-3, weight_decay=0.1), "no_decay": GroupConfig(lr=1e-3)}
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SCHEDULES = ("synchronous", "overlapped")


def make_batch(step: int) -> Batch:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ + 1), generator=g)
    return Batch(seq[:, :-1].contiguous(), seq[:, 1:].contiguous(), torch.ones(ROWS, SEQ))


def _setup(ctx: WorkerContext, schedule: str, steps: int) -> tuple[torch.nn.Module, Pipeline, AdamW, Trainer]:
    torch.set_num_threads(1)
    partition = Partition.even(CONFIG.num_hidden_layers, ctx.world_size)
    stage = build_stage(CONFIG, partition, ctx.rank, seed=0)
    pipe = Pipeline(stage, partition, ctx.rank, timeout=ctx.timeout, schedule=schedule)
    opt = AdamW(stage.named_parameters(), GROUPS, schedule=Schedule(0, steps))
    return stage, pipe, opt, Trainer(pipe, opt, microbatch_size=MICROBATCH, max_grad_norm=1.0)


def throughput_worker(ctx: WorkerContext, out_dir: str, steps: int, warmup: int) -> None:
    _, pipe, _, trainer = _setup(ctx, SCHEDULES[0], 2 * (steps + warmup))
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    sent: dict[str, list[int]] = {s: [] for s in SCHEDULES}
    waits: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    cpu: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    for i in range(2 * (warmup + steps)):
        name = SCHEDULES[i % 2]  # A B A B ...
        pipe.schedule = name
        before, waited = pipe.bytes_sent, pipe.wait_seconds
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.step(make_batch(i))
        if i >= 2 * warmup:
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            sent[name].append(pipe.bytes_sent - before)
            waits[name].append(pipe.wait_seconds - waited)
    Path(out_dir, f"rank{ctx.rank}.json").write_text(
        json.dumps({"times": times, "sent": sent, "waits": waits, "cpu": cpu})
    )


def _state_bytes(stage: torch.nn.Module, opt: AdamW) -> list[torch.Tensor]:
    _, params = opt.state_export()
    out = [p.detach() for p in stage.parameters()]
    for st in params.values():
        out += [st["exp_avg"], st["exp_avg_sq"]]
    return out


def stall_worker(ctx: WorkerContext, out_dir: str, store_url: str, commits: int) -> None:
    stage, pipe, opt, trainer = _setup(ctx, "overlapped", 4 * commits + 4)
    store = shardstore.open_store(store_url)
    background = Committer(
        store, stage, opt, rank=ctx.rank, ref="background", last=(0, None), asynchronous=True, timeout=ctx.timeout
    )
    inline = Committer(store, stage, opt, rank=ctx.rank, ref="inline", last=(0, None), asynchronous=False)
    rec: dict[str, list[float]] = {
        "sync": [],
        "sync memcpy": [],
        "async": [],
        "async memcpy": [],
        "async first": [],
        "step quiet": [],
        "step during write": [],
    }
    buf: torch.Tensor | None = None
    step = 0

    def train_one(key: str | None) -> None:
        nonlocal step
        t0 = time.perf_counter()
        trainer.step(make_batch(step))
        if key is not None:
            rec[key].append(time.perf_counter() - t0)
        step += 1

    def memcpy() -> float:
        nonlocal buf
        tensors = _state_bytes(stage, opt)
        total = sum(t.numel() for t in tensors)
        if buf is None:
            buf = torch.ones(total, dtype=torch.float32)  # touched once, reused
        t0 = time.perf_counter()
        off = 0
        for t in tensors:
            buf[off : off + t.numel()].view(t.shape).copy_(t)
            off += t.numel()
        return time.perf_counter() - t0

    train_one(None)  # warm-up, and every parameter has Adam state
    for i in range(2 * commits + 1):
        kind = "async" if i % 2 == 0 else "sync"  # A B A B ...; the first async one allocates the arena
        info = CommitInfo(step=step, job="bench", config=CONFIG.to_hf_dict())
        peer = memcpy()  # the paired peer, right before the commit (same machine load)
        t0 = time.perf_counter()
        (background if kind == "async" else inline).commit(info)
        dt = time.perf_counter() - t0
        train_one("step during write" if kind == "async" else "step quiet")
        if kind == "async":
            background.drain()  # at most one in flight; keeps the pairs independent
            train_one(None)
        if i == 0:
            rec["async first"].append(dt)
            continue
        rec[kind].append(dt)
        rec[f"{kind} memcpy"].append(peer)
    background.close()
    nbytes = sum(t.numel() * t.element_size() for t in _state_bytes(stage, opt))
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps({"rec": rec, "bytes": nbytes}))


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:9.1f} {f'{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}':>15s}"


def part_throughput(steps: int, warmup: int) -> None:
    runs: dict[tuple[int, str], list[float]] = {}
    blocked: dict[tuple[int, str], list[float]] = {}
    cpu: dict[tuple[int, str], list[float]] = {}
    cores: dict[tuple[int, str], list[float]] = {}
    p2p: dict[tuple[int, str], int] = {}
    load = [os.getloadavg()[0]]
    for _round in range(2):
        for n in (1, 2, 3):
            with tempfile.TemporaryDirectory() as d:
                launch_local(throughput_worker, n, (d, steps, warmup), env=ENV, timeout=timedelta(seconds=300))
                ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(n)]
            for name in SCHEDULES:
                step_times = [max(r["times"][name][i] for r in ranks) for i in range(steps)]  # slowest worker
                runs.setdefault((n, name), []).extend(step_times)
                # The share of its step the most-blocked worker spent waiting for messages.
                blocked.setdefault((n, name), []).extend(
                    max(r["waits"][name][i] / r["times"][name][i] for r in ranks) for i in range(steps)
                )
                cpu.setdefault((n, name), []).extend(max(r["cpu"][name][i] for r in ranks) for i in range(steps))
                # CPU seconds all workers got per second of the step: the cores this run really had.
                cores.setdefault((n, name), []).extend(
                    sum(r["cpu"][name][i] for r in ranks) / step_times[i] for i in range(steps)
                )
                p2p[(n, name)] = int(statistics.median(sum(r["sent"][name][i] for r in ranks) for i in range(steps)))
            load.append(os.getloadavg()[0])
    tokens = ROWS * SEQ
    base = tokens / statistics.median(runs[(1, "synchronous")])
    print(
        f"model: {CONFIG.num_hidden_layers} layers, hidden {CONFIG.hidden_size}, vocab {CONFIG.vocab_size}; batch "
        f"{ROWS} x {SEQ} ({tokens} tokens), microbatch {MICROBATCH}; {2 * steps} timed steps per configuration "
        f"(2 launches x {steps}) after {warmup} warm-up each; torch {torch.__version__}, {os.cpu_count()} CPUs; "
        f"1-minute load average {min(load):.1f}-{max(load):.1f} during the part"
    )
    print(
        f"{'workers':>7s} {'schedule':12s} {'step ms':>9s} {'min-max':>15s} {'tokens/s':>9s} {'vs 1 worker':>11s} "
        f"{'vs synchronous':>14s} {'blocked in recv':>15s} {'busiest cpu ms':>14s} {'cores used':>10s} "
        f"{'p2p bytes/step':>15s}"
    )
    for n in (1, 2, 3):
        for name in SCHEDULES:
            rate = tokens / statistics.median(runs[(n, name)])
            sync_rate = tokens / statistics.median(runs[(n, "synchronous")])
            share = statistics.median(blocked[(n, name)])
            print(
                f"{n:7d} {name:12s} {_med(runs[(n, name)])} {rate:9.0f} {rate / base:11.2f} {rate / sync_rate:14.2f} "
                f"{share:15.0%} {statistics.median(cpu[(n, name)]) * 1e3:14.0f} "
                f"{statistics.median(cores[(n, name)]):10.2f} {p2p[(n, name)]:15,d}"
            )
    two = tokens / statistics.median(runs[(2, "overlapped")])
    one = tokens / statistics.median(runs[(1, "overlapped")])
    print(
        f"goal: 2 workers (overlapped) >= 1.5x the tokens/s of 1 worker: {two / one:.2f}x -> "
        f"{'met' if two / one >= 1.5 else 'NOT met'}"
    )
    split = statistics.median(cpu[(1, "overlapped")]) / statistics.median(cpu[(2, "overlapped")])
    print(
        f"CPU time of the busiest of 2 workers per step vs 1 worker's: {split:.2f}x less (the speedup a machine "
        f"with a free core per worker would allow, less the time blocked in receives)"
    )


def part_stall(commits: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        launch_local(stall_worker, 2, (d, store, commits), env=ENV, timeout=timedelta(seconds=300))
        ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(2)]
    print(
        f"2 workers, {commits} commits of each kind, alternating; slot state {ranks[0]['bytes'] / 2**20:.1f} MiB "
        f"(slot 0) and {ranks[1]['bytes'] / 2**20:.1f} MiB (slot 1); ms, slowest slot per commit"
    )
    rec = {k: [max(r["rec"][k][i] for r in ranks) for i in range(len(ranks[0]["rec"][k]))] for k in ranks[0]["rec"]}
    memcpy = statistics.median(rec["sync memcpy"] + rec["async memcpy"])
    print(f"{'what':44s} {'median':>9s} {'min-max':>15s} {'vs memcpy':>10s}")
    for key, label in (
        ("sync", "stall: synchronous commit"),
        ("async", "stall: background commit"),
        ("async first", "stall: first background commit (allocates)"),
        ("async memcpy", "peer: memcpy of the slot's state"),
        ("step quiet", "update time, no write in flight"),
        ("step during write", "update time, background write in flight"),
    ):
        print(f"{label:44s} {_med(rec[key])} {statistics.median(rec[key]) / memcpy:10.2f}")
    pairs = [a / m for a, m in zip(rec["async"], rec["async memcpy"])]
    ratio = statistics.median(pairs)
    print(
        f"goal: background stall <= 1.5x memcpy (median of paired ratios): {ratio:.2f}x -> "
        f"{'met' if ratio <= 1.5 else 'NOT met'}; synchronous/background stall: "
        f"{statistics.median(rec['sync']) / statistics.median(rec['async']):.1f}x"
    )


def _recompute(ring: Ring, prompt: list[int], new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(new):
        logits = ring.forward(torch.tensor([seq]))  # the whole prefix, every time
        assert logits is not None
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


def part_generate(reps: int) -> None:
    torch.set_num_threads(1)
    partition = Partition.even(CONFIG.num_hidden_layers, 1)
    ring = Ring(build_stage(CONFIG, partition, 0, seed=0), partition, 0, timeout=60)
    prompt = torch.randint(0, CONFIG.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    print(
        f"one process, model as above, prompt {len(prompt)} tokens, greedy, no stop token, {reps} repetitions "
        f"alternating the methods"
    )
    print(f"{'new tokens':>10s} {'method':22s} {'seconds':>9s} {'min-max':>15s} {'tokens/s':>9s} {'vs recompute':>12s}")
    for new in (64, 256):
        t: dict[str, list[float]] = {"kv cache": [], "recompute prefix": []}
        outs = {}
        for _ in range(reps):
            for name in t:
                t0 = time.perf_counter()
                outs[name] = (
                    ring.generate(prompt, max_new_tokens=new, stop=set())
                    if name == "kv cache"
                    else _recompute(ring, prompt, new)
                )
                t[name].append(time.perf_counter() - t0)
        same = outs["kv cache"] == outs["recompute prefix"]
        rec = statistics.median(t["recompute prefix"])
        for name, xs in t.items():
            m = statistics.median(xs)
            print(f"{new:10d} {name:22s} {m:9.3f} {f'{min(xs):.3f}-{max(xs):.3f}':>15s} {new / m:9.0f} {rec / m:12.2f}")
        print(f"{'':10s} same tokens from both methods: {same}")
    print("goal: KV cache >= 3x recomputation at 256 new tokens (see the row above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="throughput,stall,generate")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per schedule and launch (throughput)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--commits", type=int, default=6, help="commits of each kind (stall)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per method (generate)")
    args = parser.parse_args()
    parts = args.part.split(",")
    for part in parts:
        print(f"## {part}")
        if part == "throughput":
            part_throughput(args.steps, args.warmup)
        elif part == "stall":
            part_stall(args.commits)
        elif part == "generate":
            part_generate(args.reps)
        else:
            raise SystemExit(f"unknown part {part!r}")


if __name__ == "__main__":
    main()
