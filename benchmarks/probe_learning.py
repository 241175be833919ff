"""Learnability probe: does the tiny Llama learn a task family in N updates? (Not timed.)

Trains on the embedded default's tokenizer and task generator in one process — ours
(`Trainer` on a 1-slot `Pipeline`, bitwise the same update as 2 or 3 workers) or, with
`--impl hf`, `transformers.LlamaForCausalLM` with `torch.optim.AdamW` as an independent
oracle — then generates 16 answers per trained family from fresh records (greedy, the
generation prompt of `encode_prompt`, exact match after strip, as `evaluate` does) and
prints the per-family correct counts; for lookup also how many answers were *some* value
of the table (`in_table`). The figures in docs/DEMO.md came from runs like

    python benchmarks/probe_learning.py --init-std 0.08 --lr 5e-3 --batch 32 --steps 600 --warmup 37 --mix filter
    python benchmarks/probe_learning.py --init-std 0.02 --lr 5e-3 --batch 32 --steps 600 --warmup 37 --mix filter
    python benchmarks/probe_learning.py --init-std 0.08 --lr 5e-3 --batch 32 --steps 5000 --warmup 50 --mix lookup \\
        --kv-heads 4 --rope-theta 500 --eval-every 1000

`--lookup-keys K` overrides the lookup table size (default: the generator's 3-4) to probe
how hard retrieval is (K=1 is a positional copy).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from collections.abc import Callable

import torch

import shardtrain.job.tasks as tasks
from shardtrain.engine.batch import Batch
from shardtrain.engine.model import LlamaConfig
from shardtrain.engine.optim import AdamW, GroupConfig, Schedule, lr_multiplier
from shardtrain.engine.partition import Partition, build_stage
from shardtrain.engine.pipeline import Pipeline
from shardtrain.engine.ring import Ring
from shardtrain.engine.trainer import Trainer
from shardtrain.job.tokenizer import ByteTokenizer, default_assets, load_tokenizer


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--impl", choices=("ours", "hf"), default="ours")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--init-std", type=float, default=0.02, help="matrices ~ N(0, std^2) (the embedded default: 0.08)")
    ap.add_argument("--mix", default="lookup,filter,total,sort")
    ap.add_argument("--lookup-keys", type=int)
    ap.add_argument("--eval-every", type=int, default=0)
    return ap.parse_args()


def _batch_of(tok: ByteTokenizer, recs: list[tasks.Record]) -> Batch:
    seqs = [tok.encode_chat(r.as_dicts()) for r in recs]
    t = max(len(i) for i, _ in seqs) - 1
    tokens = torch.full((len(seqs), t), tok.pad_id)
    targets = torch.full((len(seqs), t), tok.pad_id)
    weights = torch.zeros(len(seqs), t)
    for k, (ids, w) in enumerate(seqs):
        n = len(ids) - 1
        tokens[k, :n], targets[k, :n], weights[k, :n] = (
            torch.tensor(ids[:-1]),
            torch.tensor(ids[1:]),
            torch.tensor(w[1:]),
        )
    return Batch(tokens, targets, weights)


def _ours(
    cfg: LlamaConfig, args: argparse.Namespace, sched: Schedule, tok: ByteTokenizer
) -> tuple[Callable[[Batch], float], Callable[[list[int]], list[int]]]:
    part = Partition.even(args.layers, 1)
    stage = build_stage(cfg, part, 0, seed=1234, init_std=args.init_std)

    def group(wd: float) -> GroupConfig:
        return GroupConfig(lr=args.lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd)

    opt = AdamW(stage.named_parameters(), {"decay": group(0.1), "no_decay": group(0.0)}, schedule=sched)
    trainer = Trainer(Pipeline(stage, part, 0), opt, microbatch_size=args.batch, max_grad_norm=1.0)
    ring = Ring(stage, part, 0, timeout=5)
    return (
        lambda b: trainer.step(b).loss,
        lambda p: ring.generate(p, max_new_tokens=16, stop={tok.end_id, tok.eos_id}),
    )


def _hf(
    cfg: LlamaConfig, args: argparse.Namespace, sched: Schedule, tok: ByteTokenizer
) -> tuple[Callable[[Batch], float], Callable[[list[int]], list[int]]]:
    import transformers

    hf_cfg = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg, initializer_range=args.init_std))
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, sched))

    def step(b: Batch) -> float:
        opt.zero_grad()
        logits = model(input_ids=b.tokens).logits  # (B, T, V)
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), b.targets.reshape(-1), reduction="none"
        )
        loss = (ce * b.weights.reshape(-1)).sum() / b.weights.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lam.step()
        return float(loss)

    @torch.no_grad()
    def gen(prompt: list[int]) -> list[int]:
        ids, out = list(prompt), []
        for _ in range(16):
            t = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t in (tok.end_id, tok.eos_id):
                break
        return out

    return step, gen


def main() -> None:
    args = _args()
    torch.set_num_threads(1)
    if args.lookup_keys:
        sample = random.Random.sample
        random.Random.sample = lambda self, pop, k: sample(self, pop, args.lookup_keys if pop == "abcdefgh" else k)  # type: ignore[method-assign]
    mix = args.mix.split(",")
    tok = load_tokenizer(default_assets())
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 32 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        rms_norm_eps=1e-5,
        rope_theta=args.rope_theta,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    sched = Schedule(warmup_steps=args.warmup, total_steps=args.steps, min_ratio=0.1)
    step, gen = (_hf if args.impl == "hf" else _ours)(cfg, args, sched, tok)
    erng = random.Random(99)
    probes = {f: [tasks.make_record(f, erng, "probe") for _ in range(16)] for f in tasks.FAMILIES}

    def evaluate() -> dict[str, int]:
        right: Counter[str] = Counter()
        for fam in sorted(set(mix)):
            for rec in probes[fam]:
                out = gen(tok.encode_prompt(rec.as_dicts()[:-1]))
                text = tok.decode([t for t in out if t not in (tok.end_id, tok.eos_id)]).strip()
                right[fam] += text == rec.answer
                if fam == "lookup":
                    right["in_table"] += text in [
                        kv.split("=")[1] for kv in rec.messages[0].content.split(" in ")[1].split()
                    ]
        return dict(right)

    rng, t0, ema = random.Random(0), time.time(), None
    for s in range(args.steps):
        loss = step(
            _batch_of(
                tok, [tasks.make_record(mix[(s * args.batch + i) % len(mix)], rng, "A") for i in range(args.batch)]
            )
        )
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        if (s + 1) % 100 == 0 or s == args.steps - 1:
            print(f"step {s + 1}: loss {loss:.3f} (moving average {ema:.3f}), {time.time() - t0:.1f} s", flush=True)
        if args.eval_every and (s + 1) % args.eval_every == 0 and s != args.steps - 1:
            print(f"  correct of 16 after {s + 1} updates: {evaluate()}", flush=True)
    print(f"{vars(args)}: trained {time.time() - t0:.1f} s; correct of 16 per family: {evaluate()}")


if __name__ == "__main__":
    main()
