"""The ``shardstore`` command line: verify, diff, log, show, cat, refs, export, import.

Modelled on git and restic: one subcommand per task, a store given as a local path or an
fsspec URL, targets given as a ref name, a full commit id or a unique id prefix (>= 8 hex
digits), ``--json`` on every command for scripts, data on stdout, diagnostics and
progress bars (tqdm, only on a terminal, never with ``--quiet``) on stderr, and a
documented exit-code table (SPEC.md §Exit codes). Each subcommand's handler is
``args.func(args) -> int``; ``cli.store_commands.register(subparsers)``, when that module
exists, adds more subcommands (copy, gc) the same way.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from tqdm import tqdm

import shardstore as ss
from shardstore.errors import ManifestError, ObjectNotFound, RefNotFound, ShardstoreError, TargetNotFound
from shardstore.manifest import decode_config
from shardstore.tensors import expected_nbytes

from ._render import jsonable, render_diff, render_log, render_refs, render_show, render_verify

__all__ = ["EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_PROBLEMS", "EXIT_NOT_FOUND", "build_parser", "main"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PROBLEMS = 3
EXIT_NOT_FOUND = 4

EPILOG = """\
targets: a ref name (main), a full commit id, or a unique id prefix of at least 8 hex digits.

exit codes:
  0  success; for verify: no problems found
  1  any other error (unreadable store, I/O error, corrupt manifest outside verify)
  2  usage error (bad arguments)
  3  verify found problems (each is listed with its object, tensor and commit)
  4  target not found (no such ref, commit id or unique prefix)
"""


class _UsageError(Exception):
    """Bad command-line arguments (exit 2)."""

    def __init__(self, message: str, parser: argparse.ArgumentParser) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that reports usage errors to ``main`` instead of exiting itself."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message, self)


# -- helpers ---------------------------------------------------------------------------


def _emit(args: argparse.Namespace, doc: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    """Print a command's document: as JSON with --json, else as text for people."""
    if args.json:
        print(json.dumps(jsonable(doc), indent=2))
    else:
        text = render(doc)
        if text:
            print(text)


def _note(args: argparse.Namespace, message: str) -> None:
    if not args.quiet and not args.json:
        print(message, file=sys.stderr)


def _bar(args: argparse.Namespace, desc: str, total: int | None = None) -> tqdm:
    """A byte progress bar on stderr, shown after a second, only on a terminal and without --quiet."""
    disable = args.quiet or not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, delay=1.0, disable=disable, file=sys.stderr, leave=False)


def _progress(bar: tqdm) -> Callable[[str, int, int], None]:
    def tick(name: str, nbytes: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(nbytes)

    return tick


def _open(url: str, *, create: bool = False) -> ss.Store:
    return ss.open_store(url, create=create)


def _refs_by_commit(store: ss.Store) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, cid in sorted(store.refs().items()):
        out.setdefault(cid, []).append(name)
    return out


def _counting(store: ss.Store, bar: tqdm) -> ss.Store:
    """A shallow copy of ``store`` whose reads advance ``bar`` by the bytes read."""
    wrapped = ss.Store.__new__(ss.Store)
    wrapped.__dict__.update(store.__dict__)
    read = store.get

    def get(oid: str, *, verify: bool = True) -> Any:
        data = read(oid, verify=verify)
        bar.update(len(data))
        return data

    wrapped.get = get  # type: ignore[method-assign]
    return wrapped


# -- commands --------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    if args.shard is not None and args.shard < 0:
        raise _UsageError(f"--shard must be a slot number >= 0, got {args.shard}", args.parser)
    store = _open(args.store)
    with _bar(args, "verify") as bar:
        report = ss.verify(_counting(store, bar), args.targets or None, deep=not args.quick, slot=args.shard)
    problems = [
        {"kind": p.kind, "object": p.object, "tensor": p.tensor, "commit": p.commit, "message": str(p.error)} for p in report.problems
    ]
    doc = {
        "ok": report.ok,
        "deep": not args.quick,
        "slot": args.shard,
        "commits": report.commits,
        "objects_checked": report.objects_checked,
        "bytes_hashed": report.bytes_hashed,
        "problems": problems,
        "refs_by_commit": _refs_by_commit(store),
    }
    _emit(args, doc, render_verify)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_diff(args: argparse.Namespace) -> int:
    from shardstore.diff import diff

    d = diff(_open(args.store), args.a, args.b, stats=args.stats)
    doc = jsonable(d)
    for t, td in zip(doc["tensors"], d.tensors):
        for role, st in td.stats.items():
            t["stats"][role]["rel_l2"] = jsonable(st.rel_l2)
    doc.update(
        empty=d.empty,
        learned_root_equal=d.learned_root_equal,
        layout_changed=d.layout_changed,
        counts={s: len(d.by_status(s)) for s in ("changed", "added", "removed")} | {"unchanged": len(d.unchanged)},
    )

    def render(doc: dict[str, Any]) -> str:
        text = render_diff(doc)
        return text + "".join(f"\n  same     {name}" for name in d.unchanged) if args.all and not d.empty else text

    _emit(args, doc, render)
    return EXIT_OK


def _default_target(store: ss.Store, parser: argparse.ArgumentParser) -> str:
    refs = store.refs()
    if "main" in refs:
        return "main"
    if len(refs) == 1:
        return next(iter(refs))
    raise _UsageError(f"give a target: the store has no ref 'main' and {len(refs)} other refs", parser)


def cmd_log(args: argparse.Namespace) -> int:
    store = _open(args.store)
    cid: str | None = store.resolve(args.target or _default_target(store, args.parser))
    commits: list[dict[str, Any]] = []
    missing = None
    while cid is not None and (args.max_count is None or len(commits) < args.max_count):
        try:
            c = store.commit(cid)
        except ObjectNotFound:
            if not commits:
                raise TargetNotFound(f"commit {cid} is not in {store.url}") from None
            missing = cid
            break
        commits.append({"id": cid, "step": c.step, "transition": c.transition, "learned_root": c.learned_root, "parent": c.parent})
        cid = c.parent
    _emit(args, {"commits": commits, "missing_parent": missing}, render_log)
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from shardstore.optim import hyper_of

    store = _open(args.store)
    lc = ss.load_commit(store, args.target)
    layout = []
    for lay in lc.commit.layout:
        shard = lc.shards[lay.slot]
        nbytes = elements = 0
        for e in shard.entries:
            n = expected_nbytes(e.dtype, e.shape)
            elements += n // expected_nbytes(e.dtype, (1,))
            nbytes += n
            if e.optim is not None and e.optim.moment_dtype is not None and e.optim.exp_avg is not None:
                nbytes += 2 * expected_nbytes(e.optim.moment_dtype, e.shape)
        layout.append({"slot": lay.slot, "shard": lay.shard, "tensors": len(shard.entries), "elements": elements, "bytes": nbytes})
    totals = {k: sum(s[k] for s in layout) for k in ("tensors", "elements", "bytes")}
    optimizer = {"algorithm": lc.commit.optimizer.algorithm, "groups": {g.name: vars(hyper_of(g)) for g in lc.commit.optimizer.groups}}
    doc = {
        "id": lc.id,
        "refs": _refs_by_commit(store).get(lc.id, []),
        "commit": lc.commit,
        "optimizer": optimizer,
        "layout": layout,
        "totals": totals,
    }
    _emit(args, jsonable(doc), render_show)
    return EXIT_OK


def cmd_cat(args: argparse.Namespace) -> int:
    store = _open(args.store)
    oid = store.resolve(args.id)
    try:
        data = bytes(store.get(oid))
    except ObjectNotFound:
        raise TargetNotFound(f"object {oid} is not in {store.url}") from None
    kind: str
    try:
        value: Any = ss.decode(data, what=f"object {oid}")
        kind = type(value).__name__
    except ManifestError:
        try:
            value, kind = decode_config(data), "model config"
        except ManifestError:
            try:
                value, kind = json.loads(data), "json"
            except ValueError:
                raise ManifestError(f"object {oid} ({len(data)} bytes) is not a manifest, a model config or JSON (a tensor or RNG state?)") from None
    if args.json:
        print(json.dumps({"id": oid, "kind": kind, "value": jsonable(value)}, indent=2))
    else:
        print(json.dumps(jsonable(value), indent=2))
    return EXIT_OK


def cmd_refs(args: argparse.Namespace) -> int:
    store = _open(args.store)
    _emit(args, {"refs": dict(sorted(store.refs().items()))}, render_refs)
    return EXIT_OK


_SIZE = re.compile(r"^(\d+)\s*([KMGT]i?B?|B)?$", re.IGNORECASE)


def _size(text: str) -> int:
    """'5GB' -> 5*10**9, '512MiB' -> 512*2**20, '1000' -> 1000."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB, 1000000)")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    value = int(m.group(1)) * scale
    if value < 1:
        raise argparse.ArgumentTypeError("size must be positive")
    return value


def _layout(text: str) -> list[tuple[int, int]]:
    """'0:2,2:4' -> [(0, 2), (2, 4)]: one half-open decoder-layer range per slot."""
    try:
        return [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a layout: {text!r} (e.g. 0:2,2:4, one START:STOP layer range per slot)") from None


def cmd_export(args: argparse.Namespace) -> int:
    from shardstore.interchange import export_commit

    store = _open(args.store)
    with _bar(args, "export") as bar:
        result = export_commit(
            store, args.target, args.out_dir, with_optimizer=args.with_optimizer,
            max_shard_bytes=args.max_shard_size, overwrite=args.force, progress=_progress(bar),
        )  # fmt: skip
    doc = jsonable(result)

    def render(d: dict[str, Any]) -> str:
        head = f"exported commit {d['commit']}: {d['tensors']} tensors, {d['bytes']} bytes of weights{' and moments' if args.with_optimizer else ''}"
        return "\n".join([head, *(f"  {os.path.join(d['out_dir'], f)}" for f in d["files"])])

    _emit(args, doc, render)
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from shardstore.interchange import import_directory

    if args.slots is not None and args.slots < 1:
        raise _UsageError(f"--slots must be >= 1, got {args.slots}", args.parser)
    store = _open(args.store, create=True)
    with _bar(args, "import") as bar:
        cid = import_directory(
            store, args.src_dir, ref=args.ref, slots=args.slots or 1, layout=args.layout, job=args.job,
            step=args.step, verify=not args.no_verify, progress=_progress(bar),
        )  # fmt: skip
    lc = ss.load_commit(store, cid)
    entries = lc.entries().values()
    doc = {
        "commit": cid,
        "ref": args.ref,
        "slots": len(lc.commit.layout),
        "tensors": len(entries),
        "bytes": sum(expected_nbytes(e.dtype, e.shape) for e in entries),
        "source": args.src_dir,
    }
    _emit(args, doc, lambda d: d["commit"])
    _note(args, f"imported {doc['tensors']} tensors ({doc['bytes']} bytes) into {doc['slots']} slot(s); ref {args.ref} -> {cid}")
    return EXIT_OK


# -- parser ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with every subcommand (and those of ``cli.store_commands`` if present)."""
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout, for scripts")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars or notes on stderr")
    parser = _Parser(
        prog="shardstore",
        description="Inspect, verify and move checkpoints in a shardstore store (a local path or an fsspec URL).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardstore {ss.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func, parser=p)
        p.add_argument("store", metavar="STORE", help="store path or fsspec URL")
        return p

    p = add("verify", cmd_verify, "check commits and every object they reach; report every problem")
    p.add_argument("targets", nargs="*", metavar="TARGET", help="commits to check (default: everything reachable from refs)")
    p.add_argument("--quick", action="store_true", help="check structure and object sizes only; do not re-hash")
    p.add_argument("--shard", type=int, metavar="K", help="check only the objects of slot K")
    p = add("diff", cmd_diff, "what changed from commit A to commit B")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--stats", action="store_true", help="max |diff| and relative L2 change of each changed parameter and moment")
    p.add_argument("--all", action="store_true", help="also list unchanged tensors by name (--json always does)")
    p = add("log", cmd_log, "the parent chain of a commit: id, step, kind, learned-state root")
    p.add_argument("target", nargs="?", metavar="TARGET", help="default: ref main (or the only ref)")
    p.add_argument("-n", "--max-count", type=int, metavar="N", help="show at most N commits")
    p = add("show", cmd_show, "a commit's fields and its layout (slot, tensors, parameters, bytes)")
    p.add_argument("target", metavar="TARGET")
    p = add("cat", cmd_cat, "print any manifest (or model config) decoded as JSON")
    p.add_argument("id", metavar="ID", help="object id, unique prefix, or ref name")
    add("refs", cmd_refs, "list refs and the commits they point at")
    p = add("export", cmd_export, "write a commit as a Hugging Face style safetensors directory")
    p.add_argument("target", metavar="TARGET")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--with-optimizer", action="store_true", help="also write the Adam moments and optimizer.json")
    p.add_argument("--max-shard-size", type=_size, default=5 * 10**9, metavar="SIZE", help="split files above SIZE (default 5GB)")
    p.add_argument("--force", action="store_true", help="overwrite files already in OUT_DIR")
    p = add("import", cmd_import, "commit a Hugging Face style Llama directory (weights only, kind 'import')")
    p.add_argument("src_dir", metavar="SRC_DIR")
    p.add_argument("--ref", default="main", help="ref to move to the new commit (default: main)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--slots", type=int, metavar="N", help="split decoder layers evenly over N slots")
    group.add_argument("--layout", type=_layout, metavar="RANGES", help="explicit layer ranges per slot, e.g. 0:2,2:4")
    p.add_argument("--job", default="default", help="job id bound into the commit (default: default)")
    p.add_argument("--step", type=int, default=0, help="global step of the commit (default 0)")
    p.add_argument("--no-verify", action="store_true", help="do not re-read each stored object")
    _register_plugins(sub)
    return parser


def _register_plugins(sub: Any) -> None:
    """Let ``cli/store_commands.py`` (copy, gc), when present, add its subcommands."""
    try:
        store_commands = importlib.import_module("cli.store_commands")
    except ModuleNotFoundError as e:
        if e.name != "cli.store_commands":
            raise  # the module exists but is broken: say so
        return
    store_commands.register(sub)


def _fail(args: argparse.Namespace | None, error: BaseException, code: int) -> int:
    kind = type(error).__name__
    if args is not None and getattr(args, "json", False):
        print(json.dumps({"error": {"kind": kind, "message": str(error), "exit": code}}), file=sys.stderr)
    else:
        print(f"shardstore: error: {kind}: {error}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (see EPILOG)."""
    parser = build_parser()
    args: argparse.Namespace | None = None
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # argparse cannot take TARGET ... after an option (bpo-14191): accept them here
            if not isinstance(getattr(args, "targets", None), list) or any(x.startswith("-") for x in extra):
                getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
            args.targets.extend(extra)
        if getattr(args, "func", None) is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        for name in ("json", "quiet"):
            if not hasattr(args, name):  # a plugin subcommand without the common options
                setattr(args, name, False)
        return int(args.func(args))
    except _UsageError as e:
        e.parser.print_usage(sys.stderr)
        print(f"{e.parser.prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except (TargetNotFound, RefNotFound) as e:
        return _fail(args, e, EXIT_NOT_FOUND)
    except ShardstoreError as e:
        return _fail(args, e, EXIT_ERROR)
    except BrokenPipeError:  # stdout closed early (| head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:
        return _fail(args, e, EXIT_ERROR)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
