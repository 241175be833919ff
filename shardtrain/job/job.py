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

This module is the format and its reader: the Structs, `decode_job` and `load_job` (every
bound file read and checked), `check_job_files` / `write_job` (a job checked whole before
it is written), and the encoding every writer of a job uses (`encode`, `digest`, `VERSION`).
The jobs themselves are written by `default_job` (the embedded default) and `user_job`
(a user's own model and records).
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
from shardtrain.engine.profile import Profile
from shardtrain.errors import ConfigError, JobError
from shardtrain.job.bounds import check_bounds
from shardtrain.job.hf_tokenizer import HFTokenizer, build_tokenizer, commit_config_dict
from shardtrain.job.recipe import F64, CohortReference, Count, FileName, JobStruct, Positive, Recipe
from shardtrain.job.roles import DEVELOPMENT, FINAL, EvalSet, check_roles
from shardtrain.job.tasks import Record, record_id
from shardtrain.job.tokenizer import ByteTokenizer

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
    "model_spec",
    "encode",
    "digest",
    "VERSION",
    "LEGACY_INIT_STD",
    "ModelSpec",
    "SeedSpec",
    "Asset",
    "Step",
    "Schedule",
    "RecordFile",
]

JOB_FILE = "job.json"
RECORDS_FILE = "records.json"
_MAX_JOB_BYTES = 16 << 20
_MAX_RECORDS_BYTES = 256 << 20
_MAX_ASSET_BYTES = 64 << 20  # shardstore.ops.assets' bound: real tokenizer.json files reach ~20 MB
VERSION = 1
"""The version of job.json, of its schedule and of its records file: a reader refuses any other."""

Hex64 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]


class ModelSpec(JobStruct):
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


class SeedSpec(JobStruct, omit_defaults=True):
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


class Asset(JobStruct):
    """A file beside job.json, bound by BLAKE3 and size."""

    name: FileName
    blake3: Hex64
    size: Count


class Step(JobStruct):
    """One update's documents (indices into the records file), and which of them are declared replay."""

    cohort: FileName
    docs: tuple[Count, ...]
    replay: tuple[Count, ...]


class Schedule(JobStruct, tag="shardtrain-schedule", tag_field="type"):
    """Every update's documents, in order (bound into the job by its hash, ``schedule_id``)."""

    version: int
    steps: tuple[Step, ...]


class Job(JobStruct, tag="shardtrain-job", tag_field="type", omit_defaults=True):
    """job.json: everything a run is bound to, each file beside it by hash."""

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


class RecordFile(JobStruct, tag="shardtrain-records", tag_field="type"):
    """The records file beside job.json: every record the schedule and the held-out sets index."""

    version: int
    records: tuple[Record, ...]


_ENC = msgspec.json.Encoder(order="sorted")


def encode(value: Any) -> bytes:
    """The canonical bytes of a job file value (compact JSON, sorted keys): what a reader
    requires (`decode_job` refuses bytes that do not re-encode to themselves)."""
    return _ENC.encode(value)


def digest(data: bytes) -> str:
    """The BLAKE3 hex digest of ``data``: how a job binds each file beside it, and its own id."""
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
    if obj.version != VERSION:
        raise JobError(f"{what}: version {obj.version} is not supported (expected {VERSION})")
    return obj


def decode_job(raw: bytes, what: str = "job file") -> Job:
    """Strictly decode job file bytes (bounded, canonical, known version, every value in bounds)."""
    job = _decode(raw, Job, what, _MAX_JOB_BYTES)
    check_bounds(job)  # docs/SHARDTRAIN-FORMATS.md §2: before anything reads records, starts a worker, writes or pins
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
    if len(data) != asset.size or digest(data) != asset.blake3:
        raise JobError(
            f"{what} {asset.name} differs from the one the job binds: it has {len(data)} bytes hashing "
            f"to {digest(data)}, the job binds {asset.size} bytes hashing to {asset.blake3}"
        )
    return data


def _check(job: Job, records: tuple[Record, ...], tok: ByteTokenizer | HFTokenizer, config: LlamaConfig) -> None:
    for r in records:
        if record_id(r.family, r.messages, r.answer) != r.id:
            raise JobError(f"record {r.id} does not hash to its id")
    if digest(_ENC.encode(job.schedule)) != job.schedule_id:
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
    prepared = PreparedJob(digest(files[JOB_FILE]), job, directory, files, tok, rf.records)
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
        if data is None or len(data) != a.size or digest(data) != a.blake3:
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
