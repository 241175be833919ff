"""``shardstore copy`` and ``shardstore gc``: moving commits between stores, and reclaiming space.

``register(subparsers)`` adds both subcommands to the main parser (``shardstore_cli.shardstore_cli``
calls it when this module exists). Each handler returns `Exit.OK` or raises; ``main`` maps the
error to its exit code by the one table (``exit_codes``, SPEC.md §Exit codes). Data goes to
stdout (human text, or one JSON document with ``--json``), diagnostics to stderr, and a
byte progress bar (tqdm) to stderr only on a terminal and without ``--quiet``.

Stores are paths or URLs; S3 credentials and endpoint come from the environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, profiles...).
"""

from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn

import shardstore as ss
from shardstore.ops.gc import GcResult, gc
from shardstore.ops.transfer import DEFAULT_THREADS, CopyResult, check_copy, copy_commit

from ._output import bar, emit, note
from ._render import marker_doc, render_copy, render_gc, render_unpin
from .exit_codes import Exit

__all__ = ["register", "parse_duration", "cmd_copy", "cmd_gc"]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: str) -> float:
    """Seconds in a duration like ``90s``, ``30m``, ``1h``, ``2d``, ``1h30m`` or a plain number of seconds."""
    t = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", t):
        return float(t)
    if not t or _DURATION.sub("", t):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: use e.g. 90s, 30m, 1h, 2d or 1h30m")
    return sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(t))


def _common(p: argparse.ArgumentParser) -> None:
    from ._commands import add_storage_option

    p.add_argument("--json", action="store_true", help="print one JSON document on stdout, for scripts")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")
    add_storage_option(p)


def register(subparsers: Any) -> None:
    """Add the ``copy``, ``gc`` and ``unpin`` subcommands to the main parser's subparsers."""
    from ._commands import add_slot_option
    from ._help import HelpFormatter
    from .shardstore_cli import EPILOG  # the one exit-code table (imported here: shardstore_cli calls register)

    p = subparsers.add_parser(
        "copy",
        formatter_class=HelpFormatter,
        epilog=EPILOG,
        help="copy a commit and everything it needs to another store",
        description="Copy commit TARGET from SRC to DST: its manifests and the objects of every slot "
        "(or of slot K only), sending only objects DST lacks and verifying every byte on arrival.",
    )
    p.add_argument("src", metavar="SRC", help="source store path or URL")
    p.add_argument("dst", metavar="DST", help="destination store path or URL (created if absent)")
    p.add_argument("target", metavar="TARGET", help="ref name, commit id or unique id prefix in SRC")
    add_slot_option(p, "copy only what slot K needs to restore")
    p.add_argument("--ref", metavar="NAME", help="afterwards move ref NAME in DST to the commit")
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME",
        help="also copy pin NAME and the objects it keeps (repeatable; e.g. a run's jobs/<job id>)",
    )
    p.add_argument(
        "--with-deps",
        action="store_true",
        help="also the commits its job depends on (a run's seed and frozen references: pin references/<job>) "
        "and the job's pins",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        metavar="N",
        help=f"objects in flight at once (default {DEFAULT_THREADS})",
    )
    _common(p)
    p.set_defaults(func=cmd_copy, parser=p)
    g = subparsers.add_parser(
        "gc",
        formatter_class=HelpFormatter,
        epilog=EPILOG,
        help="delete objects no ref can reach",
        description="Delete objects not reachable from any ref (commits, present parents, their closures) "
        "and named by no pin. Objects younger than the grace period, and objects a young manifest names, "
        "are kept: a save in progress is not referenced yet.",
    )
    g.add_argument("store", metavar="STORE", help="store path or URL")
    g.add_argument("--dry-run", action="store_true", help="report what would be deleted; delete nothing")
    g.add_argument(
        "--grace",
        type=parse_duration,
        default=3600.0,
        metavar="DURATION",
        help="keep objects younger than this (default 1h)",
    )
    g.add_argument(
        "--break-marker",
        metavar="NONCE",
        help="only remove gc marker gc/NONCE left by a gc that is gone (`shardstore refs` lists markers); "
        "refused while that gc runs on this host",
    )
    _common(g)
    g.set_defaults(func=cmd_gc, parser=g)
    u = subparsers.add_parser(
        "unpin",
        formatter_class=HelpFormatter,
        epilog=EPILOG,
        help="remove a pin, so that gc may collect the objects it kept",
        description="Remove pin NAME (for example jobs/<job id>, which shardtrain writes). The objects "
        "stay until gc finds nothing else naming them. `shardstore refs` lists the pins.",
    )
    u.add_argument("store", metavar="STORE", help="store path or URL")
    u.add_argument("name", metavar="NAME", help="pin name")
    _common(u)
    u.set_defaults(func=cmd_unpin, parser=u)


def _usage(args: argparse.Namespace, message: str) -> NoReturn:
    from ._commands import UsageError

    raise UsageError(message, args.parser)


def cmd_copy(args: argparse.Namespace) -> int:
    if args.slot is not None and args.slot < 0:
        _usage(args, f"--slot must be a slot number >= 0, got {args.slot}")
    if args.threads < 1:
        _usage(args, f"--threads must be >= 1, got {args.threads}")
    src = ss.open_store(args.src, create=False)
    check_copy(src, args.target, slot=args.slot, ref=args.ref, pins=args.pin or ())  # before DST is created
    dst = ss.open_store(args.dst, create=True)
    with bar(args, "copy") as progress:
        result = copy_commit(
            src,
            dst,
            args.target,
            slot=args.slot,
            ref=args.ref,
            pins=args.pin,
            threads=args.threads,
            progress=progress.update,
            with_deps=args.with_deps,
        )
    _print_copy(args, result)
    return Exit.OK


def _print_copy(args: argparse.Namespace, r: CopyResult) -> None:
    doc = {
        "commit": r.commit,
        "src": args.src,
        "dst": args.dst,
        "slot": r.slot,
        "ref": r.ref,
        "objects_copied": r.objects_copied,
        "bytes_copied": r.bytes_copied,
        "objects_skipped": r.objects_skipped,
        "bytes_skipped": r.bytes_skipped,
        "pins": r.pins,
        "dependencies": r.dependencies,
    }
    emit(args, doc, render_copy)


def cmd_gc(args: argparse.Namespace) -> int:
    if getattr(args, "break_marker", None) is not None:
        return _break_marker(args)
    if args.grace == 0 and not args.dry_run and not args.quiet:
        note(
            "shardstore gc: warning: --grace 0 can delete the objects of a save in progress (written, not yet "
            "named by a ref); use it only when no writer is running on this store"
        )
    store = ss.open_store(args.store, create=False)
    with bar(args, "gc", unit=" objects") as progress:  # unreachable objects examined, then deleted
        result = gc(store, grace_seconds=args.grace, dry_run=args.dry_run, progress=progress.update)
    _print_gc(args, result)
    return Exit.OK


def _break_marker(args: argparse.Namespace) -> int:
    """``gc --break-marker NONCE``: remove a gc marker whose gc is gone (SPEC.md §19.2), never a running one's."""
    from shardstore.store.gc_fence import break_gc_marker

    if args.dry_run:
        _usage(args, "--break-marker removes one marker and collects nothing: it takes no --dry-run")
    info = break_gc_marker(ss.open_store(args.store, create=False), args.break_marker)
    doc = marker_doc(info) | {"removed": True}
    emit(args, doc, lambda d: f"removed gc marker {d['description']}")
    return Exit.OK


def cmd_unpin(args: argparse.Namespace) -> int:
    store = ss.open_store(args.store, create=False)
    held = store.pinned(args.name)
    store.unpin(args.name)
    emit(args, {"unpinned": args.name, "objects": len(held or ())}, render_unpin)
    return Exit.OK


def _print_gc(args: argparse.Namespace, r: GcResult) -> None:
    doc = {
        "store": args.store,
        "dry_run": r.dry_run,
        "grace_seconds": r.grace_seconds,
        "reachable_commits": r.commits,
        "reachable_objects": r.reachable_objects,
        "pinned_objects": r.pinned_objects,
        "deleted": [{"object": oid, "bytes": n} for oid, n in sorted(r.deleted.items())],
        "bytes_freed": r.bytes_freed,
        "kept_young": r.kept_young,
        "kept_named_by_young": r.kept_named_by_young,
        "tmp_deleted": r.tmp_deleted,
        "intents_dropped": r.intents_dropped,
    }
    emit(args, doc, render_gc)
