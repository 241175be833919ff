"""The ``shardstore`` command line: verify, diff, log, show, cat, refs, export, import.

Modelled on git and restic: one subcommand per task, a store given as a local path or an
fsspec URL, targets given as a ref name, a full commit id or a unique id prefix (>= 8 hex
digits), ``--json`` on every command for scripts, data on stdout, diagnostics and
progress bars (tqdm, only on a terminal, never with ``--quiet``) on stderr, and the
exit-code table both command lines share (``exit_codes``, SPEC.md §Exit codes). Each subcommand's handler is
``args.func(args) -> int``; ``shardstore_cli.store_commands.register(subparsers)``, when that module
exists, adds more subcommands (copy, gc, unpin) the same way.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import shardstore as ss

from ._commands import (
    UsageError,
    add_slot_option,
    add_storage_option,
    apply_storage_options,
    cmd_cat,
    cmd_diff,
    cmd_export,
    cmd_import,
    cmd_log,
    cmd_refs,
    cmd_show,
    cmd_verify,
    parse_layout,
    parse_size,
)
from ._help import HelpFormatter
from ._output import diagnostics, fail, note
from .exit_codes import SHARDSTORE, Exit, epilog

__all__ = ["EPILOG", "build_parser", "main"]

_TARGETS = (
    "targets: a ref name (main), a full commit id, or a unique id prefix of at least 8 hex digits, each\n"
    "optionally followed by git's ancestry suffixes: main~1 or main^ (the parent), main~2, <commit>^.\n"
)
EPILOG = _TARGETS + "\n" + epilog(SHARDSTORE)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that reports usage errors to ``main`` instead of exiting itself."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self)


# -- parser ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with every subcommand (and those of ``shardstore_cli.store_commands`` if present)."""
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout, for scripts")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars or notes on stderr")
    add_storage_option(common)
    parser = _Parser(
        prog="shardstore",
        description="Inspect, verify and move checkpoints in a shardstore store (a local path or an fsspec URL).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardstore {ss.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, parents=[common], help=help, description=help, epilog=EPILOG, formatter_class=HelpFormatter
        )
        p.set_defaults(func=func, parser=p)
        p.add_argument("store", metavar="STORE", help="store path or fsspec URL")
        return p

    p = add("verify", cmd_verify, "check commits and every object they reach; report every problem")
    p.add_argument(
        "targets",
        nargs="*",
        metavar="TARGET",
        help="commits to check (default: everything reachable from refs and pins)",
    )
    p.add_argument("--quick", action="store_true", help="check structure and object sizes only; do not re-hash")
    add_slot_option(p, "check only the objects of slot K")
    p = add("diff", cmd_diff, "what changed from commit A to commit B")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument(
        "--stats", action="store_true", help="max |diff| and relative L2 change of each changed parameter and moment"
    )
    p.add_argument("--all", action="store_true", help="also list unchanged tensors by name (--json always does)")
    p = add("log", cmd_log, "the parent chain of a commit: id, step, kind, learned-state root")
    p.add_argument("target", nargs="?", metavar="TARGET", help="default: ref main (or the only ref)")
    p.add_argument("-n", "--max-count", type=int, metavar="N", help="show at most N commits (default: the whole chain)")
    p.add_argument(
        "--oneline",
        action="store_true",
        help="one short line per commit: id, step, kind, and the journal's time and loss",
    )
    p = add("show", cmd_show, "a commit's fields and its layout (slot, tensors, parameters, bytes)")
    p.add_argument("target", metavar="TARGET")
    p = add("cat", cmd_cat, "print any manifest (or model config) decoded as JSON")
    p.add_argument("id", metavar="ID", help="object id, unique prefix, or ref name")
    p = add("refs", cmd_refs, "list refs and the commits they point at")
    p.add_argument(
        "--break-lock",
        metavar="NAME",
        help="remove ref NAME's lock file left by a writer that is gone (refused while a writer on this host holds it)",
    )
    p = add("export", cmd_export, "write a commit as a Hugging Face style safetensors directory")
    p.add_argument("target", metavar="TARGET")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--with-optimizer", action="store_true", help="also write the Adam moments and optimizer.json")
    p.add_argument(
        "--weights-only",
        action="store_true",
        help="export a commit that holds no model config: the safetensors files without config.json "
        "(refused otherwise, since transformers cannot load such a directory)",
    )
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=5 * 10**9,
        metavar="SIZE",
        help="split files above SIZE (default: 5GB)",
    )
    p.add_argument("--force", action="store_true", help="overwrite files already in OUT_DIR")
    p = add(
        "import", cmd_import, "commit a Hugging Face style Llama directory (weights and tokenizer files, kind 'import')"
    )
    p.add_argument("src_dir", metavar="SRC_DIR")
    p.add_argument("--ref", default="main", help="ref to move to the new commit (default: main)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--slots", type=int, metavar="N", help="split decoder layers evenly over N slots")
    group.add_argument(
        "--layout", type=parse_layout, metavar="RANGES", help="explicit layer ranges per slot, e.g. 0:2,2:4"
    )
    p.add_argument("--job", default="default", help="job id bound into the commit (default: default)")
    p.add_argument("--step", type=int, default=0, help="global step of the commit (default 0)")
    p.add_argument("--no-verify", action="store_true", help="do not re-read each stored object")
    p.add_argument(
        "--dtype", choices=("float32",), help="widen bfloat16/float16 weights to float32 (exact), one tensor at a time"
    )
    p.add_argument(
        "--no-assets",
        action="store_true",
        help="do not keep the directory's tokenizer files (kept by default, pinned as assets/<commit>)",
    )
    _register_plugins(sub)
    return parser


def _register_plugins(sub: Any) -> None:
    """Let ``cli/store_commands.py`` (copy, gc, unpin), when present, add its subcommands."""
    try:
        store_commands = importlib.import_module(f"{__package__}.store_commands")
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.store_commands":
            raise  # the module exists but is broken: say so
        return
    store_commands.register(sub)


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
            return Exit.USAGE
        for name in ("json", "quiet"):
            if not hasattr(args, name):  # a plugin subcommand without the common options
                setattr(args, name, False)
        apply_storage_options(args)
        with diagnostics(f"shardstore {args.command}", quiet=args.quiet):
            return int(args.func(args))
    except UsageError as e:
        e.parser.print_usage(sys.stderr)
        note(f"{e.parser.prog}: error: {e}")
        return Exit.USAGE
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else Exit.USAGE
    except BrokenPipeError:  # stdout closed early (| head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.OK
    except (Exception, KeyboardInterrupt) as e:  # the exit-code table decides; an error it does not name is raised
        return fail("shardstore", args, e)


if __name__ == "__main__":
    raise SystemExit(main())
