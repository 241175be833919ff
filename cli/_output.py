"""The one output path of both command lines: results on stdout, errors on stderr.

Every command builds one JSON-able document of its result. `emit` prints it: as one JSON
document with ``--json`` (the same encoding for every command of both tools), else as the
text its render function makes of that same document, so the two outputs never disagree.
`fail` reports an error the same way (a JSON document or one line, on stderr) and returns
its exit code from the one table (``exit_codes``). Progress bars (`bar`) and diagnostics
(`note`) go to stderr and never with ``--json``'s document on stdout; `diagnostics` turns the
library's typed warnings (a ref move waiting for a gc, ``GcWait``) into such notes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm

from shardstore.store.gc_fence import GcWait

from ._render import jsonable
from .exit_codes import Exit, code_of

__all__ = ["emit", "fail", "note", "bar", "diagnostics"]


def emit(args: argparse.Namespace, doc: Any, render: Callable[[Any], str]) -> None:
    """Print a command's document: as JSON with --json, else as text for people (nothing if empty).

    `render` gets the document in its JSON form (plain dicts, lists and numbers), the very
    values ``--json`` prints, except that a NaN or infinity stays a float.
    """
    if getattr(args, "json", False):
        print(json.dumps(jsonable(doc), indent=2))
    else:
        text = render(jsonable(doc, keep_nonfinite=True))
        if text:
            print(text)


def fail(prog: str, args: argparse.Namespace | None, error: BaseException) -> Exit:
    """Report `error` on stderr (a JSON document with --json, else ``PROG: error: Kind: message``); return
    its exit code (``exit_codes.TABLE``). An error no row names is a bug: it is raised again, with its traceback."""
    code = code_of(error)
    if code is None:
        raise error
    if code == Exit.INTERRUPTED:
        return code
    kind = type(error).__name__
    if args is not None and getattr(args, "json", False):
        print(json.dumps({"error": {"kind": kind, "message": str(error), "exit": code}}), file=sys.stderr)
    else:
        print(f"{prog}: error: {kind}: {error}", file=sys.stderr)
    return code


def note(message: str) -> None:
    """A diagnostic line for people, on stderr."""
    print(message, file=sys.stderr)


@contextlib.contextmanager
def diagnostics(prog: str, *, quiet: bool = False) -> Iterator[None]:
    """Within: each ``GcWait`` the library warns (a ref move or pin change waiting for a gc,
    SPEC.md §19.2) is one ``PROG: note: ...`` line on stderr (none with ``--quiet``); other
    warnings show as Python shows them."""
    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        warnings.simplefilter("always", GcWait)
        shown = warnings.showwarning

        def show(message: Any, category: type[Warning], *rest: Any, **kw: Any) -> None:
            if not issubclass(category, GcWait):
                shown(message, category, *rest, **kw)
            elif not quiet:
                note(f"{prog}: note: {message}")

        warnings.showwarning = show
        yield


def bar(args: argparse.Namespace, desc: str, *, unit: str = "B", total: int | None = None) -> tqdm:
    """A progress bar on stderr, only on a terminal and without --quiet: drawn at once and left in place
    at the end (a bar that waits a second and erases itself is never seen on a fast run). Bytes (the
    default unit) are scaled by 1024."""
    disable = bool(getattr(args, "quiet", False)) or not sys.stderr.isatty()
    scale: dict[str, Any] = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, file=sys.stderr, leave=True, **scale)
