"""shardtrain at scale: a Llama of a published shape whose whole FP32 training state is more
than any worker is admitted for, trained on 2 local workers under bf16 autocast with
activation recomputation. Not a test.

What it does, as a user would:

1. writes a `save_pretrained` directory in a subprocess (so this coordinator never holds
   the model): a random-init `LlamaForCausalLM` of TinyLlama-1.1B's published shape
   (hidden 2048, intermediate 5632, 32 heads, 4 key/value heads, vocab 32000, untied
   head), by default with its first ``--layers 9`` decoder layers (0.53 B parameters;
   ``--layers 22`` is the whole 1.1 B model), in bfloat16, in shards of at most 500 MB
   with an index, plus a small BPE tokenizer with a chat template;
2. `prepare --model` with JSONL records, ``--profile bf16-autocast --recompute``: the
   weights are widened to float32 one tensor at a time into the store;
3. trains ``--steps`` updates on 2 workers with synchronous commits (so the commit's time
   is its save alone), each worker admitted for ``--budget-gib`` (``SHARDTRAIN_FREE_MEMORY``),
   less than the whole FP32 state (weights, gradients, both Adam moments: 16 bytes per
   parameter); no worker and no coordinator builds the whole model;
4. resumes from that commit in fresh processes for one more update, which times each
   worker's restore of its own slot.

It prints one table per worker: admitted budget, estimated and actual peak, parameters
held (resident parameter coverage), tokens/s of the updates, the commit's save time (the
journal's) and the restore time, with the whole state over each budget as the ratio that
matters; and the journal record of the commit, which holds each worker's actual peak and
coverage.

    python benchmarks/bench_scale.py [--layers 9] [--steps 3] [--seq 32] [--budget-gib 7] [--dir DIR]
    python benchmarks/bench_scale.py --tiny          # a smoke run of the same path on a small shape

Memory: about 16 bytes per parameter across the workers plus the activations of one
microbatch and the commit's staging (8.5 GiB for the 9-layer default); CPU: a few minutes
of both cores at the default. Do not run it on a machine others need.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: TinyLlama-1.1B's published config (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T, config.json).
TINYLLAMA = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
SMOKE = dict(
    TINYLLAMA,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=176,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)

_WRITER = r"""
import json, sys, torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
out, shape = sys.argv[1], json.loads(sys.argv[2])
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>",
                              "<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
bpe.train_from_iterator([f"sum {a} {b} is {a + b}" for a in range(100) for b in range(20)], trainer)
tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% endif %}")
tok.save_pretrained(out)
config = LlamaConfig(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)  # built in bf16 (what hubs ship): half the memory of an FP32 build
LlamaForCausalLM(config).save_pretrained(out, max_shard_size="500MB")
"""


def _records(path: Path, n: int, words: int) -> str:
    """`n` chat records whose prompts are about `words` words long."""
    with open(path, "w") as f:
        for i in range(n):
            prompt = "sum " + " ".join(str((i * 7 + k) % 97) for k in range(words))
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(i % 97)}]}
                )
                + "\n"
            )
    return str(path)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=9, help="decoder layers of the TinyLlama shape (22: all)")
    parser.add_argument("--steps", type=int, default=3, help="updates of the first run (one more on resume)")
    parser.add_argument("--seq", type=int, default=32, help="about this many words per prompt")
    parser.add_argument("--budget-gib", type=float, default=7.0, help="memory each worker is admitted for")
    parser.add_argument("--dir", help="scratch directory (default: a new temporary one)")
    parser.add_argument("--tiny", action="store_true", help="smoke run: a small shape, same path")
    args = parser.parse_args()

    import shardstore
    from shardtrain.engine.profile import Profile
    from shardtrain.job.user_job import prepare_model
    from shardtrain.run.lifecycle import RunSpec, train

    shape = dict(SMOKE if args.tiny else TINYLLAMA, num_hidden_layers=args.layers)
    home = Path(args.dir or tempfile.mkdtemp(prefix="bench-scale-"))
    home.mkdir(parents=True, exist_ok=True)
    model_dir, store_dir = home / "model", home / "store"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", _WRITER, str(model_dir), json.dumps(shape)], check=True)
    written = time.perf_counter() - t0
    records = _records(home / "train.jsonl", 2 * (args.steps + 1), args.seq)
    t0 = time.perf_counter()
    job = prepare_model(
        str(home / "job"),
        model_dir=str(model_dir),
        store=str(store_dir),
        records=records,
        profile=Profile(name="bf16-autocast", recompute=True),
        batch_size=2,
        microbatch_size=1,
        steps=args.steps + 1,
    )
    prepared = time.perf_counter() - t0
    budget = int(args.budget_gib * 2**30)
    env = {"SHARDTRAIN_FREE_MEMORY": str(budget)}
    first = train(
        RunSpec(job=job, store=str(store_dir), until=args.steps, async_commits=False, message_timeout=600),
        2,
        timeout=600,
        env=env,
        join_timeout=3600,
    )
    commit = first[0].commits[-1].id
    second = train(
        RunSpec(
            job=job,
            store=str(store_dir),
            until=args.steps + 1,
            resume=commit,
            ref="resumed",
            async_commits=False,
            message_timeout=600,
        ),
        2,
        timeout=600,
        env=env,
        join_timeout=3600,
    )
    store = shardstore.open_store(str(store_dir))
    journal = json.loads((store_dir / "journal" / f"{commit}.json").read_bytes())
    params = sum(w["parameters"] for w in journal["workers"])
    state = 16 * params  # FP32 weights, gradients and both Adam moments

    print(
        f"\n`python benchmarks/bench_scale.py{' --tiny' if args.tiny else ''} --layers {args.layers} --steps "
        f"{args.steps} --seq {args.seq} --budget-gib {args.budget_gib}`\n"
    )
    print(
        f"TinyLlama-1.1B shape{' (smoke dims)' if args.tiny else ''}, {args.layers} of 22 layers: {params:,} parameters; "
        f"whole FP32 state {_gib(state)} GiB = {state / budget:.2f}x each worker's admitted {_gib(budget)} GiB. "
        f"Profile {store.commit(commit).profile}. save_pretrained (bf16) written in {written:.1f} s, prepared "
        f"(import widened to FP32) in {prepared:.1f} s. Load average {os.getloadavg()[0]:.1f}.\n"
    )
    print(
        "| worker | admitted GiB | estimated peak GiB | actual peak GiB | parameters held | coverage | tokens/s | "
        "commit save s | restore s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r, w, again in zip(first, journal["workers"], second):
        seconds = sum(s.seconds for s in r.steps)
        tokens = sum(s.tokens for s in r.steps)
        print(
            f"| {r.rank} | {_gib(w['free'])} | {_gib(w['estimate'])} | {_gib(w['used'])} | {w['parameters']:,} | "
            f"{w['coverage']:.3f} | {tokens / seconds:.1f} | {journal['commit_seconds']:.2f} | "
            f"{again.restore_seconds:.2f} |"
        )
    over = [w for w in journal["workers"] if w["used"] > w["free"]]
    print(
        f"\nEvery worker's actual peak within its budget: {'no: ' + str([w['slot'] for w in over]) if over else 'yes'}. "
        f"The commit's save time is rank 0's (synchronous commit: the protocol of SPEC.md §15, all slots). "
        f"Journal of {commit[:12]}: {json.dumps(journal['workers'])}"
    )
    if state <= budget and not args.tiny:
        raise SystemExit(f"the whole FP32 state ({state:,} bytes) fits one worker's budget: not the point of this run")


if __name__ == "__main__":
    main()
