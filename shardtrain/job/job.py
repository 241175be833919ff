"""The prepared job: one file that binds, by hash, everything that decides a training run.

`job.json` names the model config, the seed (a fresh initialisation, or an imported
commit whose weights start the run), every tokenizer asset file, the records file, the
exact per-step schedule of documents (with the replay documents each step declares) and
the optimizer recipe. Files beside it are bound by their BLAKE3 hash and size, so the
job's id, the BLAKE3 of `job.json`'s bytes, changes when any of them changes. Every
commit a run makes carries the job id and the schedule id; a resume under another job
is refused before training.

Encoding follows shardstore's manifests: msgspec Structs, compact JSON with sorted keys,
reals as the 16 hex digits of their IEEE-754 bits (no float text), strict decoding
(unknown fields refused, sizes bounded before parsing, bytes must re-encode to
themselves). No pickle anywhere.

`prepare_default` writes the embedded default: the byte-level tokenizer, generated task
records (two training cohorts, the second replaying declared cohort-A records, and
held-out sets) and a tiny tied Llama.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import blake3
import msgspec
import torch
from msgspec import Meta

from shardstore.format.manifest import f64_decode, f64_encode
from shardtrain.engine.batch import Batch
from shardtrain.engine.model import LlamaConfig
from shardtrain.engine.optim import GroupConfig
from shardtrain.engine.optim import Schedule as LrSchedule
from shardtrain.engine.profile import FP32, Profile
from shardtrain.errors import ConfigError, JobError
from shardtrain.job.bounds import check_bounds
from shardtrain.job.hf_tokenizer import HFTokenizer, build_tokenizer, commit_config_dict
from shardtrain.job.recipe import (
    F64,
    CohortReference,
    Count,
    Distillation,
    FileName,
    GateRecipe,
    GroupRecipe,
    Positive,
    Recipe,
    _Base,
)
from shardtrain.job.roles import DEVELOPMENT, FINAL, EvalSet, check_roles, set_digest
from shardtrain.job.tasks import Record, make_conversations, make_records, record_id
from shardtrain.job.tokenizer import ByteTokenizer, default_assets

__all__ = [
    "JOB_FILE",
    "RECORDS_FILE",
    "Job",
    "PreparedJob",
    "decode_job",
    "load_job",
    "check_job_files",
    "write_job",
    "with_seed_commit",
    "prepare_default",
    "default_job_files",
    "model_spec",
    "default_config",
]

JOB_FILE = "job.json"
RECORDS_FILE = "records.json"
_MAX_JOB_BYTES = 16 << 20
_MAX_RECORDS_BYTES = 256 << 20
_MAX_ASSET_BYTES = 64 << 20  # shardstore.ops.assets' bound: real tokenizer.json files reach ~20 MB
_VERSION = 1

Hex64 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]


class ModelSpec(_Base):
    """The Llama config, reals as F64 hex."""

    vocab_size: Positive
    hidden_size: Positive
    intermediate_size: Positive
    num_hidden_layers: Positive
    num_attention_heads: Positive
    num_key_value_heads: Positive
    head_dim: Positive
    rms_norm_eps: F64
    rope_theta: F64
    max_position_embeddings: Positive
    tie_word_embeddings: bool


#: The standard deviation of a fresh initialisation's matrices when a job names none
#: (`SeedSpec.init_std`); what every job prepared before that field existed used.
LEGACY_INIT_STD = 0.02


class SeedSpec(_Base, omit_defaults=True):
    """Where the weights start: `init` (from `init_seed`, matrices ~ N(0, init_std^2)) or
    `import` (commit `commit`, weights only).

    `init_std` absent (None, omitted from the encoding) means the legacy 0.02, so job files
    prepared before the field existed keep their bytes, and so their job ids.
    `source_dtypes`: the dtypes of the user's weights that the import widened, exactly, to
    the profile's FP32 (None: no conversion).
    """

    kind: Literal["init", "import"]
    init_seed: Count
    commit: Hex64 | None
    init_std: F64 | None = None
    source_dtypes: tuple[Annotated[str, Meta(pattern=r"^[a-z0-9]{1,16}$")], ...] | None = None  # widened to float32


class Asset(_Base):
    """A file beside job.json, bound by BLAKE3 and size."""

    name: FileName
    blake3: Hex64
    size: Count


class Step(_Base):
    """One update's documents (indices into the records file), and which of them are declared replay."""

    cohort: FileName
    docs: tuple[Count, ...]
    replay: tuple[Count, ...]


class Schedule(_Base, tag="shardtrain-schedule", tag_field="type"):
    version: int
    steps: tuple[Step, ...]


class Job(_Base, tag="shardtrain-job", tag_field="type", omit_defaults=True):
    version: int
    name: FileName
    model: ModelSpec
    seed: SeedSpec
    tokenizer: tuple[Asset, ...]
    records: Asset
    exposed: tuple[Count, ...]  # records the seed was trained on before this job: replayable from step 0
    sets: tuple[EvalSet, ...]  # held-out sets with their roles (shardtrain.job.roles)
    schedule: Schedule
    schedule_id: Hex64
    recipe: Recipe
    profile: Profile | None = None  # None: fp32 without recomputation (older job files keep their ids)


class RecordFile(_Base, tag="shardtrain-records", tag_field="type"):
    version: int
    records: tuple[Record, ...]


_ENC = msgspec.json.Encoder(order="sorted")


def _hash(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _decode(data: bytes, kind: type[Any], what: str, limit: int) -> Any:
    if len(data) > limit:
        raise JobError(f"{what}: {len(data)} bytes exceeds the {limit}-byte limit")
    try:
        obj = msgspec.json.decode(data, type=kind)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # msgspec raises the latter for bad UTF-8 in a string
        raise JobError(f"{what}: invalid: {exc}") from None
    if _ENC.encode(obj) != data:
        raise JobError(f"{what}: not in canonical encoding (sorted compact JSON, every field present)")
    if obj.version != _VERSION:
        raise JobError(f"{what}: version {obj.version} is not supported (expected {_VERSION})")
    return obj


def decode_job(raw: bytes, what: str = "job file") -> Job:
    """Strictly decode job file bytes (bounded, canonical, known version, every value in bounds)."""
    job = _decode(raw, Job, what, _MAX_JOB_BYTES)
    check_bounds(job)  # SPEC.md §14c: before anything reads records, starts a worker, writes or pins
    return job


def model_spec(config: LlamaConfig) -> ModelSpec:
    return ModelSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.dim_per_head,
        rms_norm_eps=f64_encode(config.rms_norm_eps),
        rope_theta=f64_encode(config.rope_theta),
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
    )


def _config(spec: ModelSpec) -> LlamaConfig:
    try:
        return LlamaConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=f64_decode(spec.rms_norm_eps),
            rope_theta=f64_decode(spec.rope_theta),
            max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=spec.tie_word_embeddings,
        )
    except ConfigError as exc:
        raise JobError(f"job model config: {exc}") from exc


@dataclass
class PreparedJob:
    """A verified job: its id, decoded file, tokenizer, records, and the batch of every step."""

    id: str
    job: Job
    directory: str
    files: dict[str, bytes]  # every bound file by name, job.json included (what a store can keep)
    tokenizer: ByteTokenizer | HFTokenizer
    records: tuple[Record, ...]
    config: LlamaConfig = field(init=False)

    def __post_init__(self) -> None:
        self.config = _config(self.job.model)
        self._encoded: dict[int, tuple[list[int], list[float]]] = {}

    @property
    def schedule_id(self) -> str:
        return self.job.schedule_id

    @property
    def num_steps(self) -> int:
        return len(self.job.schedule.steps)

    def hf_config(self) -> dict[str, Any]:
        """The model config as bound into commits (Hugging Face field names, with a Hugging
        Face tokenizer's bos/eos/pad ids)."""
        return commit_config_dict(self.config, self.tokenizer)

    def groups(self) -> dict[str, GroupConfig]:
        return {
            g.name: GroupConfig(
                lr=f64_decode(g.lr),
                beta1=f64_decode(g.beta1),
                beta2=f64_decode(g.beta2),
                eps=f64_decode(g.eps),
                weight_decay=f64_decode(g.weight_decay),
            )
            for g in self.job.recipe.groups
        }

    def lr_schedule(self) -> LrSchedule:
        r = self.job.recipe
        return LrSchedule(warmup_steps=r.warmup_steps, total_steps=r.total_steps, min_ratio=f64_decode(r.min_ratio))

    def init_std(self) -> float:
        """Standard deviation of the fresh initialisation's matrices (norms start at one)."""
        std = self.job.seed.init_std
        return LEGACY_INIT_STD if std is None else f64_decode(std)

    def max_grad_norm(self) -> float | None:
        m = self.job.recipe.max_grad_norm
        return None if m is None else f64_decode(m)

    def cursor(self, step: int) -> int:
        """The data cursor after `step` completed updates: documents consumed so far."""
        return sum(len(s.docs) for s in self.job.schedule.steps[:step])

    def encoded(self, index: int) -> tuple[list[int], list[float]]:
        if index not in self._encoded:
            self._encoded[index] = self.tokenizer.encode_chat(self.records[index].as_dicts())
        return self._encoded[index]

    def batch_of(self, indices: list[int] | tuple[int, ...]) -> Batch:
        """Documents as one right-padded batch; weights sit on the target (next) token."""
        seqs = [self.encoded(i) for i in indices]
        t = max(len(ids) for ids, _ in seqs) - 1
        tokens = torch.full((len(seqs), t), self.tokenizer.pad_id, dtype=torch.int64)  # (B, T)
        targets = torch.full((len(seqs), t), self.tokenizer.pad_id, dtype=torch.int64)  # (B, T)
        weights = torch.zeros(len(seqs), t, dtype=torch.float32)  # (B, T)
        for r, (ids, w) in enumerate(seqs):
            n = len(ids) - 1
            tokens[r, :n] = torch.tensor(ids[:-1])
            targets[r, :n] = torch.tensor(ids[1:])
            weights[r, :n] = torch.tensor(w[1:])
        return Batch(tokens, targets, weights)

    def batch(self, step: int) -> Batch:
        """The batch of global step `step` (0-based), exactly as the schedule names it."""
        if not 0 <= step < self.num_steps:
            raise JobError(f"step {step} is outside the job's schedule of {self.num_steps} steps")
        return self.batch_of(self.job.schedule.steps[step].docs)

    def eval_sets(self, role: str = DEVELOPMENT) -> tuple[EvalSet, ...]:
        """The held-out sets of `role` (development or final), in the job's order."""
        return tuple(s for s in self.job.sets if s.role == role)

    def eval_set(self, name: str) -> list[int]:
        """Indices of the records of held-out set `name`."""
        for s in self.job.sets:
            if s.name == name:
                return list(s.docs)
        raise JobError(f"job has no held-out set {name!r} (sets: {[s.name for s in self.job.sets]})")

    def kl(self) -> tuple[float, float]:
        """(coefficient, temperature) of the KL term."""
        d = self.job.recipe.distill
        return f64_decode(d.kl_coef), f64_decode(d.temperature)

    def reference_of(self, cohort: str) -> CohortReference | None:
        """The frozen reference the recipe names for `cohort` (None: no reference)."""
        return next((r for r in self.job.recipe.distill.references if r.cohort == cohort), None)

    def cohort_end(self, cohort: str) -> int:
        """Updates complete at the end of `cohort` (its last step, 1-based)."""
        ends = [n + 1 for n, s in enumerate(self.job.schedule.steps) if s.cohort == cohort]
        if not ends:
            raise JobError(f"the schedule has no cohort {cohort!r}")
        return ends[-1]


def _read_bound(directory: str, asset: Asset, what: str, limit: int) -> bytes:
    path = os.path.join(directory, asset.name)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise JobError(f"{what} {asset.name} is missing from {directory}") from None
    if len(data) != asset.size or _hash(data) != asset.blake3:
        raise JobError(
            f"{what} {asset.name} differs from the one the job binds: it has {len(data)} bytes hashing "
            f"to {_hash(data)}, the job binds {asset.size} bytes hashing to {asset.blake3}"
        )
    return data


def _check(job: Job, records: tuple[Record, ...], tok: ByteTokenizer | HFTokenizer, config: LlamaConfig) -> None:
    for r in records:
        if record_id(r.family, r.messages, r.answer) != r.id:
            raise JobError(f"record {r.id} does not hash to its id")
    if _hash(_ENC.encode(job.schedule)) != job.schedule_id:
        raise JobError("schedule_id is not the hash of the schedule")
    std = LEGACY_INIT_STD if job.seed.init_std is None else f64_decode(job.seed.init_std)
    if not (std > 0 and math.isfinite(std)):
        raise JobError(f"the seed's init_std must be positive and finite, got {std!r}")
    if tok.vocab_size > config.vocab_size:
        raise JobError(f"the tokenizer has {tok.vocab_size} ids but the model only {config.vocab_size}")
    check_roles(job.sets, records, {d for s in job.schedule.steps for d in s.docs})
    held = {d for s in job.sets for d in s.docs if s.kind == "task" or s.role == FINAL}
    exposed = set(job.exposed)
    if any(d >= len(records) for d in exposed):
        raise JobError("the job declares exposure of a record outside the records file")
    seen: set[int] = set(exposed)
    for n, step in enumerate(job.schedule.steps):
        if len(step.docs) != job.recipe.batch_size:
            raise JobError(
                f"schedule step {n} has {len(step.docs)} documents, the recipe's batch size is {job.recipe.batch_size}"
            )
        for d in step.docs:
            if d >= len(records) or d in held:
                raise JobError(f"schedule step {n} names document {d}, which is not a training record")
        for d in step.replay:
            if d not in step.docs or d not in seen:
                raise JobError(
                    f"schedule step {n} declares replay of document {d}, which is not in the step or was "
                    f"not trained in an earlier step (nor declared exposed)"
                )
        seen.update(step.docs)
    cohorts = {s.cohort for s in job.schedule.steps}
    for ref in job.recipe.distill.references:
        if (
            ref.cohort not in cohorts
            or (ref.source == "endpoint") != (ref.of is not None)
            or (ref.of is not None and (ref.of not in cohorts or ref.of == ref.cohort))
        ):
            raise JobError(f"the recipe's reference for cohort {ref.cohort!r} names no earlier cohort of the schedule")
    for s in job.schedule.steps:
        if s.replay and not any(r.cohort == s.cohort for r in job.recipe.distill.references):
            raise JobError(f"cohort {s.cohort!r} declares replay records but the recipe names no reference for it")
    groups = {g.name for g in job.recipe.groups}
    if groups != {"decay", "no_decay"}:
        raise JobError(f"the recipe must define groups 'decay' and 'no_decay', got {sorted(groups)}")


def load_job(path: str | os.PathLike[str]) -> PreparedJob:
    """Read and verify a job file and every file it binds; raise `JobError` on any mismatch."""
    path = str(path)
    if os.path.isdir(path):
        path = os.path.join(path, JOB_FILE)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_JOB_BYTES + 1)
    except FileNotFoundError:
        raise JobError(f"no job file at {path}") from None
    job = decode_job(raw, f"job file {path}")
    files = {JOB_FILE: raw}
    for a in job.tokenizer:
        files[a.name] = _read_bound(directory, a, "tokenizer asset", _MAX_ASSET_BYTES)
    files[job.records.name] = _read_bound(directory, job.records, "records file", _MAX_RECORDS_BYTES)
    return _verified(job, files, directory)


def _verified(job: Job, files: dict[str, bytes], directory: str) -> PreparedJob:
    """The job of ``files`` (job.json and every file it binds, each already matched to its
    hash) once its records, tokenizer and schedule check out; JobError otherwise."""
    rf: RecordFile = _decode(
        files[job.records.name], RecordFile, f"records file {job.records.name}", _MAX_RECORDS_BYTES
    )
    tok = build_tokenizer(files, tuple(a.name for a in job.tokenizer))
    prepared = PreparedJob(_hash(files[JOB_FILE]), job, directory, files, tok, rf.records)
    _check(job, rf.records, tok, prepared.config)
    used = {d for s in job.schedule.steps for d in s.docs} | {d for s in job.sets for d in s.docs}
    for i in sorted(used):  # trained, or scored and generated by evaluate: within the context either way
        if len(prepared.encoded(i)[0]) > prepared.config.max_position_embeddings:
            raise JobError(f"record {i} is longer than max_position_embeddings")
    return prepared


def check_job_files(files: Mapping[str, bytes], directory: str | os.PathLike[str]) -> PreparedJob:
    """What `load_job` checks of a job directory, of files still in memory (job.json and
    every file it binds, by name): a job is checked whole before any of it is written."""
    raw = files[JOB_FILE]
    job = decode_job(raw, "job file")
    for a in (*job.tokenizer, job.records):
        data = files.get(a.name)
        if data is None or len(data) != a.size or _hash(data) != a.blake3:
            raise JobError(f"the job binds a file {a.name} it was not given, or another one")
    return _verified(job, {n: bytes(files[n]) for n in (JOB_FILE, job.records.name, *(a.name for a in job.tokenizer))},
                     os.path.abspath(directory))  # fmt: skip


def write_job(out_dir: str | os.PathLike[str], files: Mapping[str, bytes]) -> str:
    """Write a job's files into ``out_dir`` once they check out (`check_job_files`; nothing is
    written, not even the directory, if they do not); return job.json's path."""
    check_job_files(files, out_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for n, data in files.items():
        (out / n).write_bytes(data)
    return str(out / JOB_FILE)


def with_seed_commit(files: Mapping[str, bytes], commit: str) -> dict[str, bytes]:
    """``files`` with job.json's seed commit replaced (a job planned and checked before the
    commit it starts from was written, `prepare --model`); no check reads the commit id."""
    job = decode_job(files[JOB_FILE])
    seed = msgspec.structs.replace(job.seed, commit=commit)
    return {**files, JOB_FILE: _ENC.encode(msgspec.structs.replace(job, seed=seed))}


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
    schedule = Schedule(version=_VERSION, steps=tuple(steps))
    files = {**assets, RECORDS_FILE: _ENC.encode(RecordFile(version=_VERSION, records=tuple(records)))}

    def asset(n: str) -> Asset:
        return Asset(name=n, blake3=_hash(files[n]), size=len(files[n]))

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
        version=_VERSION,
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
        schedule_id=_hash(_ENC.encode(schedule)),
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
    files[JOB_FILE] = _ENC.encode(job)
    return files
