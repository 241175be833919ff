"""The ``shardtrain`` command line: prepare, train, evaluate, select, gate, regroup, grow, plan, demo.

``train`` starts its own local workers, or, when started by ``torchrun`` (which sets
TORCHELASTIC_RUN_ID), runs as one worker of torchrun's group::

    ATEN_CPU_CAPABILITY=default torchrun --nproc-per-node 2 -m shardstore_cli.shardtrain_cli train --prepared JOB ...

The only shardtrain code that prints or exits. Results go to stdout (``--json`` for
scripts); progress and diagnostics to stderr. Training progress is printed by the
coordinator worker (slot 0) through ``print_step``, which the workers receive by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import shardstore
from shardtrain.errors import JobError

from ._commands import UsageError
from ._output import diagnostics, emit, fail, note
from ._render import jsonable
from ._train_render import (
    render_demo,
    render_plan,
    render_prepare,
    render_report,
    render_restore,
    render_select,
    render_train,
    render_transition,
)
from .exit_codes import SHARDTRAIN, Exit, epilog

if TYPE_CHECKING:
    from shardtrain.engine.model import LlamaConfig
    from shardtrain.engine.partition import Partition
    from shardtrain.reshape.planner import MemoryModel
    from shardtrain.reshape.regroup import TransitionResult
    from shardtrain.run.lifecycle import StepEvent

__all__ = ["EPILOG", "main", "print_step", "print_commit"]

EPILOG = epilog(SHARDTRAIN)


def print_step(e: StepEvent) -> None:
    """Progress line of one update (called on the coordinator worker)."""
    rate = e.tokens / e.seconds if e.seconds > 0 else 0.0
    line = f"step {e.step:>4}/{e.until}  loss {e.loss:.4f}  grad norm {e.grad_norm:.3f}  {rate:,.0f} tok/s"
    if e.commit:
        line += f"  committed {e.commit[:16]}"
        if e.commit_step is not None and e.commit_step != e.step:
            line += f" (step {e.commit_step})"
    print(line, file=sys.stderr, flush=True)  # progress as it happens (in a worker): not a document


def print_commit(e: StepEvent) -> None:
    """Progress line only when an update was committed (the demo's quieter progress)."""
    if e.commit:
        print_step(e)


def _slot_store(text: str) -> tuple[int, str]:
    slot, sep, url = text.partition("=")
    if not sep or not slot.isdigit() or not url:
        raise argparse.ArgumentTypeError(f"expected SLOT=STORE, got {text!r}")
    return int(slot), url


def _memory_tier(text: str) -> tuple[int | None, str | None]:
    """``--memory-tier``: ``DIR`` (every host's tier root), ``SLOT=DIR`` (that slot's), or ``off``."""
    slot, sep, path = text.partition("=")
    if sep and slot.isdigit():
        if not path:
            raise argparse.ArgumentTypeError(f"expected SLOT=DIR, got {text!r}")
        return int(slot), path
    if not text:
        raise argparse.ArgumentTypeError("expected DIR, SLOT=DIR or off")
    return None, None if text == "off" else text


def _tier_options(args: argparse.Namespace) -> dict[str, object]:
    """RunSpec's tier fields from ``--memory-tier`` (repeatable), ``--peer-replicas`` and ``--memory-tier-commits``."""
    from shardtrain.run.tiers import AUTO_TIER

    given = args.memory_tier or []
    roots = [path for slot, path in given if slot is None]
    if None in roots and len(given) > 1:
        raise JobError("--memory-tier off turns every tier off: give it alone")
    return {
        "memory_tier": roots[-1] if roots else AUTO_TIER,
        "memory_tiers": tuple((slot, path) for slot, path in given if slot is not None),
        "peer_replicas": args.peer_replicas,
        "tier_commits": args.memory_tier_commits,
    }


def cmd_prepare(args: argparse.Namespace) -> int:
    from shardtrain.engine.profile import Profile
    from shardtrain.job.default_job import prepare_default
    from shardtrain.job.job import load_job
    from shardtrain.job.user_job import describe, prepare_model, prepare_seed

    if args.model and args.seed_commit:
        raise JobError("give --model or --seed-commit, not both")
    if args.seed_commit and not args.seed_store:
        raise JobError("--seed-commit needs --seed-store (the store the start commit is in)")
    chosen = args.model and not args.seed_store
    if chosen:  # the import goes next to the job, and the output says where (train from it with --store)
        args.seed_store = os.path.join(args.out, "store")
    if not (args.model or args.seed_commit) and (args.records or args.replay or args.dev or args.final):
        raise JobError("--records, --replay, --dev and --final need --model (or --seed-commit with tokenizer assets)")
    profile = Profile(name=args.profile, recompute=args.recompute) if args.profile != "fp32" or args.recompute else None
    files = {"records": args.records, "replay": args.replay, "dev": args.dev, "final": args.final}
    kw: dict[str, Any]  # the job's options, by the name prepare_default / prepare_own take them
    if args.records:  # the user's data: one epoch unless --steps, an own-model learning rate unless --lr
        kw = {
            "batch_size": args.batch_size,
            "microbatch_size": args.microbatch_size,
            "init_seed": args.init_seed,
            "steps": args.steps,
            "replay_per_step": args.replay_per_step,
        }
    else:
        kw = {
            "steps_a": args.steps_a,
            "steps_b": args.steps_b,
            "batch_size": args.batch_size,
            "microbatch_size": args.microbatch_size,
            "data_seed": args.data_seed,
            "init_seed": args.init_seed,
        }
    kw.update({} if args.lr is None else {"lr": args.lr})
    if args.model:
        path = prepare_model(args.out, model_dir=args.model, store=args.seed_store, profile=profile, **files, **kw)
    elif args.seed_commit:
        store = shardstore.open_store(args.seed_store, create=False)
        path, carried = prepare_seed(args.out, store=store, commit=args.seed_commit, profile=profile, **files, **kw)
        if not carried and not args.quiet:
            print(
                f"shardtrain: note: commit {args.seed_commit} carries no tokenizer assets; the job binds the embedded "
                f"byte-level tokenizer",
                file=sys.stderr,
            )
    else:
        path = prepare_default(args.out, profile=profile, **kw)
    job = load_job(path)
    doc = {
        "job": path,
        "id": job.id,
        "schedule": job.schedule_id,
        "steps": job.num_steps,
        "seed": job.job.seed.commit,
        **describe(job),
        **({"seed_store": args.seed_store} if args.model or args.seed_commit else {}),
    }
    if chosen and not args.quiet:
        print(
            f"shardtrain: note: no --seed-store: the model was imported into {args.seed_store}, next to the job; "
            f"train from it with --store {args.seed_store}",
            file=sys.stderr,
        )
    emit(args, doc, render_prepare)
    return Exit.OK


def cmd_train(args: argparse.Namespace) -> int:
    from shardtrain.run.lifecycle import DETERMINISTIC_ENV, RunSpec, train, train_worker

    spec = RunSpec(
        job=args.prepared,
        store=args.store,
        until=args.until,
        every=args.every,
        resume=args.resume,
        ref=args.ref,
        slot_stores=tuple(args.slot_store or ()),
        message_timeout=args.timeout,
        progress=None if args.quiet else print_step,
        schedule=args.schedule,
        async_commits=not args.sync_commits,
        **_tier_options(args),  # type: ignore[arg-type]
    )
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: this process is one worker
        from datetime import timedelta

        from shardtrain.workers.launch import run_worker

        for k, v in DETERMINISTIC_ENV.items():
            os.environ.setdefault(k, v)  # ATEN_CPU_CAPABILITY is read at torch import: set it for torchrun too
        run_worker(train_worker, spec, timeout=timedelta(seconds=args.timeout))
        return Exit.OK
    t = time.monotonic()
    results = train(spec, args.workers, timeout=args.timeout)
    r0 = results[0]
    emit(args, results, render_train)
    if args.json:
        return Exit.OK
    if r0.start_commit is not None and args.resume not in (None, "auto"):
        store = shardstore.open_store(args.store)
        start = store.commit(r0.start_commit)
        if start.transition == "repartition" and start.parent == store.resolve(args.resume):  # train wrote it
            note(
                f"commit {start.parent[:12]} was laid out for {len(store.commit(start.parent).layout)} workers: wrote "
                f"repartition commit {r0.start_commit} for {args.workers} and resumed from it"
            )
    for r in results:
        if r.start_commit is not None:
            note(render_restore(jsonable(r)))
        for line in r.restore_rejected:
            note(f"shardtrain: warning: worker {r.rank}: {line}")
        note(
            f"worker {r.rank}: held {r.parameters:,} parameters ({r.parameter_bytes:,} bytes), "
            f"estimated peak {r.estimate_bytes / 2**20:.1f} MiB, actual {r.used_bytes / 2**20:.1f} MiB above "
            f"admission (peak RSS {r.peak_rss_bytes / 2**20:.0f} MiB)"
        )
    note(
        f"{len(r0.steps)} updates in {time.monotonic() - t:.1f} s; ref {args.ref} -> "
        f"{r0.commits[-1].id if r0.commits else '(unchanged)'}"
    )
    return Exit.OK


def cmd_evaluate(args: argparse.Namespace) -> int:
    from shardtrain.run.evaluate import EvalSpec, evaluate

    spec = EvalSpec(
        store=args.store,
        commits=tuple(args.commit),
        job=args.prepared,
        cases_per_set=args.cases,
        max_new_tokens=args.max_new_tokens,
        message_timeout=args.timeout,
        role="final" if args.final else "development",
    )
    report = evaluate(spec, args.workers, timeout=args.timeout)
    emit(args, report, render_report)
    return Exit.OK


def cmd_select(args: argparse.Namespace) -> int:
    from shardtrain.job.roles import select

    store = shardstore.open_store(args.store, create=False)
    lc = shardstore.load_commit(store, args.commit)
    oid = select(store, lc.commit.job, lc.id)
    emit(args, {"selection": oid, "job": lc.commit.job, "commit": lc.id}, render_select)
    return Exit.OK


def cmd_gate(args: argparse.Namespace) -> int:
    from shardtrain.run.evaluate import EvalSpec, evaluate, job_from_store
    from shardtrain.run.gates import gate_report, render_gates, thresholds_of, write_gate_report

    store = shardstore.open_store(args.store, create=False)
    baseline, candidate = shardstore.load_commit(store, args.baseline), shardstore.load_commit(store, args.candidate)
    with tempfile.TemporaryDirectory(prefix="shardtrain-gate-job-") as tmp:
        thresholds = thresholds_of(job_from_store(store, candidate.commit.job, tmp))  # fixed by the recipe
    spec = EvalSpec(
        store=args.store,
        commits=(baseline.id, candidate.id),
        cases_per_set=args.cases,
        max_new_tokens=args.max_new_tokens,
        message_timeout=args.timeout,
        role="final" if args.final else "development",
    )
    report = evaluate(spec, args.workers, timeout=args.timeout)
    gates = gate_report(report, thresholds, baseline=baseline.id, candidate=candidate.id)
    oid = write_gate_report(store, gates)

    def render(doc: dict[str, object]) -> str:  # the table names each commit's generated-correct count too
        return "\n".join(
            [
                *render_gates(gates, report.commits[0], report.commits[1]),
                f"report {oid} (pinned as gates/{gates.job}/{oid})",
            ]
        )

    emit(args, {"report": oid, "gates": gates}, render)
    return Exit.OK if gates.passed else Exit.PROBLEMS


def cmd_demo(args: argparse.Namespace) -> int:
    from shardtrain.run.demo import run_demo

    home = args.home or tempfile.mkdtemp(prefix="shardtrain-demo-")

    def say(line: str) -> None:  # the demo's narrative as it happens; on stderr when stdout holds --json's document
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    say(f"shardtrain demo in {home}")
    result = run_demo(home, say=say, progress=None if args.quiet else print_commit)
    emit(args, {**jsonable(result, keep_nonfinite=True), "equal": result.equal}, render_demo)
    return Exit.OK if result.equal and result.verify_ok and result.adaptive_ok else Exit.ERROR


def _memory_model(args: argparse.Namespace, config: LlamaConfig | None = None) -> MemoryModel:
    from shardtrain.job.job import load_job
    from shardtrain.reshape.planner import for_job

    if not args.prepared:
        raise JobError("--plan needs --prepared JOB (its sequence length and batch split)")
    return for_job(load_job(args.prepared), config, reference=True if getattr(args, "reference", False) else None)


def _capacities(args: argparse.Namespace, workers: int) -> list[int]:
    from shardtrain.reshape.planner import parse_bytes

    if not args.memory:
        raise JobError("--plan needs --memory SIZE[,SIZE...] (one per worker, or one for all)")
    caps = [parse_bytes(m) for m in args.memory.split(",")]
    if len(caps) == 1:
        caps *= workers
    if len(caps) != workers:
        raise JobError(f"--memory names {len(caps)} capacities for {workers} workers")
    return caps


def _layout(args: argparse.Namespace, config: LlamaConfig, workers: int | None) -> Partition | None:
    """The partition for a regroup or grow: --partition, --plan, or None (even)."""
    from shardtrain.engine.partition import Partition
    from shardtrain.reshape.planner import plan
    from shardtrain.reshape.regroup import parse_partition

    if args.partition:
        return parse_partition(args.partition, config.num_hidden_layers)
    if args.plan:
        n = workers or (len(args.memory.split(",")) if args.memory else None)
        if not n:
            raise JobError("--plan needs --workers N")
        return plan(_memory_model(args, config), _capacities(args, n)).partition
    return Partition.even(config.num_hidden_layers, workers) if workers else None


def _transition_ref(store: shardstore.Store, args: argparse.Namespace) -> str | None:
    """The ref a regroup/grow moves: --ref, else --commit when that is a ref name (moved by compare-and-swap)."""
    if args.ref is not None:
        return str(args.ref)
    return str(args.commit) if args.commit in store.ref_names() else None


def _warn_unnamed(ref: str | None, made: TransitionResult) -> None:
    if ref is None:
        note(
            f"shardtrain: warning: no ref names the new commit {made.commit} (--commit was not a ref and no --ref "
            "was given): `shardstore gc` will remove it; name it with `--ref NAME` next time"
        )


def cmd_regroup(args: argparse.Namespace) -> int:
    from shardtrain.reshape.regroup import commit_config, regroup

    store = shardstore.open_store(args.store, create=False)
    lc = shardstore.load_commit(store, args.commit)
    config, _ = commit_config(store, lc)
    ref = _transition_ref(store, args)
    made = regroup(store, lc.id, _layout(args, config, args.workers), workers=args.workers, ref=ref)
    emit(args, _transition_json(made), lambda doc: render_transition("repartition", doc))
    _warn_unnamed(ref, made)
    return Exit.OK


def _transition_json(m: TransitionResult) -> dict[str, object]:
    return {
        "commit": m.commit,
        "parent": m.parent,
        "step": m.step,
        "learned_root": m.learned_root,
        "parent_learned_root": m.parent_learned_root,
        "partition": [[r.start, r.stop] for r in m.partition.ranges],
        "new_objects": len(m.new_objects),
    }


def cmd_grow(args: argparse.Namespace) -> int:
    import dataclasses

    from shardtrain.reshape.grow import check_append, grow, identity_check
    from shardtrain.reshape.regroup import commit_config

    store = shardstore.open_store(args.store, create=False)
    lc = shardstore.load_commit(store, args.commit)
    config, _ = commit_config(store, lc)
    check_append(config.num_hidden_layers, args.append)  # before the layout (or anything else) is sized by it
    grown = dataclasses.replace(config, num_hidden_layers=config.num_hidden_layers + args.append)
    ref = _transition_ref(store, args)
    made = grow(
        store,
        lc.id,
        args.append,
        copy_from=args.copy_from,
        partition=_layout(args, grown, args.workers),
        ref=ref,
    )
    new = range(config.num_hidden_layers, config.num_hidden_layers + args.append)
    ok = identity_check(store, made.commit, new)
    check = f"identity check of layers {new.start}..{new.stop - 1}: "
    emit(
        args,
        {**_transition_json(made), "identity": ok},
        lambda doc: (
            render_transition("grow", doc)
            + "\n"
            + check
            + ("every new block maps its input to itself bitwise" if doc["identity"] else "FAILED")
        ),
    )
    _warn_unnamed(ref, made)
    return Exit.OK if ok else Exit.ERROR


def cmd_plan(args: argparse.Namespace) -> int:
    from shardtrain.reshape.planner import plan
    from shardtrain.reshape.regroup import commit_config

    config = None
    if args.commit:
        if not args.store:
            raise JobError("--commit needs --store")
        store = shardstore.open_store(args.store, create=False)
        config, _ = commit_config(store, shardstore.load_commit(store, args.commit))
    model = _memory_model(args, config)
    if args.memory_tier_commits < 0 or (args.peer_replicas or 0) < 0:
        raise JobError("--memory-tier-commits and --peer-replicas must be >= 0")
    buddies = (1 if args.workers >= 2 else 0) if args.peer_replicas is None else args.peer_replicas
    model = dataclasses.replace(model, tier_commits=args.memory_tier_commits, replicas=buddies)
    chosen = plan(model, _capacities(args, args.workers))
    rows = [
        {
            "slot": e.slot,
            "layers": list(e.layers),
            "parameters": e.parameters,
            "estimate": e.total,
            "weights": e.weights,
            "grads": e.grads,
            "moments": e.moments,
            "reference": e.reference,
            "activations": e.activations,
            "reserve": e.reserve,
            "tier": e.tier,
            "capacity": c,
            "utilisation": u,
        }
        for e, c, u in zip(chosen.estimates, chosen.capacities, chosen.utilisations())
    ]
    emit(
        args,
        {
            "partition": [[r.start, r.stop] for r in chosen.partition.ranges],
            "slots": rows,
            "max_utilisation": chosen.max_utilisation,
        },
        render_plan,
    )
    if chosen.max_utilisation > 1 and not args.json:
        note(
            "shardtrain: warning: no contiguous assignment fits these capacities (workers would refuse at "
            "admission): add workers or memory"
        )
    return Exit.OK


def build_parser() -> argparse.ArgumentParser:
    from ._help import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="shardtrain", description="Pipeline trainer on shardstore.", epilog=EPILOG, formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command")

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=EPILOG, formatter_class=HelpFormatter)
        p.set_defaults(func=func)
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        p.add_argument("--quiet", action="store_true", help="no progress lines")
        p.add_argument(
            "--storage-option",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help='S3 store option for every store opened, workers included (repeatable; README "Storage options")',
        )
        return p

    p = add(
        "prepare",
        cmd_prepare,
        "write a prepared job: the embedded default (tokenizer, generated tasks, tiny Llama), "
        "or your model (--model) and your records (--records)",
    )
    p.add_argument("--out", required=True, help="directory for job.json and the files it binds")
    p.add_argument("--steps-a", type=int, default=16, help="updates of cohort A (new records)")
    p.add_argument("--steps-b", type=int, default=8, help="updates of cohort B (new records + declared replay)")
    p.add_argument("--batch-size", type=int, default=8, help="records per update")
    p.add_argument(
        "--microbatch-size", type=int, default=4, help="records per pipeline microbatch (divides --batch-size)"
    )
    p.add_argument("--data-seed", type=int, default=0, help="seed of the generated records and their schedule")
    p.add_argument("--init-seed", type=int, default=1234, help="seed of the model's initial weights")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the embedded default's, docs/DEMO.md)")
    p.add_argument(
        "--seed-store",
        help="store holding --seed-commit, or receiving --model's import (default for --model: OUT/store)",
    )
    p.add_argument(
        "--seed-commit",
        help="start from this imported Llama commit (weights only) instead of a fresh init; "
        "its tokenizer assets, if it carries them, are bound",
    )
    p.add_argument(
        "--model",
        metavar="HF_DIR",
        help="start from a Hugging Face save_pretrained directory: its weights "
        "(widened to float32) are imported into --seed-store (default OUT/store) and its tokenizer files bound",
    )
    p.add_argument("--records", metavar="TRAIN.jsonl", help='your training records, {"messages": [...]} per line')
    p.add_argument("--replay", metavar="FILE.jsonl", help="declared replay records (distilled toward the seed)")
    p.add_argument("--dev", metavar="FILE.jsonl", help="development held-out records")
    p.add_argument("--final", metavar="FILE.jsonl", help="final held-out records (open after `select`)")
    p.add_argument("--steps", type=int, help="with --records: updates (default: one pass over the records)")
    p.add_argument("--replay-per-step", type=int, help="with --replay: replay records per update (default 2)")
    p.add_argument(
        "--profile",
        choices=("fp32", "bf16-autocast"),
        default="fp32",
        help="numerical profile (README, Numerical profiles); default fp32",
    )
    p.add_argument("--recompute", action="store_true", help="recompute each decoder block's activations in backward")

    p = add("train", cmd_train, "train a prepared job on local worker processes, committing to a store")
    p.add_argument("--prepared", required=True, metavar="JOB", help="job.json written by prepare")
    p.add_argument("--store", required=True, help="store path or URL; every commit goes here")
    p.add_argument("--until", type=int, required=True, metavar="N", help="train until N updates are complete")
    p.add_argument(
        "--resume",
        metavar="COMMIT",
        help="explicit commit (id, prefix or ref) every worker must agree on; "
        "'auto': the run's --ref if it exists, else the job's start (for torchrun --max-restarts)",
    )
    p.add_argument("--every", type=int, metavar="K", help="commit every K updates (and always at N)")
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="local workers (default 2); resuming a commit laid out for "
        "another count first writes its repartition commit (SPEC.md §15.1)",
    )
    p.add_argument("--ref", default="main", help="the ref that follows this run (default main)")
    p.add_argument(
        "--slot-store",
        type=_slot_store,
        action="append",
        metavar="SLOT=STORE",
        help="restore that slot from its own copy of the commit (shardstore copy --slot)",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a silent peer counts as lost")
    p.add_argument(
        "--schedule",
        choices=("overlapped", "synchronous"),
        default="overlapped",
        help="pipeline microbatch schedule (same commits either way; default overlapped)",
    )
    p.add_argument(
        "--sync-commits",
        action="store_true",
        help="wait for each commit in the step loop instead of writing it in the background",
    )
    p.add_argument(
        "--memory-tier",
        type=_memory_tier,
        action="append",
        metavar="DIR|SLOT=DIR|off",
        help="the host's memory tier, which keeps each slot's last commits for restarts (default: a directory "
        "under /dev/shm named for the store); SLOT=DIR gives one slot a tier of its own; off: none",
    )
    p.add_argument(
        "--peer-replicas",
        type=int,
        metavar="N",
        help="buddies that keep each slot's committed objects in their memory tier (default 1 with two or "
        "more workers; 0: none)",
    )
    p.add_argument(
        "--memory-tier-commits",
        type=int,
        default=1,
        metavar="K",
        help="commits each memory tier keeps (default 1: the latest)",
    )

    p = add("evaluate", cmd_evaluate, "held-out loss and greedy generation through the shards")
    p.add_argument(
        "--store", required=True, help="store path or URL holding the commits (and the job files train pinned)"
    )
    p.add_argument(
        "--commit",
        action="append",
        required=True,
        help="commit to evaluate; repeat to compare later commits with the first (paired bootstrap)",
    )
    p.add_argument("--prepared", metavar="JOB", help="job.json (default: the job files train kept in the store)")
    p.add_argument("--workers", type=int, help="default: the first commit's slot count")
    p.add_argument(
        "--cases",
        type=int,
        default=8,
        help="greedy generations per held-out set, at most the set's size "
        "(the embedded default's development sets hold one record per task family)",
    )
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens each generation may add")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a silent peer counts as lost")
    p.add_argument(
        "--final",
        action="store_true",
        help="the final sets (needs `select` of the last --commit); default: the development sets",
    )

    p = add("select", cmd_select, "select a candidate commit: the record that opens the job's final sets")
    p.add_argument("--store", required=True, help="store path or URL holding the candidate")
    p.add_argument("--commit", required=True, help="the candidate (id, prefix or ref)")

    p = add("gate", cmd_gate, "the experiment's gates (gain, retention, generation) of a candidate against a baseline")
    p.add_argument("--store", required=True, help="store path or URL holding both commits")
    p.add_argument("--baseline", required=True, help="the commit to compare against (id, prefix or ref)")
    p.add_argument("--candidate", required=True, help="the commit that must pass (id, prefix or ref)")
    p.add_argument("--final", action="store_true", help="gate on the final sets (needs `select` of the candidate)")
    p.add_argument("--workers", type=int, help="default: the baseline's slot count")
    p.add_argument("--cases", type=int, default=64, help="generations per task set")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens each generation may add")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a silent peer counts as lost")

    def layout_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--partition", metavar="A:B,B:C,...", help="layer ranges per slot, e.g. 0:3,3:5,5:8")
        p.add_argument("--plan", action="store_true", help="choose the partition with the capacity planner")
        p.add_argument("--prepared", metavar="JOB", help="job.json (for --plan: sequence length, batch split)")
        p.add_argument("--memory", metavar="SIZE[,SIZE...]", help="for --plan: each worker's memory, e.g. 24GiB,16GiB")
        p.add_argument(
            "--reference",
            action="store_true",
            help="for --plan: count a frozen reference model's share (default: if the job distils)",
        )
        p.add_argument(
            "--ref",
            help="move this ref from the commit to the new commit, by compare-and-swap "
            "(default: --commit itself when it is a ref name; else no ref, with a warning)",
        )

    p = add("regroup", cmd_regroup, "write a repartition commit: the same learned state on another worker layout")
    p.add_argument("--store", required=True, help="store path or URL")
    p.add_argument("--commit", required=True, help="the commit to regroup (id, prefix or ref; a ref moves with it)")
    p.add_argument("--workers", type=int, help="worker count (an even split unless --partition or --plan)")
    layout_options(p)

    p = add("grow", cmd_grow, "write a grow commit: append identity blocks copied from one layer")
    p.add_argument("--store", required=True, help="store path or URL")
    p.add_argument("--commit", required=True, help="the commit to grow (id, prefix or ref; a ref moves with it)")
    p.add_argument("--append", type=int, required=True, metavar="K", help="blocks to append after the last")
    p.add_argument(
        "--copy-from", type=int, metavar="L", help="layer whose internal weights the new blocks copy (default the last)"
    )
    p.add_argument("--workers", type=int, help="worker count of the grown layout (default the commit's)")
    layout_options(p)

    p = add("plan", cmd_plan, "estimate each worker's peak memory and choose the layer assignment")
    p.add_argument("--prepared", required=True, metavar="JOB", help="job.json (model, sequence length, batch split)")
    p.add_argument("--store", help="store holding --commit")
    p.add_argument("--commit", help="plan for this commit's model (e.g. a grown one) instead of the job's")
    p.add_argument("--workers", type=int, required=True, help="worker count to plan for")
    p.add_argument(
        "--memory",
        required=True,
        metavar="SIZE[,SIZE...]",
        help="each worker's memory (one size for all), e.g. 24GiB,16GiB",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="count a frozen reference model's share (default: whether the job distils)",
    )
    p.add_argument(
        "--memory-tier-commits",
        type=int,
        default=1,
        metavar="K",
        help="commits each worker's memory tier keeps (as train's option; 0: no memory tier); host memory, "
        "in the tier column",
    )
    p.add_argument(
        "--peer-replicas",
        type=int,
        metavar="N",
        help="buddies keeping each slot's objects in their host's tier (as train's: default 1 with two or more "
        "workers)",
    )

    p = add("demo", cmd_demo, "the main job: train, lose a worker, recover exactly, continue, evaluate")
    p.add_argument("--home", help="directory for the job and stores (default: a new temporary directory)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (``exit_codes.TABLE``, SPEC.md §Exit codes)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else Exit.USAGE
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return Exit.USAGE
    try:
        if args.storage_option:  # the environment carries them to every store and every worker
            from shardstore.backends.options import ENV, environment_with

            try:
                os.environ[ENV] = environment_with(args.storage_option)
            except ValueError as exc:  # not KEY=VALUE: a usage error, like any bad argument
                raise UsageError(str(exc), getattr(args, "parser", None)) from None  # type: ignore[arg-type]
        with diagnostics(f"shardtrain {args.command}"):
            return int(args.func(args))
    except (Exception, KeyboardInterrupt) as exc:  # the exit-code table decides; an error it does not name is raised
        return fail("shardtrain", args, exc)


if __name__ == "__main__":
    raise SystemExit(main())
