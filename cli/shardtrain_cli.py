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
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence

import msgspec

import shardstore
from shardstore.manifest import MAX_MANIFEST_BYTES, decode_config
from shardtrain.errors import (AdmissionError, DistillError, JobError, PartitionError, ResumeError, RoleError, RunAborted,
                               ShardtrainError, TransitionError)

__all__ = ["EPILOG", "main", "print_step", "print_commit"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_ABORTED, EXIT_REFUSED, EXIT_GATE_FAILED = 0, 1, 2, 3, 4, 5

EPILOG = """\
exit codes:
  0  success
  1  any other error
  2  usage error (bad arguments)
  3  a worker was lost, or a step's loss or gradient norm was not finite (NonFiniteStep), and the
     run aborted (the message names the last committed step)
  4  refused before training: the job, a tokenizer asset, the records or the start commit
     do not match (another job, a corrupt or mismatched shard, workers naming different commits);
     evaluate --final without a matching selection record; a second selection after finals were opened;
     a worker's estimated memory exceeds what it has free (AdmissionError); a regroup/grow
     cannot be made from that commit (TransitionError) or a partition cannot be made (PartitionError);
     a job value out of bounds (JobError naming the field); a distillation reference too shallow
     to split over the workers (DistillError)
  5  gate: at least one gate failed (the table and the stored report say which)
"""


def print_step(event: object) -> None:
    """Progress line of one update (called on the coordinator worker)."""
    e = event  # a shardtrain.lifecycle.StepEvent
    rate = e.tokens / e.seconds if e.seconds > 0 else 0.0  # type: ignore[attr-defined]
    line = (f"step {e.step:>4}/{e.until}  loss {e.loss:.4f}  grad norm {e.grad_norm:.3f}  "  # type: ignore[attr-defined]
            f"{rate:,.0f} tok/s")
    if e.commit:  # type: ignore[attr-defined]
        line += f"  committed {e.commit[:16]}"  # type: ignore[attr-defined]
        at = getattr(e, "commit_step", None)
        if at is not None and at != e.step:  # type: ignore[attr-defined]
            line += f" (step {at})"
    print(line, file=sys.stderr, flush=True)


def print_commit(event: object) -> None:
    """Progress line only when an update was committed (the demo's quieter progress)."""
    if getattr(event, "commit", None):
        print_step(event)


def _slot_store(text: str) -> tuple[int, str]:
    slot, sep, url = text.partition("=")
    if not sep or not slot.isdigit() or not url:
        raise argparse.ArgumentTypeError(f"expected SLOT=STORE, got {text!r}")
    return int(slot), url


def cmd_prepare(args: argparse.Namespace) -> int:
    from shardtrain.job import load_job, prepare_default

    config = None
    if args.seed_commit:
        store = shardstore.open_store(args.seed_store, create=False)
        lc = shardstore.load_commit(store, args.seed_commit)
        if lc.commit.config is None:
            raise JobError(f"commit {lc.id[:12]} has no model config")
        config = decode_config(store.get(lc.commit.config, limit=MAX_MANIFEST_BYTES))
        args.seed_commit = lc.id
    path = prepare_default(args.out, steps_a=args.steps_a, steps_b=args.steps_b, batch_size=args.batch_size,
                           microbatch_size=args.microbatch_size, data_seed=args.data_seed, init_seed=args.init_seed,
                           seed_commit=args.seed_commit, seed_config=config,
                           **({} if args.lr is None else {"lr": args.lr}))
    job = load_job(path)
    print(json.dumps({"job": path, "id": job.id, "schedule": job.schedule_id, "steps": job.num_steps})
          if args.json else f"{path}\njob {job.id}\nschedule {job.schedule_id}\nsteps {job.num_steps}")
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    from shardtrain.lifecycle import DETERMINISTIC_ENV, RunSpec, train, train_worker

    spec = RunSpec(job=args.prepared, store=args.store, until=args.until, every=args.every, resume=args.resume,
                   ref=args.ref, slot_stores=tuple(args.slot_store or ()), message_timeout=args.timeout,
                   progress=None if args.quiet else print_step, schedule=args.schedule,
                   async_commits=not args.sync_commits)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: this process is one worker
        from datetime import timedelta

        from shardtrain.launch import run_worker

        for k, v in DETERMINISTIC_ENV.items():
            os.environ.setdefault(k, v)  # ATEN_CPU_CAPABILITY is read at torch import: set it for torchrun too
        run_worker(train_worker, spec, timeout=timedelta(seconds=args.timeout))
        return EXIT_OK
    t = time.monotonic()
    results = train(spec, args.workers, timeout=args.timeout)
    r0 = results[0]
    if args.json:
        print(msgspec.json.encode(results).decode())
        return EXIT_OK
    if r0.start_commit is not None and args.resume not in (None, "auto"):
        store = shardstore.open_store(args.store)
        start = store.commit(r0.start_commit)
        if start.transition == "repartition" and start.parent == store.resolve(args.resume):  # train wrote it
            print(f"commit {start.parent[:12]} was laid out for {len(store.commit(start.parent).layout)} workers: wrote "
                  f"repartition commit {r0.start_commit} for {args.workers} and resumed from it", file=sys.stderr)
    for c in r0.commits:
        print(f"step {c.step}: {c.id}")
    for r in results:
        print(f"worker {r.rank}: held {r.parameters:,} parameters ({r.parameter_bytes:,} bytes), "
              f"estimated peak {r.estimate_bytes / 2**20:.1f} MiB, actual {r.used_bytes / 2**20:.1f} MiB above "
              f"admission (peak RSS {r.peak_rss_bytes / 2**20:.0f} MiB)", file=sys.stderr)
    print(f"{len(r0.steps)} updates in {time.monotonic() - t:.1f} s; ref {args.ref} -> "
          f"{r0.commits[-1].id if r0.commits else '(unchanged)'}", file=sys.stderr)
    return EXIT_OK


def _render_report(report: object) -> list[str]:
    from shardtrain.evaluate import EvalReport

    assert isinstance(report, EvalReport)
    names = [s.name for s in report.commits[0].losses]
    lines = ["commit        step  " + "  ".join(f"{n + ' loss':>12}" for n in names) + "  generated correct"]
    for c in report.commits:
        losses = "  ".join(f"{s.loss:>12.4f}" for s in c.losses)
        lines.append(f"{c.commit[:12]}  {c.step:>4}  {losses}  {c.correct:>3}/{len(c.cases)}"
                     f"  ({c.tokens_per_second:.0f} tok/s)")
    for cmp in report.comparisons:
        lines.append(f"{cmp.set}: {cmp.commit[:12]} - {cmp.baseline[:12]} = {cmp.diff:+.4f} nats/token, "
                     f"one-sided 95% bounds [{cmp.lower:+.4f}, {cmp.upper:+.4f}] (paired bootstrap)")
    last = report.commits[-1]
    for case in last.cases[:4]:
        mark = "ok" if case.correct else "wrong"
        lines.append(f"  {case.prompt!r} -> {case.generated!r} (expected {case.expected!r}: {mark})")
    return lines


def cmd_evaluate(args: argparse.Namespace) -> int:
    from shardtrain.evaluate import EvalSpec, evaluate

    spec = EvalSpec(store=args.store, commits=tuple(args.commit), job=args.prepared, cases_per_set=args.cases,
                    max_new_tokens=args.max_new_tokens, message_timeout=args.timeout,
                    role="final" if args.final else "development")
    report = evaluate(spec, args.workers, timeout=args.timeout)
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print("\n".join(_render_report(report)))
    return EXIT_OK


def cmd_select(args: argparse.Namespace) -> int:
    from shardtrain.roles import select

    store = shardstore.open_store(args.store, create=False)
    lc = shardstore.load_commit(store, args.commit)
    oid = select(store, lc.commit.job, lc.id)
    print(json.dumps({"selection": oid, "job": lc.commit.job, "commit": lc.id}) if args.json else
          f"selection {oid}: job {lc.commit.job} -> commit {lc.id} (pinned as selections/{lc.commit.job})")
    return EXIT_OK


def cmd_gate(args: argparse.Namespace) -> int:
    from shardtrain.evaluate import EvalSpec, evaluate, job_from_store
    from shardtrain.gates import gate_report, render_gates, thresholds_of, write_gate_report

    store = shardstore.open_store(args.store, create=False)
    baseline, candidate = shardstore.load_commit(store, args.baseline), shardstore.load_commit(store, args.candidate)
    with tempfile.TemporaryDirectory(prefix="shardtrain-gate-job-") as tmp:
        thresholds = thresholds_of(job_from_store(store, candidate.commit.job, tmp))  # fixed by the recipe
    spec = EvalSpec(store=args.store, commits=(baseline.id, candidate.id), cases_per_set=args.cases,
                    max_new_tokens=args.max_new_tokens, message_timeout=args.timeout,
                    role="final" if args.final else "development")
    report = evaluate(spec, args.workers, timeout=args.timeout)
    gates = gate_report(report, thresholds, baseline=baseline.id, candidate=candidate.id)
    oid = write_gate_report(store, gates)
    if args.json:
        print(json.dumps({"report": oid, "gates": msgspec.to_builtins(gates)}))
    else:
        print("\n".join(render_gates(gates, report.commits[0], report.commits[1])))
        print(f"report {oid} (pinned as gates/{gates.job}/{oid})")
    return EXIT_OK if gates.passed else EXIT_GATE_FAILED


def cmd_demo(args: argparse.Namespace) -> int:
    from shardtrain.demo import run_demo

    home = args.home or tempfile.mkdtemp(prefix="shardtrain-demo-")
    print(f"shardtrain demo in {home}", flush=True)
    result = run_demo(home, say=lambda line: print(line, flush=True), progress=None if args.quiet else print_commit)
    if result.report is not None:
        print("\n".join(_render_report(result.report)))
    t = result.timings
    print(f"demo finished in {result.seconds:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in t.items()) + ")")
    print(f"store: {result.store} (check it: shardstore verify {result.store})")
    return EXIT_OK if result.equal and result.verify_ok and result.adaptive_ok else EXIT_ERROR


def _memory_model(args: argparse.Namespace, config: object = None) -> object:
    from shardtrain.job import load_job
    from shardtrain.planner import for_job

    if not args.prepared:
        raise JobError("--plan needs --prepared JOB (its sequence length and batch split)")
    return for_job(load_job(args.prepared), config, reference=True if getattr(args, "reference", False) else None)  # type: ignore[arg-type]


def _capacities(args: argparse.Namespace, workers: int) -> list[int]:
    from shardtrain.planner import parse_bytes

    if not args.memory:
        raise JobError("--plan needs --memory SIZE[,SIZE...] (one per worker, or one for all)")
    caps = [parse_bytes(m) for m in args.memory.split(",")]
    if len(caps) == 1:
        caps *= workers
    if len(caps) != workers:
        raise JobError(f"--memory names {len(caps)} capacities for {workers} workers")
    return caps


def _layout(args: argparse.Namespace, config: object, workers: int | None) -> object:
    """The partition for a regroup or grow: --partition, --plan, or None (even)."""
    from shardtrain.partition import Partition
    from shardtrain.planner import plan
    from shardtrain.regroup import parse_partition

    if args.partition:
        return parse_partition(args.partition, config.num_hidden_layers)  # type: ignore[attr-defined]
    if args.plan:
        n = workers or (len(args.memory.split(",")) if args.memory else None)
        if not n:
            raise JobError("--plan needs --workers N")
        return plan(_memory_model(args, config), _capacities(args, n)).partition  # type: ignore[arg-type]
    return Partition.even(config.num_hidden_layers, workers) if workers else None  # type: ignore[attr-defined]


def _transition_lines(kind: str, made: object) -> list[str]:
    m = made  # a shardtrain.regroup.TransitionResult
    ranges = ",".join(f"{r.start}:{r.stop}" for r in m.partition.ranges)  # type: ignore[attr-defined]
    return [f"{kind} commit {m.commit}",  # type: ignore[attr-defined]
            f"parent {m.parent} (step {m.step})",  # type: ignore[attr-defined]
            f"layout {m.partition.num_slots} workers, layers {ranges}",  # type: ignore[attr-defined]
            f"learned-state root {m.learned_root}"  # type: ignore[attr-defined]
            + (" (equal to the parent's)" if m.learned_root == m.parent_learned_root else ""),  # type: ignore[attr-defined]
            f"{len(m.new_objects)} new objects"]  # type: ignore[attr-defined]


def cmd_regroup(args: argparse.Namespace) -> int:
    from shardtrain.regroup import commit_config, regroup

    store = shardstore.open_store(args.store, create=False)
    lc = shardstore.load_commit(store, args.commit)
    config, _ = commit_config(store, lc)
    made = regroup(store, lc.id, _layout(args, config, args.workers), workers=args.workers, ref=args.ref)  # type: ignore[arg-type]
    print(json.dumps(_transition_json(made)) if args.json else "\n".join(_transition_lines("repartition", made)))
    return EXIT_OK


def _transition_json(made: object) -> dict[str, object]:
    m = made
    return {"commit": m.commit, "parent": m.parent, "step": m.step, "learned_root": m.learned_root,  # type: ignore[attr-defined]
            "parent_learned_root": m.parent_learned_root,  # type: ignore[attr-defined]
            "partition": [[r.start, r.stop] for r in m.partition.ranges], "new_objects": len(m.new_objects)}  # type: ignore[attr-defined]


def cmd_grow(args: argparse.Namespace) -> int:
    import dataclasses

    from shardtrain.grow import grow, identity_check
    from shardtrain.regroup import commit_config

    store = shardstore.open_store(args.store, create=False)
    lc = shardstore.load_commit(store, args.commit)
    config, _ = commit_config(store, lc)
    grown = dataclasses.replace(config, num_hidden_layers=config.num_hidden_layers + max(1, args.append))
    made = grow(store, lc.id, args.append, copy_from=args.copy_from, partition=_layout(args, grown, args.workers),  # type: ignore[arg-type]
                ref=args.ref)
    new = range(config.num_hidden_layers, config.num_hidden_layers + args.append)
    ok = identity_check(store, made.commit, new)
    if args.json:
        print(json.dumps({**_transition_json(made), "identity": ok}))
    else:
        print("\n".join(_transition_lines("grow", made)))
        print(f"identity check of layers {new.start}..{new.stop - 1}: {'every new block maps its input to itself bitwise' if ok else 'FAILED'}")
    return EXIT_OK if ok else EXIT_ERROR


def cmd_plan(args: argparse.Namespace) -> int:
    from shardtrain.planner import plan
    from shardtrain.regroup import commit_config

    config = None
    if args.commit:
        if not args.store:
            raise JobError("--commit needs --store")
        store = shardstore.open_store(args.store, create=False)
        config, _ = commit_config(store, shardstore.load_commit(store, args.commit))
    chosen = plan(_memory_model(args, config), _capacities(args, args.workers))  # type: ignore[arg-type]
    rows = [{"slot": e.slot, "layers": list(e.layers), "parameters": e.parameters, "estimate": e.total,
             "weights": e.weights, "grads": e.grads, "moments": e.moments, "reference": e.reference,
             "activations": e.activations, "reserve": e.reserve, "capacity": c, "utilisation": u}
            for e, c, u in zip(chosen.estimates, chosen.capacities, chosen.utilisations())]
    if args.json:
        print(json.dumps({"partition": [[r.start, r.stop] for r in chosen.partition.ranges], "slots": rows,
                          "max_utilisation": chosen.max_utilisation}))
        return EXIT_OK
    print("slot  layers   parameters      estimate      capacity  utilisation")
    for r in rows:
        print(f"{r['slot']:>4}  {r['layers'][0]:>2}:{r['layers'][1]:<3}  {r['parameters']:>11,}  {r['estimate'] / 2**20:>9.1f} MiB"
              f"  {r['capacity'] / 2**20:>9.0f} MiB  {r['utilisation']:>10.1%}")
    ranges = ",".join(f"{r.start}:{r.stop}" for r in chosen.partition.ranges)
    print(f"--partition {ranges}  (highest utilisation {chosen.max_utilisation:.1%})")
    if chosen.max_utilisation > 1:
        print("shardtrain: warning: no contiguous assignment fits these capacities (workers would refuse at "
              "admission): add workers or memory", file=sys.stderr)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardtrain", description="Pipeline trainer on shardstore.", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")

    def add(name: str, func: object, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        p.add_argument("--quiet", action="store_true", help="no progress lines")
        return p

    p = add("prepare", cmd_prepare, "write a prepared job (the embedded default: tokenizer, generated tasks, tiny Llama)")
    p.add_argument("--out", required=True, help="directory for job.json and the files it binds")
    p.add_argument("--steps-a", type=int, default=16, help="updates of cohort A (new records)")
    p.add_argument("--steps-b", type=int, default=8, help="updates of cohort B (new records + declared replay)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--init-seed", type=int, default=1234)
    p.add_argument("--lr", type=float, help="peak learning rate (default: the embedded default's, README "
                   "\"What the demo learns\")")
    p.add_argument("--seed-store", help="store holding --seed-commit")
    p.add_argument("--seed-commit", help="start from this imported Llama commit (weights only) instead of a fresh init")

    p = add("train", cmd_train, "train a prepared job on local worker processes, committing to a store")
    p.add_argument("--prepared", required=True, metavar="JOB", help="job.json written by prepare")
    p.add_argument("--store", required=True, help="store path or URL; every commit goes here")
    p.add_argument("--until", type=int, required=True, metavar="N", help="train until N updates are complete")
    p.add_argument("--resume", metavar="COMMIT", help="explicit commit (id, prefix or ref) every worker must agree on; "
                   "'auto': the run's --ref if it exists, else the job's start (for torchrun --max-restarts)")
    p.add_argument("--every", type=int, metavar="K", help="commit every K updates (and always at N)")
    p.add_argument("--workers", type=int, default=2, help="local workers (default 2); resuming a commit laid out for "
                   "another count first writes its repartition commit (SPEC.md §15a)")
    p.add_argument("--ref", default="main", help="the ref that follows this run (default main)")
    p.add_argument("--slot-store", type=_slot_store, action="append", metavar="SLOT=STORE",
                   help="restore that slot from its own copy of the commit (shardstore copy --shard)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a silent peer counts as lost")
    p.add_argument("--schedule", choices=("overlapped", "synchronous"), default="overlapped",
                   help="pipeline microbatch schedule (same commits either way; default overlapped)")
    p.add_argument("--sync-commits", action="store_true",
                   help="wait for each commit in the step loop instead of writing it in the background")

    p = add("evaluate", cmd_evaluate, "held-out loss and greedy generation through the shards")
    p.add_argument("--store", required=True)
    p.add_argument("--commit", action="append", required=True,
                   help="commit to evaluate; repeat to compare later commits with the first (paired bootstrap)")
    p.add_argument("--prepared", metavar="JOB", help="job.json (default: the job files train kept in the store)")
    p.add_argument("--workers", type=int, help="default: the first commit's slot count")
    p.add_argument("--cases", type=int, default=8, help="generations per held-out set")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--final", action="store_true", help="the final sets (needs `select` of the last --commit); "
                   "default: the development sets")

    p = add("select", cmd_select, "select a candidate commit: the record that opens the job's final sets")
    p.add_argument("--store", required=True)
    p.add_argument("--commit", required=True, help="the candidate (id, prefix or ref)")

    p = add("gate", cmd_gate, "the experiment's gates (gain, retention, generation) of a candidate against a baseline")
    p.add_argument("--store", required=True)
    p.add_argument("--baseline", required=True)
    p.add_argument("--candidate", required=True)
    p.add_argument("--final", action="store_true", help="gate on the final sets (needs `select` of the candidate)")
    p.add_argument("--workers", type=int, help="default: the baseline's slot count")
    p.add_argument("--cases", type=int, default=64, help="generations per task set")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=60.0)

    def layout_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--partition", metavar="A:B,B:C,...", help="layer ranges per slot, e.g. 0:3,3:5,5:8")
        p.add_argument("--plan", action="store_true", help="choose the partition with the capacity planner")
        p.add_argument("--prepared", metavar="JOB", help="job.json (for --plan: sequence length, batch split)")
        p.add_argument("--memory", metavar="SIZE[,SIZE...]", help="for --plan: each worker's memory, e.g. 24GiB,16GiB")
        p.add_argument("--reference", action="store_true", help="for --plan: count a frozen reference model's share (default: if the job distils)")
        p.add_argument("--ref", help="move this ref from the commit to the new commit")

    p = add("regroup", cmd_regroup, "write a repartition commit: the same learned state on another worker layout")
    p.add_argument("--store", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--workers", type=int, help="worker count (an even split unless --partition or --plan)")
    layout_options(p)

    p = add("grow", cmd_grow, "write a grow commit: append identity blocks copied from one layer")
    p.add_argument("--store", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--append", type=int, required=True, metavar="K", help="blocks to append after the last")
    p.add_argument("--copy-from", type=int, metavar="L", help="layer whose internal weights the new blocks copy (default the last)")
    p.add_argument("--workers", type=int, help="worker count of the grown layout (default the commit's)")
    layout_options(p)

    p = add("plan", cmd_plan, "estimate each worker's peak memory and choose the layer assignment")
    p.add_argument("--prepared", required=True, metavar="JOB")
    p.add_argument("--store", help="store holding --commit")
    p.add_argument("--commit", help="plan for this commit's model (e.g. a grown one) instead of the job's")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--memory", required=True, metavar="SIZE[,SIZE...]")
    p.add_argument("--reference", action="store_true",
                   help="count a frozen reference model's share (default: whether the job distils)")

    p = add("demo", cmd_demo, "the main job: train, lose a worker, recover exactly, continue, evaluate")
    p.add_argument("--home", help="directory for the job and stores (default: a new temporary directory)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except RunAborted as exc:
        return _fail(args, exc, EXIT_ABORTED)
    except (JobError, ResumeError, RoleError, AdmissionError, TransitionError, PartitionError, DistillError,
            shardstore.ShardstoreError) as exc:
        return _fail(args, exc, EXIT_REFUSED)
    except (ShardtrainError, OSError, ValueError) as exc:
        return _fail(args, exc, EXIT_ERROR)
    except KeyboardInterrupt:
        return 130


def _fail(args: argparse.Namespace, error: BaseException, code: int) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"error": {"kind": type(error).__name__, "message": str(error), "exit": code}}), file=sys.stderr)
    else:
        print(f"shardtrain: error: {type(error).__name__}: {error}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
