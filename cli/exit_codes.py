"""The exit codes of both command lines, ``shardstore`` and ``shardtrain``: one table, one meaning a code.

SPEC.md §23 prints this table, each ``--help`` prints the rows of its tool (`epilog`, built
from the table, so help and table cannot drift), and tests/cli/test_exit_codes.py checks that
README.md and SPEC.md say what the table says. A command returns `Exit.OK` or
`Exit.PROBLEMS` itself; an error it raises gets the code of the row whose classes it is an
instance of (`code_of`): the specific rows first, the catch-all row `Exit.ERROR` last.

Classes are named by module and name, not imported, so that reading the table imports
nothing: the ``shardstore`` command line never imports shardtrain (which imports torch). A
class whose module was never imported has no instances, so `code_of` skips it.
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["Exit", "Row", "TABLE", "code_of", "epilog"]

SHARDSTORE, SHARDTRAIN = "shardstore", "shardtrain"


class Exit(IntEnum):
    """An exit code of either command line; `TABLE` gives each its one meaning."""

    OK = 0
    ERROR = 1
    USAGE = 2
    PROBLEMS = 3
    NOT_FOUND = 4
    REFUSED = 5
    ABORTED = 6
    INTERRUPTED = 130


@dataclass(frozen=True)
class Row:
    """One exit code: its meaning, what it covers in each tool that can exit with it, and the error
    classes that exit with it."""

    code: Exit
    meaning: str
    detail: dict[str, str]  # tool -> what the code covers there; only these tools exit with it
    errors: tuple[str, ...] = ()  # "module:Class"; an instance of any of them exits with `code`


TABLE: tuple[Row, ...] = (
    Row(Exit.OK, "success", {SHARDSTORE: "verify found no problems", SHARDTRAIN: "gate: every gate passed"}),
    Row(
        Exit.ERROR,
        "any other error",
        {
            SHARDSTORE: "I/O, a store that is damaged or malformed outside verify, a lost compare-and-swap",
            SHARDTRAIN: "I/O, a damaged store, a worker that failed, a grow or demo whose own check failed",
        },
        (
            "shardstore.errors:ShardstoreError",
            "shardtrain.errors:ShardtrainError",
            "builtins:OSError",
            "builtins:ValueError",
        ),
    ),
    Row(
        Exit.USAGE,
        "usage error",
        {
            SHARDSTORE: "bad arguments, a value out of range such as a negative slot, or a bad storage option "
            "(an unknown name, a wrong type or value, key without secret: from --storage-option, "
            "SHARDSTORE_STORAGE_OPTIONS or the store URL's query)",
            SHARDTRAIN: "bad arguments, or a bad storage option",
        },
        ("shardstore_cli._commands:UsageError", "shardstore.errors:StorageOptionError"),
    ),
    Row(
        Exit.PROBLEMS,
        "the check ran and found problems",
        {
            SHARDSTORE: "verify: each problem is listed with its object, tensor and commit",
            SHARDTRAIN: "gate: a gate failed; the table and the stored report say which",
        },
    ),
    Row(
        Exit.NOT_FOUND,
        "not found",
        {
            SHARDSTORE: "no such ref, commit id, unique id prefix, slot or pin, or a prefix naming several",
            SHARDTRAIN: "no such ref, commit id or unique id prefix, or a prefix naming several",
        },
        ("shardstore.errors:TargetNotFound", "shardstore.errors:RefNotFound"),
    ),
    Row(
        Exit.REFUSED,
        "refused before anything was written, the request not fitting what it names",
        {
            SHARDSTORE: "a value the format cannot hold, an object over its reader's limit",
            SHARDTRAIN: "a job, tokenizer asset, record or start commit that does not match: another job, "
            "schedule or model, or workers naming different commits; final sets without a matching selection, "
            "or a second selection after finals were opened; a regroup, grow or partition that cannot be "
            "made; a job or model value out of bounds; a worker's estimated memory over what it has free; a "
            "distillation reference too shallow to split; a manifest over its reader's limit",
        },
        (
            "shardtrain.errors:JobError",
            "shardtrain.errors:ResumeError",
            "shardtrain.errors:RoleError",
            "shardtrain.errors:AdmissionError",
            "shardtrain.errors:TransitionError",
            "shardtrain.errors:PartitionError",
            "shardtrain.errors:DistillError",
            "shardtrain.errors:ConfigError",
            "shardstore.errors:ObjectTooLarge",
            "shardstore.errors:StateMismatch",
            "shardstore.errors:UnsupportedOptimizer",
            "shardstore.errors:UnsupportedState",
        ),
    ),
    Row(
        Exit.ABORTED,
        "a run aborted before its last update",
        {
            SHARDTRAIN: "a worker was lost, or a step's loss or gradient norm was not finite; the message names "
            "the last committed step"
        },
        ("shardtrain.errors:RunAborted",),
    ),
    Row(Exit.INTERRUPTED, "interrupted", {SHARDSTORE: "Ctrl-C", SHARDTRAIN: "Ctrl-C"}, ("builtins:KeyboardInterrupt",)),
)


def _classes(row: Row) -> list[type]:
    out = []
    for name in row.errors:
        module, _, cls = name.partition(":")
        loaded = sys.modules.get(module)  # not imported: no error of its classes can exist
        if loaded is not None:
            out.append(getattr(loaded, cls))
    return out


def code_of(error: BaseException) -> Exit | None:
    """The exit code `TABLE` gives ``error``'s class, or None if no row names it (a bug: let it raise)."""
    for row in sorted(TABLE, key=lambda r: r.code == Exit.ERROR):  # the catch-all row last
        if any(isinstance(error, cls) for cls in _classes(row)):
            return row.code
    return None


def epilog(tool: str) -> str:
    """The exit-code rows of ``tool``, for its ``--help`` (kept as written by cli._help.HelpFormatter)."""
    lines = ["exit codes:"]
    for row in TABLE:
        if tool in row.detail:
            text = f"{row.meaning} — {row.detail[tool]}"
            lines += textwrap.wrap(
                text, width=100, initial_indent=f"  {row.code:<3} ", subsequent_indent=" " * 6, break_on_hyphens=False
            )
    return "\n".join(lines) + "\n"
