"""Learnability oracle: our trainer against transformers on the same weights and batches. (Not timed.)

Builds the embedded default's model with `build_stage` (seed 1234, matrices ~ N(0, STD^2)),
loads the same tensors into `transformers.LlamaForCausalLM`, and trains both on the same
batches of one task family: ours with `Trainer` (a 1-slot `Pipeline`, bitwise the 2-worker
update), transformers with a plain loop (`torch.optim.AdamW` in two weight-decay groups,
`LambdaLR` over `lr_multiplier`, `clip_grad_norm_`). Prints both losses, gradient norms and
the largest weight difference. If transformers learned and ours did not, ours would have a
bug; docs/DEMO.md gives the figures of

    python benchmarks/oracle_learning.py 300 0.08 filter

Usage: oracle_learning.py STEPS STD FAMILY.
"""

import random
import sys
import time

import torch
import transformers

import shardtrain.job.tasks as tasks
from shardtrain.engine.batch import Batch
from shardtrain.engine.model import LlamaConfig
from shardtrain.engine.optim import AdamW, GroupConfig, Schedule, lr_multiplier
from shardtrain.engine.partition import Partition, build_stage
from shardtrain.engine.pipeline import Pipeline
from shardtrain.engine.trainer import Trainer
from shardtrain.job.tokenizer import default_assets, load_tokenizer

torch.set_num_threads(1)
steps, std, fam = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]  # e.g. 300 0.08 filter
tok = load_tokenizer(default_assets())
cfg = LlamaConfig(
    vocab_size=tok.vocab_size,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)
part = Partition.even(4, 1)
stage = build_stage(cfg, part, 0, seed=1234, init_std=std)
hf = transformers.LlamaForCausalLM(
    transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"})
)
missing = hf.load_state_dict({k: v.clone() for k, v in stage.state_dict().items()}, strict=False)
print("load:", missing)
sched = Schedule(warmup_steps=min(steps, max(2, steps // 16)), total_steps=steps, min_ratio=0.1)  # as prepare_default
g = lambda wd: GroupConfig(lr=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd)
ours = Trainer(
    Pipeline(stage, part, 0),
    AdamW(stage.named_parameters(), {"decay": g(0.1), "no_decay": g(0.0)}, schedule=sched),
    microbatch_size=32,
    max_grad_norm=1.0,
)
opt = torch.optim.AdamW(
    [
        {"params": [p for p in hf.parameters() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in hf.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ],
    lr=5e-3,
    betas=(0.9, 0.95),
    eps=1e-8,
)
lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, sched))
rng = random.Random(0)


def batch_of(recs):
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


to = th = 0.0
for s in range(steps):
    b = batch_of([tasks.make_record(fam, rng, "A") for _ in range(32)])
    t0 = time.perf_counter()
    r = ours.step(b)
    to += time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.zero_grad()
    logits = hf(input_ids=b.tokens).logits
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), b.targets.reshape(-1), reduction="none"
    )
    loss = (ce * b.weights.reshape(-1)).sum() / b.weights.sum()
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    opt.step()
    lam.step()
    th += time.perf_counter() - t0
    if s < 3 or (s + 1) % 50 == 0:
        d = max(
            float((dict(hf.named_parameters())[n].detach() - p.detach()).abs().max())
            for n, p in stage.named_parameters()
        )
        print(
            f"step {s + 1}: ours {r.loss:.4f} (gn {r.grad_norm:.3f}) hf {float(loss):.4f} (gn {float(gn):.3f}) max|dW| {d:.2e}  t ours {to:.1f}s hf {th:.1f}s",
            flush=True,
        )
