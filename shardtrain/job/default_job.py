"""The embedded default job: a tiny Llama, the byte-level tokenizer and generated task records.

`default_job_files` writes the files of the job `shardtrain prepare` makes without a model
of the user's (and `user_job`'s import path makes over a user's weights and tokenizer): two
training cohorts of generated task records, the second replaying declared cohort-A records
and the first declared replays of conversations the seed counts as trained, each distilled
toward its reference, and held-out development and final sets (docs/DEMO.md). The format
of what it writes, and its checks, are `job` (job.json): `prepare_default` writes a job
only once `job.write_job` has checked it whole.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from shardstore.format.manifest import f64_encode
from shardtrain.engine.model import LlamaConfig
from shardtrain.engine.profile import FP32, Profile
from shardtrain.errors import JobError
from shardtrain.job.hf_tokenizer import build_tokenizer
from shardtrain.job.job import (
    JOB_FILE,
    LEGACY_INIT_STD,
    RECORDS_FILE,
    VERSION,
    Asset,
    Job,
    RecordFile,
    Schedule,
    SeedSpec,
    Step,
    digest,
    encode,
    model_spec,
    write_job,
)
from shardtrain.job.recipe import CohortReference, Distillation, GateRecipe, GroupRecipe, Recipe
from shardtrain.job.roles import DEVELOPMENT, FINAL, EvalSet, set_digest
from shardtrain.job.tasks import make_conversations, make_records
from shardtrain.job.tokenizer import default_assets

__all__ = ["prepare_default", "default_job_files", "default_config", "DEFAULT_MIX", "DEFAULT_LR", "DEFAULT_INIT_STD"]


def default_config(vocab_size: int) -> LlamaConfig:
    """The embedded tiny Llama: 4 layers, 64 wide, grouped-query attention, tied head."""
    return LlamaConfig(
        vocab_size=vocab_size,
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


def _step_docs(
    steps: int, batch_size: int, replay: int, first: int, pool: list[int], cohort: str, offset: int = 0
) -> list[Step]:
    """`steps` updates of `batch_size - replay` new records from index `first`, plus `replay`
    declared replays drawn in a fixed stride from `pool`."""
    new = batch_size - replay
    out = []
    for s in range(steps):
        fresh = [first + s * new + i for i in range(new)]
        again = [pool[((offset + s) * replay + i) * 7 % len(pool)] for i in range(replay)] if pool else []
        out.append(Step(cohort=cohort, docs=tuple(fresh + again), replay=tuple(again)))
    return out


#: The embedded default's task mix (families repeat to weight them): training records are all
#: `filter`, the family this model learns within the demo's budget; the held-out task sets
#: keep all four families (docs/DEMO.md).
DEFAULT_MIX: tuple[str, ...] = ("filter",)
#: The embedded default's peak learning rate and initialisation scale (docs/DEMO.md).
DEFAULT_LR = 5e-3
DEFAULT_INIT_STD = 0.08
_MAX_PRIOR = 512


def prepare_default(out_dir: str | os.PathLike[str], **kw: Any) -> str:
    """Write the embedded default job (`default_job_files`, ``kw`` its options) into
    `out_dir` once it checks out; return the job file's path."""
    return write_job(out_dir, default_job_files(**kw))


def default_job_files(
    *,
    steps_a: int = 16,
    steps_b: int = 8,
    batch_size: int = 8,
    microbatch_size: int = 4,
    replay_per_step: int = 2,
    eval_per_set: int = 64,
    data_seed: int = 0,
    init_seed: int = 1234,
    lr: float = DEFAULT_LR,
    init_std: float = DEFAULT_INIT_STD,
    warmup_steps: int | None = None,
    seed_commit: str | None = None,
    seed_config: Mapping[str, Any] | None = None,
    name: str = "default",
    mix: tuple[str, ...] = DEFAULT_MIX,
    kl_coef: float = 0.5,
    temperature: float = 1.0,
    gain_bound: float = -0.001,
    retention_bound: float = 0.02,
    resamples: int = 2000,
    retention_per_set: int = 16,
    assets: Mapping[str, bytes] | None = None,
    profile: Profile | None = None,
    source_dtypes: tuple[str, ...] | None = None,
) -> dict[str, bytes]:
    """The embedded default job: job.json and the files it binds, by name (nothing written).

    Cohort A trains `steps_a` updates of new task records (cycling through `mix`) plus
    `replay_per_step` declared replays of conversation records the seed counts as already
    trained (``exposed``), distilled toward the seed. Cohort B trains `steps_b` updates of
    new task records plus `replay_per_step` declared replays, alternately cohort-A task
    records and those conversations, distilled toward the committed end of cohort A.
    Held-out sets: development and final task sets of `eval_per_set` records, a
    development retention set of exposed conversations and a final retention set of
    conversations from another generator range, disjoint from every trained record.
    `seed_commit` (with its model `seed_config`) starts from imported weights instead of
    a fresh initialisation; `assets` (a model's tokenizer files) replace the embedded
    byte tokenizer; `profile` is the numerical profile (None: fp32).
    """
    if not 0 <= replay_per_step < batch_size:
        raise JobError(f"replay_per_step must be in [0, {batch_size})")
    assets = dict(assets) if assets is not None else default_assets()
    tok = build_tokenizer(assets, tuple(sorted(assets)))
    config = LlamaConfig.from_hf_dict(dict(seed_config)) if seed_config is not None else default_config(tok.vocab_size)
    new = batch_size - replay_per_step
    held = {n: make_records(n, eval_per_set, seed=data_seed) for n in ("dev_task", "final_task")}
    exclude = {r.id for rs in held.values() for r in rs}
    a = make_records("A", steps_a * new, seed=data_seed, exclude=exclude, mix=mix)
    exclude |= {r.id for r in a}
    b = make_records("B", steps_b * new, seed=data_seed, exclude=exclude, mix=mix)
    # Distinct conversations for cohort A's replays, at most _MAX_PRIOR (the generator has ~1,000;
    # a longer cohort A replays them again, in the same fixed stride).
    n_chat = max(min(steps_a * replay_per_step, _MAX_PRIOR), retention_per_set) if replay_per_step else 0
    prior = make_conversations("prior", n_chat, seed=data_seed)
    final_chat = make_conversations("final_chat", retention_per_set, seed=data_seed + 1, exclude={r.id for r in prior})
    records = a + b + prior + held["dev_task"] + held["final_task"] + final_chat
    base_prior, base_dev = len(a) + len(b), len(a) + len(b) + len(prior)
    prior_idx = list(range(base_prior, base_prior + len(prior)))
    steps = _step_docs(steps_a, batch_size, replay_per_step, 0, prior_idx, "A")
    pool_b = [x for pair in zip(range(len(a)), prior_idx) for x in pair] if prior_idx else []
    steps += _step_docs(steps_b, batch_size, replay_per_step, len(a), pool_b, "B")

    def role_set(name_: str, role: str, kind: str, docs: list[int]) -> EvalSet:
        return EvalSet(name=name_, role=role, kind=kind, docs=tuple(docs), digest=set_digest(records, docs))  # type: ignore[arg-type]

    sets = [role_set("dev_task", DEVELOPMENT, "task", list(range(base_dev, base_dev + eval_per_set)))]
    if prior_idx:
        sets.append(role_set("dev_retention", DEVELOPMENT, "retention", prior_idx[:retention_per_set]))
    sets.append(
        role_set("final_task", FINAL, "task", list(range(base_dev + eval_per_set, base_dev + 2 * eval_per_set)))
    )
    sets.append(
        role_set(
            "final_retention",
            FINAL,
            "retention",
            list(range(base_dev + 2 * eval_per_set, base_dev + 2 * eval_per_set + len(final_chat))),
        )
    )
    schedule = Schedule(version=VERSION, steps=tuple(steps))
    files = {**assets, RECORDS_FILE: encode(RecordFile(version=VERSION, records=tuple(records)))}

    def asset(n: str) -> Asset:
        return Asset(name=n, blake3=digest(files[n]), size=len(files[n]))

    def group(n: str, wd: float) -> GroupRecipe:
        return GroupRecipe(
            name=n,
            lr=f64_encode(lr),
            beta1=f64_encode(0.9),
            beta2=f64_encode(0.95),
            eps=f64_encode(1e-8),
            weight_decay=f64_encode(wd),
        )

    refs = []
    if steps_a:
        refs.append(CohortReference(cohort="A", source="seed", of=None))
    if steps_b:
        refs.append(
            CohortReference(cohort="B", source="endpoint", of="A")
            if steps_a
            else CohortReference(cohort="B", source="seed", of=None)
        )
    total = steps_a + steps_b
    warmup = min(total, max(2, total // 16)) if warmup_steps is None else warmup_steps
    job = Job(
        version=VERSION,
        name=name,
        model=model_spec(config),
        seed=SeedSpec(
            kind="import" if seed_commit else "init",
            init_seed=init_seed,
            commit=seed_commit,
            init_std=None if init_std == LEGACY_INIT_STD else f64_encode(init_std),
            source_dtypes=source_dtypes,
        ),
        profile=None if profile == FP32 else profile,
        tokenizer=tuple(asset(n) for n in sorted(assets)),
        records=asset(RECORDS_FILE),
        exposed=tuple(prior_idx),
        sets=tuple(sets),
        schedule=schedule,
        schedule_id=digest(encode(schedule)),
        recipe=Recipe(
            algorithm="adamw",
            groups=(group("decay", 0.1), group("no_decay", 0.0)),
            warmup_steps=warmup,
            total_steps=max(1, total),
            min_ratio=f64_encode(0.1),
            max_grad_norm=f64_encode(1.0),
            batch_size=batch_size,
            microbatch_size=microbatch_size,
            distill=Distillation(
                kl_coef=f64_encode(kl_coef), temperature=f64_encode(temperature), references=tuple(refs)
            ),
            gates=GateRecipe(
                gain_bound=f64_encode(gain_bound),
                retention_bound=f64_encode(retention_bound),
                resamples=resamples,
                seed=0,
            ),
        ),
    )
    files[JOB_FILE] = encode(job)
    return files
