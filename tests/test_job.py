"""The prepared job: deterministic preparation, strict decoding, hash binding, assistant-only targets."""

from __future__ import annotations

import signal
from pathlib import Path

import msgspec
import pytest

from shardtrain.errors import JobError
from shardtrain.job.default_job import prepare_default
from shardtrain.job.job import JOB_FILE, RECORDS_FILE, decode_job, load_job
from shardtrain.job.tasks import FAMILIES
from shardtrain.job.tokenizer import TEMPLATE_FILE, TOKENIZER_FILE, default_assets, load_tokenizer

_ENC = msgspec.json.Encoder(order="sorted")


@pytest.fixture(scope="module")
def job_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return prepare_default(tmp_path_factory.mktemp("job"), steps_a=4, steps_b=2, batch_size=4, replay_per_step=1)


def _copy(job_path: str, dst: Path) -> Path:
    for f in Path(job_path).parent.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst / JOB_FILE


def test_preparation_is_deterministic(job_path: str, tmp_path: Path) -> None:
    again = prepare_default(tmp_path, steps_a=4, steps_b=2, batch_size=4, replay_per_step=1)
    assert load_job(again).id == load_job(job_path).id
    for name in (JOB_FILE, RECORDS_FILE, TOKENIZER_FILE, TEMPLATE_FILE):
        assert (tmp_path / name).read_bytes() == (Path(job_path).parent / name).read_bytes()
    assert (
        load_job(prepare_default(tmp_path / "b", steps_a=4, steps_b=2, batch_size=4, data_seed=1)).id
        != load_job(again).id
    )


def test_job_binds_every_file_and_the_schedule(job_path: str) -> None:
    job = load_job(job_path)
    assert {a.name for a in job.job.tokenizer} == {TOKENIZER_FILE, TEMPLATE_FILE}
    assert set(job.files) == {JOB_FILE, RECORDS_FILE, TOKENIZER_FILE, TEMPLATE_FILE}
    steps = job.job.schedule.steps
    assert [s.cohort for s in steps] == ["A"] * 4 + ["B"] * 2
    trained_a = {d for s in steps[:4] for d in s.docs}
    exposed = set(job.job.exposed)  # conversations the seed counts as trained: cohort A replays them
    assert all(len(s.replay) == 1 and set(s.replay) <= exposed for s in steps[:4])
    assert all(len(s.replay) == 1 and set(s.replay) <= trained_a | exposed for s in steps[4:])
    replayed_b = {job.records[d].family for s in steps[4:] for d in s.replay}
    assert "chat" in replayed_b and replayed_b - {"chat"}  # cohort B replays conversations and cohort-A tasks
    assert job.cursor(0) == 0 and job.cursor(6) == 24
    held = {i for s in job.job.sets if s.kind == "task" or s.role == "final" for i in job.eval_set(s.name)}
    assert held and not held & {d for s in steps for d in s.docs}
    assert {job.records[i].family for i in job.eval_set("dev_task")} == set(FAMILIES)
    assert [(s.name, s.role, s.kind) for s in job.job.sets] == [
        ("dev_task", "development", "task"),
        ("dev_retention", "development", "retention"),
        ("final_task", "final", "task"),
        ("final_retention", "final", "retention"),
    ]


@pytest.mark.parametrize("name", [TOKENIZER_FILE, TEMPLATE_FILE, RECORDS_FILE])
def test_a_changed_bound_file_is_refused(job_path: str, tmp_path: Path, name: str) -> None:
    path = _copy(job_path, tmp_path)
    data = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(data[:-1] + bytes([data[-1] ^ 0x20]))
    with pytest.raises(JobError, match=f"{name} differs from the one the job binds"):
        load_job(path)
    (tmp_path / name).unlink()
    with pytest.raises(JobError, match=f"{name} is missing"):
        load_job(path)


def test_job_file_is_strictly_decoded(job_path: str, tmp_path: Path) -> None:
    raw = Path(job_path).read_bytes()
    with pytest.raises(JobError, match="not in canonical encoding"):
        decode_job(raw.replace(b'{"exposed"', b'{ "exposed"', 1))
    with pytest.raises(JobError, match="unknown field|Object contains unknown field"):
        decode_job(raw[:-1] + b',"extra":1}')
    with pytest.raises(JobError, match="exceeds"):
        decode_job(b" " * (17 << 20))
    job = decode_job(raw)
    with pytest.raises(JobError, match="version 2 is not supported"):
        decode_job(_ENC.encode(msgspec.structs.replace(job, version=2)))
    # A schedule that declares replay of a record never trained before is refused.
    bad_step = msgspec.structs.replace(job.schedule.steps[0], replay=(job.schedule.steps[0].docs[0],))
    schedule = msgspec.structs.replace(job.schedule, steps=(bad_step, *job.schedule.steps[1:]))
    import blake3

    forged = msgspec.structs.replace(
        job, schedule=schedule, schedule_id=blake3.blake3(_ENC.encode(schedule)).hexdigest()
    )
    path = _copy(job_path, tmp_path)
    path.write_bytes(_ENC.encode(forged))
    with pytest.raises(JobError, match="declares replay of document .* not trained in an earlier step"):
        load_job(path)


def test_targets_are_assistant_tokens_only() -> None:
    tok = load_tokenizer(default_assets())
    messages = [{"role": "user", "content": "sum 1 2"}, {"role": "assistant", "content": "3"}]
    ids, weights = tok.encode_chat(messages)
    assert tok.decode(ids) == "<|bos|><|user|>sum 1 2<|end|><|assistant|>3<|end|>"
    assert tok.decode([i for i, w in zip(ids, weights) if w]) == "3<|end|>"
    assert ids[: len(tok.encode_prompt(messages[:1]))] == tok.encode_prompt(messages[:1])
    assert tok.decode(tok.encode("héllo <|end|>")) == "héllo <|end|>"


def test_batches_follow_the_schedule(job_path: str) -> None:
    job = load_job(job_path)
    batch = job.batch(5)
    assert batch.tokens.shape[0] == 4
    ids, w = job.encoded(job.job.schedule.steps[5].docs[0])
    n = len(ids) - 1
    assert batch.tokens[0, :n].tolist() == ids[:-1] and batch.targets[0, :n].tolist() == ids[1:]
    assert batch.weights[0, :n].tolist() == w[1:] and float(batch.weights[0, n:].sum()) == 0.0
    with pytest.raises(JobError, match="outside the job's schedule"):
        job.batch(6)


def test_the_recipe_names_a_reference_for_every_cohort_that_replays(job_path: str, tmp_path: Path) -> None:
    job = load_job(job_path)
    assert [(r.cohort, r.source, r.of) for r in job.job.recipe.distill.references] == [
        ("A", "seed", None),
        ("B", "endpoint", "A"),
    ]
    assert job.kl() == (0.5, 1.0) and job.cohort_end("A") == 4
    for refs, message in (
        ((), "cohort 'A' declares replay records but the recipe names no reference"),
        (
            (msgspec.structs.replace(job.job.recipe.distill.references[0], cohort="B", source="endpoint", of="B"),),
            "reference for cohort 'B' names no earlier cohort",
        ),
    ):
        recipe = msgspec.structs.replace(
            job.job.recipe, distill=msgspec.structs.replace(job.job.recipe.distill, references=refs)
        )
        path = _copy(job_path, tmp_path)
        path.write_bytes(_ENC.encode(msgspec.structs.replace(job.job, recipe=recipe)))
        with pytest.raises(JobError, match=message):
            load_job(path)


def test_the_seed_binds_its_initialisation_scale(job_path: str, tmp_path: Path) -> None:
    """`init_std` is bound by the job id; the legacy 0.02 is omitted, so older job files keep their bytes."""
    from shardtrain.engine.partition import Partition, build_stage
    from shardtrain.job.default_job import DEFAULT_INIT_STD
    from shardtrain.job.job import LEGACY_INIT_STD

    job = load_job(job_path)
    assert job.init_std() == DEFAULT_INIT_STD != LEGACY_INIT_STD
    assert b'"init_std"' in job.files[JOB_FILE]
    legacy = load_job(
        prepare_default(
            tmp_path / "legacy", steps_a=4, steps_b=2, batch_size=4, replay_per_step=1, init_std=LEGACY_INIT_STD
        )
    )
    assert legacy.init_std() == LEGACY_INIT_STD and b'"init_std"' not in legacy.files[JOB_FILE]
    assert legacy.id != job.id
    # A seed built the way `train` builds it has matrices of that scale.
    stage = build_stage(
        job.config,
        Partition.even(job.config.num_hidden_layers, 1),
        0,
        seed=job.job.seed.init_seed,
        init_std=job.init_std(),
    )
    std = float(stage.model.layers["0"].self_attn.q_proj.weight.std())
    assert abs(std - DEFAULT_INIT_STD) < 0.1 * DEFAULT_INIT_STD
    for bad in ("0000000000000000", "7ff8000000000000"):  # 0.0 and NaN
        raw = job.files[JOB_FILE].replace(job.job.seed.init_std.encode(), bad.encode())
        (tmp_path / "bad").mkdir(exist_ok=True)
        path = _copy(job_path, tmp_path / "bad")
        path.write_bytes(raw)
        with pytest.raises(JobError, match="init_std"):
            load_job(path)


def test_the_profile_is_bound_and_fp32_keeps_older_job_ids(job_path: str, tmp_path: Path) -> None:
    """A job names its numerical profile; plain fp32 is left out of job.json, so jobs prepared
    before profiles existed keep their ids, and any other profile is another job."""
    from shardtrain.engine.profile import Profile, label

    kw = dict(steps_a=4, steps_b=2, batch_size=4, replay_per_step=1)
    fp32 = load_job(prepare_default(tmp_path / "fp32", profile=Profile(name="fp32"), **kw))
    assert fp32.id == load_job(job_path).id and b"profile" not in fp32.files[JOB_FILE]
    ids = {fp32.id}
    for p in (
        Profile(name="bf16-autocast"),
        Profile(name="bf16-autocast", recompute=True),
        Profile(name="fp32", recompute=True),
    ):
        job = load_job(prepare_default(tmp_path / label(p), profile=p, **kw))
        assert job.job.profile == p and label(job.job.profile) == label(p)
        ids.add(job.id)
    assert len(ids) == 4
    assert [label(None), label(Profile(name="bf16-autocast", recompute=True))] == ["fp32", "bf16-autocast+recompute"]


_NAN, _INF = "7ff8000000000000", "7ff0000000000000"
_ZERO, _MINUS_ONE = "0000000000000000", "bff0000000000000"


def _bad(job: object, what: str, value: object) -> object:
    """``job`` with the field at dotted path ``what`` set to ``value`` (``groups`` means the first group)."""
    parts = what.split(".")

    def put(obj: object, path: list[str]) -> object:
        if path[0] == "groups":
            groups = obj.groups  # type: ignore[attr-defined]
            return msgspec.structs.replace(obj, groups=(put(groups[0], path[1:]),) + tuple(groups[1:]))
        if len(path) == 1:
            return msgspec.structs.replace(obj, **{path[0]: value})
        return msgspec.structs.replace(obj, **{path[0]: put(getattr(obj, path[0]), path[1:])})

    return put(job, parts)


@pytest.mark.parametrize(
    "what,value,field",
    [
        ("recipe.groups.lr", _NAN, "lr"),
        ("recipe.groups.lr", _INF, "lr"),
        ("recipe.groups.lr", _ZERO, "lr"),
        ("recipe.groups.beta2", "3ff0000000000000", "beta2"),
        ("recipe.groups.eps", _NAN, "eps"),
        ("recipe.warmup_steps", 10**6, "recipe.warmup_steps"),
        ("recipe.min_ratio", _NAN, "recipe.min_ratio"),
        ("recipe.max_grad_norm", _NAN, "recipe.max_grad_norm"),
        ("recipe.max_grad_norm", _MINUS_ONE, "recipe.max_grad_norm"),
        ("recipe.distill.temperature", _NAN, "temperature"),
        ("recipe.distill.temperature", _ZERO, "temperature"),
        ("recipe.distill.kl_coef", _NAN, "kl_coef"),
        ("recipe.distill.kl_coef", _MINUS_ONE, "kl_coef"),
        ("recipe.gates.resamples", 2**40, "gates.resamples"),
        ("recipe.gates.gain_bound", _INF, "gain_bound"),
        ("recipe.microbatch_size", 10**4, "microbatch_size"),
        ("model.num_hidden_layers", 10**6, "num_hidden_layers"),
        ("model.hidden_size", 2**30, "hidden_size"),
        ("model.rms_norm_eps", _NAN, "rms_norm_eps"),
    ],
)
def test_every_value_is_bounded_when_the_job_is_loaded(
    job_path: str, tmp_path: Path, what: str, value: object, field: str
) -> None:
    """Issue 24: non-finite or out-of-range reals and unbounded sizes are refused by `load_job`
    (JobError naming the field, docs/SHARDTRAIN-FORMATS.md §2) — before this, every one of them loaded."""
    job = load_job(job_path).job
    path = _copy(job_path, tmp_path)
    path.write_bytes(_ENC.encode(_bad(job, what, value)))
    with pytest.raises(JobError, match=f"job field [^ ]*{field.split('.')[-1]}"):
        load_job(path)
    with pytest.raises(JobError, match=field.split(".")[-1]):
        decode_job(path.read_bytes())


def test_train_refuses_a_bad_value_before_it_opens_the_store(job_path: str, tmp_path: Path) -> None:
    """`shardtrain train` on a job whose temperature is NaN exits 5 (refused) and writes nothing at all."""
    from shardstore_cli.shardtrain_cli import main

    job = load_job(job_path).job
    path = _copy(job_path, tmp_path)
    path.write_bytes(_ENC.encode(_bad(job, "recipe.distill.temperature", _NAN)))
    store = tmp_path / "store"
    assert main(["train", "--prepared", str(path), "--store", str(store), "--until", "1", "--quiet"]) == 5
    assert not store.exists()


def test_a_byte_tokenizer_template_that_loops_is_refused_within_its_cpu_budget(monkeypatch) -> None:
    """Regression (issue 30): a bound template with nested range(100000) loops hung every
    command that rendered it; now a rendering stops after its CPU budget (here 0.3 s)."""
    import shardtrain.job.rendering as rendering

    monkeypatch.setattr(rendering, "RENDER_CPU_SECONDS", 0.3)
    assets = default_assets()
    loop = b"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    tok = load_tokenizer({**assets, TEMPLATE_FILE: loop + assets[TEMPLATE_FILE]})
    with pytest.raises(JobError, match=r"chat_template.jinja did not finish rendering .* within 0.3 s of CPU time"):
        tok.encode_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}])
    tok = load_tokenizer(assets)  # and a template that does not loop renders as before, signal handler restored
    assert tok.encode_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}])[0]
    assert signal.getsignal(signal.SIGVTALRM) == signal.SIG_DFL
    assert signal.getitimer(signal.ITIMER_VIRTUAL) == (0.0, 0.0)
