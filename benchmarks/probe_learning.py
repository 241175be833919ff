"""Learnability probe: does the tiny Llama learn a task family in N updates? (Not timed.)

Trains the embedded default's tokenizer and task generator with one process (`Trainer`
on a 1-slot `Pipeline`, bitwise the same update as 2 or 3 workers), then generates 16
answers per family from fresh records and prints the per-family correct counts. The
figures quoted in README ("What the demo learns") came from runs like

    python benchmarks/probe_learning.py --hidden 64 --layers 4 --steps 1500 --batch 16 --lr 3e-3 \\
        --mix lookup,lookup,filter,total

With the embedded default's initialisation (`--init-std 0.08 --lr 5e-3 --batch 32 --mix filter
--steps 600`) filter is learned (README, "What the demo learns"). `--lookup-keys K` overrides the lookup table size (default: the generator's 3-4) to probe
how hard retrieval is (K=1 is a positional copy).
"""
from __future__ import annotations

import argparse
import random
import time
from collections import Counter

import torch

import shardtrain.tasks as tasks
from shardtrain.batch import Batch
from shardtrain.model import LlamaConfig
from shardtrain.optim import AdamW, GroupConfig, Schedule
from shardtrain.partition import Partition, build_stage
from shardtrain.pipeline import Pipeline
from shardtrain.ring import Ring
from shardtrain.tokenizer import default_assets, load_tokenizer
from shardtrain.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--init-std", type=float, default=0.02, help="matrices ~ N(0, std^2) (the embedded default: 0.08)")
    ap.add_argument("--mix", default="lookup,filter,total,sort")
    ap.add_argument("--lookup-keys", type=int)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.lookup_keys:
        sample = random.Random.sample
        random.Random.sample = lambda self, pop, k: sample(self, pop, args.lookup_keys if pop == "abcdefgh" else k)  # type: ignore[method-assign]
    mix = args.mix.split(",")
    tok = load_tokenizer(default_assets())
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 32 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=True)
    part = Partition.even(args.layers, 1)
    stage = build_stage(cfg, part, 0, seed=1234, init_std=args.init_std)

    def group(wd: float) -> GroupConfig:
        return GroupConfig(lr=args.lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd)

    opt = AdamW(stage.named_parameters(), {"decay": group(0.1), "no_decay": group(0.0)},
                schedule=Schedule(warmup_steps=4, total_steps=args.steps, min_ratio=0.1))
    trainer = Trainer(Pipeline(stage, part, 0), opt, microbatch_size=args.batch, max_grad_norm=1.0)
    rng = random.Random(0)

    def batch_of(recs: list[tasks.Record]) -> Batch:
        seqs = [tok.encode_chat(r.as_dicts()) for r in recs]
        t = max(len(i) for i, _ in seqs) - 1
        tokens = torch.full((len(seqs), t), tok.pad_id)
        targets = torch.full((len(seqs), t), tok.pad_id)
        weights = torch.zeros(len(seqs), t)
        for k, (ids, w) in enumerate(seqs):
            n = len(ids) - 1
            tokens[k, :n], targets[k, :n], weights[k, :n] = torch.tensor(ids[:-1]), torch.tensor(ids[1:]), torch.tensor(w[1:])
        return Batch(tokens, targets, weights)

    t0 = time.time()
    for s in range(args.steps):
        r = trainer.step(batch_of([tasks.make_record(mix[(s * args.batch + i) % len(mix)], rng, "A")
                                   for i in range(args.batch)]))
        if s % 100 == 0 or s == args.steps - 1:
            print(f"step {s}: loss {r.loss:.3f}", flush=True)
    ring, erng, right = Ring(stage, part, 0, timeout=5), random.Random(99), Counter()
    for fam in tasks.FAMILIES:
        for _ in range(16):
            rec = tasks.make_record(fam, erng, "probe")
            out = ring.generate(tok.encode_prompt(rec.as_dicts()[:-1]), max_new_tokens=16, stop={tok.end_id, tok.eos_id})
            right[fam] += tok.decode([t for t in out if t not in (tok.end_id, tok.eos_id)]).strip() == rec.answer
    print(f"{vars(args)}: trained {time.time() - t0:.1f} s; correct of 16 per family: {dict(right)}")


if __name__ == "__main__":
    main()
