"""Your data: a prepared job over a user's own JSONL chat records, with the model's own tokenizer.

`prepare_own` writes a job (the same `job.json` format as the embedded default,
`shardtrain.job`) whose records come from the user's files rather than the generators:

- ``records``: the training records, one JSON object per line,
  ``{"messages": [{"role": ..., "content": ...}, ...]}``, whose last message is the
  assistant's (the answer a generation is checked against); the loss is taken on every
  assistant message's tokens (`shardtrain.job.hf_tokenizer`);
- ``replay`` (optional): declared replay records, counted as already trained by the seed
  (the job's ``exposed``) and distilled toward it (KL on their rows only, as today),
  ``replay_per_step`` of them in every update;
- ``dev`` / ``final`` (optional): held-out task sets of role development / final
  (`shardtrain.roles`). Without ``dev`` the development set is a retention set of the
  first training records (a measure of fit, not of generalisation).

Every line of every file is read and checked before anything is written: a line that is
not such an object is refused naming its file and line, and so is a held-out record that
is also a training or replay record (by content, or by prompt text), or a record of any
file longer than the model's context. Records are bound by digest like the generated ones.

The schedule cycles through the training records in file order, ``batch_size -
replay_per_step`` new ones per update (one epoch by default; ``steps`` for more or fewer).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from shardstore import Store, load_commit, open_store
from shardstore.errors import ShardstoreError
from shardstore.format.bounded import read_regular_file
from shardstore.format.manifest import MAX_MANIFEST_BYTES, decode_config, f64_encode
from shardstore.ops.assets import commit_assets, read_asset_files
from shardtrain.engine.model import LlamaConfig
from shardtrain.engine.profile import FP32, Profile
from shardtrain.errors import ConfigError, JobError
from shardtrain.job.default_job import default_job_files, prepare_default
from shardtrain.job.hf_tokenizer import build_tokenizer, check_hf_assets
from shardtrain.job.job import (
    JOB_FILE,
    RECORDS_FILE,
    VERSION,
    Asset,
    Job,
    RecordFile,
    Schedule,
    SeedSpec,
    Step,
    check_job_files,
    digest,
    encode,
    model_spec,
    with_seed_commit,
    write_job,
)
from shardtrain.job.recipe import CohortReference, Distillation, GateRecipe, GroupRecipe, Recipe
from shardtrain.job.roles import DEVELOPMENT, FINAL, EvalSet, set_digest
from shardtrain.job.tasks import CONVERSATION, Message, Record, record_id

__all__ = [
    "read_records",
    "UserData",
    "check_user_data",
    "prepare_own",
    "own_job_files",
    "prepare_model",
    "prepare_seed",
    "describe",
    "seed_ref",
    "DEFAULT_OWN_LR",
]

_MAX_FILE_BYTES = 256 << 20
#: The seed commit a job made before its import names while it is checked (no check reads it).
_NOT_YET = "0" * 64
_MAX_DEV_TRAIN = 16
#: Peak learning rate of a job over the user's own model (a fine-tuning rate, not the toy's).
DEFAULT_OWN_LR = 1e-4


class _Line(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    messages: tuple[Message, ...]


_DEC = msgspec.json.Decoder(_Line)


def read_records(path: str, split: str) -> list[tuple[Record, int]]:
    """The records of a JSONL file with their line numbers; JobError naming file and line if one is malformed."""
    try:
        raw = read_regular_file(path, _MAX_FILE_BYTES)
    except ShardstoreError as exc:
        raise JobError(f"records file {path}: {exc}") from None
    out = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            messages = _DEC.decode(line).messages
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise JobError(
                f'{path}, line {n}: not a {{"messages": [{{"role": ..., "content": ...}}, ...]}} object: {exc}'
            ) from None
        if not messages or messages[-1].role != "assistant":
            raise JobError(f"{path}, line {n}: the last message must be the assistant's (the answer to train on)")
        if any(not m.role for m in messages):
            raise JobError(f"{path}, line {n}: a message has an empty role")
        answer = messages[-1].content
        out.append(
            (
                Record(
                    id=record_id(CONVERSATION, messages, answer),
                    family=CONVERSATION,
                    split=split,
                    messages=messages,
                    answer=answer,
                ),
                n,
            )
        )
    if not out:
        raise JobError(f"records file {path} holds no records")
    return out


def _prompt(r: Record) -> str:
    return "\n".join(m.content for m in r.messages if m.role != "assistant")


def _refuse_overlap(
    held: list[tuple[Record, int]], path: str, seen: dict[str, tuple[str, int]], prompts: dict[str, tuple[str, int]]
) -> None:
    for r, n in held:
        where = seen.get(r.id) or prompts.get(_prompt(r))
        if where is not None:
            raise JobError(
                f"{path}, line {n}: this held-out record is also in {where[0]}, line {where[1]} (same record "
                f"or same prompt); held-out sets must be disjoint from the training and replay records"
            )


@dataclass(frozen=True)
class UserData:
    """The user's record files, read and checked (`check_user_data`): (record, line) per file."""

    records: str
    train: list[tuple[Record, int]]
    replay: list[tuple[Record, int]]
    dev: list[tuple[Record, int]]
    final: list[tuple[Record, int]]


def check_user_data(
    config: LlamaConfig,
    assets: Mapping[str, bytes],
    records: str,
    replay: str | None = None,
    dev: str | None = None,
    final: str | None = None,
) -> UserData:
    """Read every file and check every line (form, overlap, length under the model's tokenizer)."""
    train = read_records(records, "train")
    rep = read_records(replay, "replay") if replay else []
    dev_r = read_records(dev, "dev") if dev else []
    fin_r = read_records(final, "final") if final else []
    seen: dict[str, tuple[str, int]] = {}
    prompts: dict[str, tuple[str, int]] = {}
    for path, rs in ((records, train), (replay or "", rep)):
        for r, n in rs:
            seen.setdefault(r.id, (path, n))
            prompts.setdefault(_prompt(r), (path, n))
    _refuse_overlap(dev_r, dev or "", seen, prompts)
    _refuse_overlap(fin_r, final or "", seen, prompts)
    _refuse_overlap(
        fin_r, final or "", {r.id: (dev or "", n) for r, n in dev_r}, {_prompt(r): (dev or "", n) for r, n in dev_r}
    )
    tok = build_tokenizer(assets, tuple(sorted(assets)))
    if tok.vocab_size > config.vocab_size:
        raise JobError(f"the tokenizer has {tok.vocab_size} ids but the model only {config.vocab_size}")
    for path, rs in ((records, train), (replay or "", rep), (dev or "", dev_r), (final or "", fin_r)):
        for r, n in rs:  # held-out records too: evaluate scores and generates them within the context
            length = len(tok.encode_chat(r.as_dicts())[0])
            if length > config.max_position_embeddings:
                raise JobError(
                    f"{path}, line {n}: {length} tokens, longer than the model's max_position_embeddings "
                    f"{config.max_position_embeddings}"
                )
    return UserData(records, train, rep, dev_r, fin_r)


def prepare_own(out_dir: str | os.PathLike[str], data: UserData, **kw: Any) -> str:
    """Write a job over the user's checked records (`own_job_files`, ``kw`` its options) into
    `out_dir` once it checks out; return job.json's path."""
    return write_job(out_dir, own_job_files(data, **kw))


def own_job_files(
    data: UserData,
    *,
    config: LlamaConfig,
    assets: Mapping[str, bytes],
    seed_commit: str,
    profile: Profile | None = None,
    source_dtypes: tuple[str, ...] | None = None,
    batch_size: int = 8,
    microbatch_size: int = 4,
    replay_per_step: int | None = None,
    steps: int | None = None,
    lr: float = DEFAULT_OWN_LR,
    warmup_steps: int | None = None,
    init_seed: int = 1234,
    name: str = "own",
    kl_coef: float = 0.5,
    temperature: float = 1.0,
    gain_bound: float = -0.001,
    retention_bound: float = 0.02,
    resamples: int = 2000,
) -> dict[str, bytes]:
    """A job over the user's checked records starting from imported commit `seed_commit`:
    job.json and the files it binds, by name (nothing written)."""
    train, rep, dev_r, fin_r = data.train, data.replay, data.dev, data.final
    per_step = (2 if rep else 0) if replay_per_step is None else replay_per_step
    if per_step and not rep:
        raise JobError("replay_per_step needs --replay records")
    if not 0 <= per_step < batch_size:
        raise JobError(f"replay_per_step must be in [0, {batch_size})")
    all_records = [r for r, _ in train + rep + dev_r + fin_r]
    base_rep, base_dev = len(train), len(train) + len(rep)
    base_fin = base_dev + len(dev_r)
    new = batch_size - per_step
    n_steps = math.ceil(len(train) / new) if steps is None else steps
    pool = list(range(base_rep, base_dev))
    schedule_steps = []
    for s in range(n_steps):
        fresh = [(s * new + i) % len(train) for i in range(new)]
        again = [pool[(s * per_step + i) % len(pool)] for i in range(per_step)] if per_step else []
        schedule_steps.append(Step(cohort="A", docs=tuple(fresh + again), replay=tuple(again)))

    def role_set(set_name: str, role: str, kind: str, docs: list[int]) -> EvalSet:
        return EvalSet(
            name=set_name,
            role=role,
            kind=kind,
            docs=tuple(docs),  # type: ignore[arg-type]
            digest=set_digest(all_records, docs),
        )

    if dev_r:
        sets = [role_set("dev", DEVELOPMENT, "task", list(range(base_dev, base_fin)))]
    else:  # distinct training records (a file may repeat one)
        first = list({r.id: i for i, r in reversed(list(enumerate(all_records[: len(train)])))}.values())
        sets = [role_set("dev_train", DEVELOPMENT, "retention", sorted(first)[:_MAX_DEV_TRAIN])]
    if rep:
        sets.append(role_set("dev_replay", DEVELOPMENT, "retention", pool[:_MAX_DEV_TRAIN]))
    if fin_r:
        sets.append(role_set("final", FINAL, "task", list(range(base_fin, base_fin + len(fin_r)))))
    schedule = Schedule(version=VERSION, steps=tuple(schedule_steps))
    files: dict[str, bytes] = {
        **assets,
        RECORDS_FILE: encode(RecordFile(version=VERSION, records=tuple(all_records))),
    }

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

    refs = (CohortReference(cohort="A", source="seed", of=None),) if per_step else ()
    warmup = min(n_steps, max(1, n_steps // 16)) if warmup_steps is None else warmup_steps
    job = Job(
        version=VERSION,
        name=name,
        model=model_spec(config),
        seed=SeedSpec(kind="import", init_seed=init_seed, commit=seed_commit, source_dtypes=source_dtypes),
        tokenizer=tuple(asset(n) for n in sorted(assets)),
        records=asset(RECORDS_FILE),
        exposed=tuple(pool),
        sets=tuple(sets),
        schedule=schedule,
        schedule_id=digest(encode(schedule)),
        profile=None if profile == FP32 else profile,
        recipe=Recipe(
            algorithm="adamw",
            groups=(group("decay", 0.1), group("no_decay", 0.0)),
            warmup_steps=warmup,
            total_steps=max(1, n_steps),
            min_ratio=f64_encode(0.1),
            max_grad_norm=f64_encode(1.0),
            batch_size=batch_size,
            microbatch_size=microbatch_size,
            distill=Distillation(kl_coef=f64_encode(kl_coef), temperature=f64_encode(temperature), references=refs),
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


def describe(job: Any) -> dict[str, Any]:
    """What `prepare` reports about a job: its profile, seed conversion and sets."""
    j = job.job
    return {
        "profile": (j.profile.name if j.profile else "fp32"),
        "recompute": bool(j.profile and j.profile.recompute),
        "source_dtypes": list(j.seed.source_dtypes or ()),
        "sets": [s.name for s in j.sets],
        "tokenizer": [a.name for a in j.tokenizer],
    }


def seed_ref(commit: str) -> str:
    """The ref `prepare --model` keeps its import commit under: ``seeds/<commit id>``."""
    return f"seeds/{commit}"


def prepare_model(
    out_dir: str | os.PathLike[str],
    *,
    model_dir: str,
    store: Store | str,
    records: str | None = None,
    replay: str | None = None,
    dev: str | None = None,
    final: str | None = None,
    profile: Profile | None = None,
    **kw: Any,
) -> str:
    """`prepare --model`: a job starting from a Hugging Face `save_pretrained` directory.

    Reads config.json and the tokenizer asset set (refused without its chat template),
    checks every record file, and makes and checks the whole job (every value in its bounds,
    `check_job_files`) before anything is written; then imports the weights into
    `store` (a store or its URL, opened only then), widened to float32 one tensor at a time, with the asset set pinned to the
    import commit (`shardstore.ops.assets`) and the commit kept by the ref ``seeds/<commit id>``
    (so gc cannot take it before a run starts from it), and writes the job: over the user's records
    (`prepare_own`, `kw` its options), or without `records` over the embedded default's
    generated tasks (`shardtrain.job.default_job.prepare_default`) tokenized by the model's tokenizer.
    """
    from shardstore.ops.interchange import import_directory, read_config, source_dtypes

    raw_config = read_config(model_dir)
    try:
        config = LlamaConfig.from_hf_dict(raw_config)
    except ConfigError as exc:
        raise JobError(f"{model_dir}/config.json: {exc}") from exc
    assets = read_asset_files(model_dir)
    check_hf_assets(assets, model_dir)
    data = check_user_data(config, assets, records, replay, dev, final) if records else None
    if data is None and (replay or dev or final):
        raise JobError("--replay, --dev and --final need --records")
    widened = tuple(d for d in source_dtypes(model_dir) if d in ("bfloat16", "float16")) or None
    common = {"assets": assets, "seed_commit": _NOT_YET, "profile": profile, "source_dtypes": widened, **kw}
    if data is not None:
        files = own_job_files(data, config=config, **common)
    else:
        files = default_job_files(seed_config=config.to_hf_dict(), **common)
    check_job_files(files, out_dir)  # the whole job, before the first write: the import's id is all it lacks
    if isinstance(store, str):  # opened (and created) only now, once everything was checked
        store = open_store(store, create=True)
    cid = import_directory(store, model_dir, ref=None, dtype="float32")
    if (
        store.ref(seed_ref(cid)) is None
    ):  # kept from gc until a run's ref names its commits (a second prepare reuses it)
        store.set_ref(seed_ref(cid), cid, expected=None)
    return write_job(out_dir, with_seed_commit(files, cid))


def prepare_seed(
    out_dir: str | os.PathLike[str],
    *,
    store: Store,
    commit: str,
    records: str | None = None,
    replay: str | None = None,
    dev: str | None = None,
    final: str | None = None,
    profile: Profile | None = None,
    **kw: Any,
) -> tuple[str, bool]:
    """`prepare --seed-commit`: a job starting from an imported commit; returns (job path,
    whether the commit carried a tokenizer asset set).

    The commit's own asset set (pinned by `shardstore import`, or its nearest ancestor's)
    is bound when it has one; a commit without one gets the embedded byte tokenizer (and
    may not be given `records`). Weights must be float32 (import with ``--dtype float32``).
    """
    lc = load_commit(store, commit)
    if lc.commit.config is None:
        raise JobError(f"commit {lc.id[:12]} has no model config")
    narrow = sorted({e.dtype for e in lc.entries().values() if e.dtype != "float32" and "float" in e.dtype})
    if narrow:
        raise JobError(
            f"commit {lc.id[:12]} holds {narrow} weights; the profiles keep FP32 weights: import it with "
            f"`shardstore import --dtype float32` or prepare from the directory with --model"
        )
    config = decode_config(store.get(lc.commit.config, limit=MAX_MANIFEST_BYTES))
    assets = commit_assets(store, lc.id)
    if assets:
        check_hf_assets(assets, f"commit {lc.id[:12]}'s tokenizer assets")
    if records:
        if not assets:
            raise JobError(
                f"commit {lc.id[:12]} carries no tokenizer assets (import the model's directory with its "
                f"tokenizer files, or prepare with --model); records cannot be tokenized without them"
            )
        try:
            llama = LlamaConfig.from_hf_dict(config)
        except ConfigError as exc:
            raise JobError(f"commit {lc.id[:12]}'s model config: {exc}") from exc
        data = check_user_data(llama, assets, records, replay, dev, final)
        return prepare_own(out_dir, data, config=llama, assets=assets, seed_commit=lc.id, profile=profile, **kw), True
    if replay or dev or final:
        raise JobError("--replay, --dev and --final need --records")
    return prepare_default(out_dir, seed_commit=lc.id, seed_config=config, assets=assets, profile=profile, **kw), bool(
        assets
    )
