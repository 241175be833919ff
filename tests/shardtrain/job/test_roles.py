"""Evaluation roles: finals need a selection, a second selection is refused once they opened,
and a final set that overlaps trained records is refused when the job is prepared."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from roles_fixtures import eval_role, roles_run  # noqa: F401  (roles_run: the fixture `run`)

import shardstore
from shardstore_cli.shardtrain_cli import main
from shardtrain.errors import JobError, RoleError
from shardtrain.job.job import JOB_FILE, load_job
from shardtrain.job.roles import DEVELOPMENT, FINAL, finals_opened, select, selection, set_digest

_ENC = msgspec.json.Encoder(order="sorted")


def test_development_by_default_and_finals_only_after_selection(run: SimpleNamespace) -> None:
    dev = eval_role(run, DEVELOPMENT)
    assert dev.role == DEVELOPMENT and {s.name for s in dev.commits[0].losses} == {"dev_task", "dev_retention"}
    with pytest.raises(RoleError, match="has no selection record"):
        eval_role(run, FINAL)
    assert (
        main(
            [
                "evaluate",
                "--store",
                run.url,
                "--commit",
                run.commits[0],
                "--commit",
                run.commits[1],
                "--final",
                "--workers",
                "1",
            ]
        )
        == 5
    )
    select(run.store, run.job.id, run.commits[0])
    with pytest.raises(RoleError, match="not .*final sets open only for the selected commit"):
        eval_role(run, FINAL)  # the candidate scored (the last commit) is not the selected one
    assert not finals_opened(run.store, run.job.id)
    assert main(["select", "--store", run.url, "--commit", run.commits[1]]) == 0  # not opened yet: may change
    sel = selection(run.store, run.job.id)
    assert sel is not None and sel.commit == run.commits[1] and sel.job == run.job.id
    final = eval_role(run, FINAL)
    assert final.role == FINAL and {s.name for s in final.commits[0].losses} == {"final_task", "final_retention"}
    assert finals_opened(run.store, run.job.id)
    with pytest.raises(RoleError, match="already opened .* a second selection is refused"):
        select(run.store, run.job.id, run.commits[0])
    assert main(["select", "--store", run.url, "--commit", run.commits[0]]) == 5
    assert selection(run.store, run.job.id) == sel
    # The selection object is pinned, so gc keeps it.
    assert set(run.store.pinned(f"selections/{run.job.id}") or ()) <= set(run.store.objects())
    shardstore.gc(run.store, grace_seconds=0, dry_run=False)
    assert selection(run.store, run.job.id) == sel and finals_opened(run.store, run.job.id)


def _forge(run: SimpleNamespace, tmp_path: Path, name: str, docs: tuple[int, ...]) -> Path:
    job = run.job.job
    records = run.job.records
    sets = tuple(
        msgspec.structs.replace(s, docs=docs, digest=set_digest(records, docs)) if s.name == name else s
        for s in job.sets
    )
    d = tmp_path / f"forged-{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    for f in Path(run.job.directory).iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / JOB_FILE).write_bytes(_ENC.encode(msgspec.structs.replace(job, sets=sets)))
    return d / JOB_FILE


def test_a_final_set_overlapping_trained_records_is_refused(run: SimpleNamespace, tmp_path: Path) -> None:
    steps = run.job.job.schedule.steps
    new_a, replayed = steps[0].docs[0], steps[0].replay[0]  # a new record of cohort A, a replayed conversation
    assert replayed not in steps[0].docs[:-1]
    for name, docs in (("final_retention", (new_a,)), ("final_retention", (replayed,)), ("final_task", (new_a,))):
        with pytest.raises(JobError, match=f"final .* set '{name}' overlaps the training and replay records"):
            load_job(_forge(run, tmp_path, name, docs))
    # A set whose records do not hash to its bound digest is refused too.
    job = run.job.job
    bad = tuple(msgspec.structs.replace(s, digest="0" * 64) if s.role == FINAL else s for s in job.sets)
    d = tmp_path / "digest"
    d.mkdir()
    for f in Path(run.job.directory).iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / JOB_FILE).write_bytes(_ENC.encode(msgspec.structs.replace(job, sets=bad)))
    with pytest.raises(JobError, match="do not hash to the digest the job binds"):
        load_job(d / JOB_FILE)


def test_development_retention_may_be_exposed_replay_but_final_sets_never_are(run: SimpleNamespace) -> None:
    job = run.job
    trained = {d for s in job.job.schedule.steps for d in s.docs}
    sets = {s.name: s for s in job.job.sets}
    assert set(sets["dev_retention"].docs) <= set(job.job.exposed)  # the replayed conversations: development only
    for name in ("final_task", "final_retention", "dev_task"):
        assert not set(sets[name].docs) & trained
    final_prompts = {
        job.records[d].messages[0].content for n in ("final_task", "final_retention") for d in sets[n].docs
    }
    assert not final_prompts & {job.records[d].messages[0].content for d in trained}


def _select_proc(
    url: str, job: str, commit: str, pause: bool, ready: object, done: object, q: object
) -> None:  # pragma: no cover
    """`select` in its own process; with `pause`, it stops just before its compare-and-swap of the
    selection pin (after its opened check) until the other process is done."""
    store = shardstore.open_store(url, create=False)
    real = store.pin
    if pause:

        def pin(*a: object, **k: object) -> None:
            ready.set(), done.wait(30)  # type: ignore[attr-defined,func-returns-value]
            store.pin = real  # type: ignore[method-assign]
            real(*a, **k)  # type: ignore[arg-type]

        store.pin = pin  # type: ignore[method-assign]
    else:
        ready.wait(30)  # type: ignore[attr-defined]
    try:
        select(store, job, commit)
        q.put(("select", "ok"))  # type: ignore[attr-defined]
    except RoleError as e:
        q.put(("select", str(e)))  # type: ignore[attr-defined]
    if not pause:
        done.set()  # type: ignore[attr-defined]


def _open_proc(
    url: str, job: str, commit: str, pause: bool, ready: object, done: object, q: object
) -> None:  # pragma: no cover
    """`open_finals` (what gate/evaluate --final run first) in its own process; with `pause`, it
    stops after reading the selection, just before recording the opening, until the other is done."""
    from shardtrain.job.roles import open_finals

    store = shardstore.open_store(url, create=False)
    real = store.add_to_pin
    if pause:

        def add(*a: object, **k: object) -> object:
            ready.set(), done.wait(30)  # type: ignore[attr-defined,func-returns-value]
            return real(*a, **k)  # type: ignore[arg-type]

        store.add_to_pin = add  # type: ignore[method-assign]
    else:
        ready.wait(30)  # type: ignore[attr-defined]
    try:
        open_finals(store, job, commit)
        q.put(("open", "ok"))  # type: ignore[attr-defined]
    except RoleError as e:
        q.put(("open", str(e)))  # type: ignore[attr-defined]
    if not pause:
        done.set()  # type: ignore[attr-defined]


@pytest.mark.parametrize("paused", ["open", "select"])
def test_select_and_gate_final_in_two_processes_never_strand_the_job(tmp_path: Path, paused: str) -> None:
    """Issue 24 (README §Distillation, "select and the final sets"): `select` of commit B against the
    opening of the final sets (`gate --final`, `evaluate --final`) for the selected commit A,
    in two processes, each interleaving forced: one process stops inside its critical
    section while the other runs whole. The intended outcome: the two are linearisable —
    finals-opened either does not exist or records exactly the current selection; the
    loser is refused (RoleError) and leaves nothing behind, so the job can go on. Before the
    fix, select running whole inside the opening left finals-opened on A's record while the
    selection named B: every later evaluate --final and select of the job was refused."""
    import multiprocessing as mp

    from shardtrain.job.roles import _opened_pin, _selection_pin, open_finals

    ctx = mp.get_context("fork")
    a, b = "a" * 64, "b" * 64
    url = str(tmp_path / "s")
    store = shardstore.open_store(url)
    job = "c" * 64
    select(store, job, a)
    ready, done, q = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_select_proc, args=(url, job, b, paused == "select", ready, done, q)),
        ctx.Process(target=_open_proc, args=(url, job, a, paused == "open", ready, done, q)),
    ]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    # Who wins: the process that ran whole; the paused one is refused.
    winner = "select" if paused == "open" else "open"
    assert got[winner] == "ok" and got[paused] != "ok", got
    opened, current = store.pinned(_opened_pin(job)), store.pinned(_selection_pin(job))
    assert opened is None or opened == current, (got, opened, current)
    sel = selection(store, job)
    assert sel is not None and sel.commit == (b if winner == "select" else a)
    if winner == "select":
        assert opened is None  # the refused opening left nothing
    open_finals(store, job, sel.commit)  # the job is not stranded: the current selection's finals open
    with pytest.raises(RoleError, match="already opened"):
        select(store, job, a)
