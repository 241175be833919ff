"""The one exit-code table of both command lines (``cli/exit_codes.py``, SPEC.md §23; issue 35).

Before, the mapping existed three times and the tools disagreed: 3 was "verify found
problems" for shardstore and "run aborted" for shardtrain, 4 "target not found" for one and
"refused" for the other. Here: each class the table names exists and exits with its row's
code through each tool's ``main``; each tool's ``--help`` prints exactly its rows; SPEC.md
§23 and README.md's table say what the table says; and every "exit N" in README.md's,
SPEC.md's and docs/'s prose sits beside a word of row N's meaning (so "refused (exit 4)" cannot survive
a renumbering).
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from shardstore_cli.exit_codes import SHARDSTORE, SHARDTRAIN, TABLE, Exit, code_of, epilog

REPO = Path(__file__).resolve().parents[1]
SPEC = (REPO / "SPEC.md").read_text()
README = (REPO / "README.md").read_text()
ROWS = {int(r.code): r for r in TABLE}


def _class(name: str) -> type:
    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)


def test_one_row_per_code_and_every_named_class_exists() -> None:
    assert [int(r.code) for r in TABLE] == sorted(ROWS) == sorted(int(c) for c in Exit)
    named = [e for r in TABLE for e in r.errors]
    assert len(named) == len(set(named))
    for name in named:  # a misspelt name would never match: code_of would skip it silently
        assert issubclass(_class(name), BaseException), name
    for r in TABLE:
        assert set(r.detail) <= {SHARDSTORE, SHARDTRAIN} and r.detail, r.code
        assert all(r.detail.values()), r.code


@pytest.mark.parametrize("row", [r for r in TABLE if r.errors], ids=lambda r: r.code.name)
def test_each_named_class_maps_to_its_row(row: Any) -> None:
    for name in row.errors:
        cls = _class(name)
        sub = type(f"Sub{cls.__name__}", (cls,), {})  # a subclass: the row names a family
        error = sub.__new__(sub)
        assert code_of(error) == row.code, name


def test_specific_rows_win_over_the_catch_all() -> None:
    from shardstore.errors import ManifestError, ObjectTooLarge, ShardstoreError, TargetNotFound
    from shardtrain.errors import NonFiniteStep, RunAborted, ShardtrainError

    assert code_of(ObjectTooLarge("x")) == Exit.REFUSED  # a ManifestError, itself a ShardstoreError (row 1)
    assert code_of(ManifestError("x")) == Exit.ERROR
    assert code_of(TargetNotFound("x")) == Exit.NOT_FOUND
    assert code_of(RunAborted("x")) == Exit.ABORTED
    assert code_of(NonFiniteStep("x")) == Exit.ERROR  # the run turns it into RunAborted
    assert code_of(ShardstoreError("x")) == code_of(ShardtrainError("x")) == Exit.ERROR
    assert code_of(RuntimeError("a bug")) is None  # not in the table: raised with its traceback


def _raiser(error: BaseException) -> Any:
    def func(args: argparse.Namespace) -> int:
        raise error

    return func


@pytest.mark.parametrize("tool", [SHARDSTORE, SHARDTRAIN])
def test_main_exits_with_the_code_of_each_row_its_tool_uses(
    tool: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    if tool == SHARDSTORE:
        import shardstore_cli.shardstore_cli as cli

        handler, argv = "cmd_refs", ["refs", str(tmp_path)]
    else:
        import shardstore_cli.shardtrain_cli as cli  # type: ignore[no-redef]

        handler, argv = "cmd_select", ["select", "--store", str(tmp_path), "--commit", "main"]
    for row in TABLE:
        if tool not in row.detail:
            continue
        for name in row.errors:
            cls = _class(name)
            if name.startswith("shardstore_cli._commands:UsageError"):
                error: BaseException = cls("bad", cli.build_parser())
            else:
                error = cls("what went wrong")
            monkeypatch.setattr(cli, handler, _raiser(error))
            assert cli.main(argv) == row.code, name
            err = capsys.readouterr().err
            if row.code not in (Exit.INTERRUPTED, Exit.USAGE):
                assert err == f"{tool}: error: {cls.__name__}: what went wrong\n", (name, err)
    monkeypatch.setattr(cli, handler, _raiser(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(argv)


def _help_rows(text: str) -> dict[int, str]:
    """The exit-code block of a help text: code -> its text, wrapped lines joined."""
    block = text.split("exit codes:\n", 1)[1]
    rows: dict[int, str] = {}
    last = None
    for line in block.splitlines():
        m = re.match(r"  (\d+) +(.*)", line)
        if m:
            last = int(m.group(1))
            rows[last] = m.group(2)
        elif line.startswith("      ") and last is not None:
            rows[last] += " " + line.strip()
        else:
            break
    return rows


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("tool", [SHARDSTORE, SHARDTRAIN])
def test_every_help_prints_exactly_its_tools_rows(tool: str) -> None:
    if tool == SHARDSTORE:
        from shardstore_cli.shardstore_cli import build_parser
    else:
        from shardstore_cli.shardtrain_cli import build_parser
    want = {int(r.code): f"{r.meaning} — {r.detail[tool]}" for r in TABLE if tool in r.detail}
    parser = build_parser()
    assert epilog(tool) in parser.format_help()
    for name, sub in {"": parser, **_subparsers(parser)}.items():
        assert _help_rows(sub.format_help()) == want, f"{tool} {name} --help"
    assert (Exit.ABORTED in want) == (tool == SHARDTRAIN)


def _section(text: str, title: str) -> str:
    start = text.index(title)
    return text[start : text.index("\n## ", start + 1)]


def _markdown_rows(section: str) -> list[list[str]]:
    lines = [line for line in section.splitlines() if re.match(r"\| *\d+ *\|", line)]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def test_spec_section_23_is_the_table() -> None:
    got = _markdown_rows(_section(SPEC, "## 23. Exit codes"))  # the section kept its number (issue 35)
    assert [int(r[0]) for r in got] == sorted(ROWS)
    for code, meaning, store, train, classes in got:
        row = ROWS[int(code)]
        assert meaning == row.meaning, code
        assert store == row.detail.get(SHARDSTORE, "—"), code
        assert train == row.detail.get(SHARDTRAIN, "—"), code
        assert re.findall(r"`(\w+)`", classes) == [e.split(":")[1] for e in row.errors], code


def test_readme_table_is_the_table() -> None:
    got = _markdown_rows(README[README.index("one exit-code table") :])
    assert {int(c): m for c, m in got} == {c: r.meaning for c, r in ROWS.items()}


#: Words one of which a sentence giving exit code N uses: the row's meaning in the prose's words.
_WORDS = {
    0: ("succe", "clean", "passes", "ok"),
    1: ("error",),
    2: ("usage", "argument"),
    3: ("problem", "gate"),
    4: ("not found", "no such"),
    5: ("refus",),
    6: ("abort",),
}


@pytest.mark.parametrize(
    "doc, least", [("README.md", 4), ("SPEC.md", 4), ("docs/SHARDTRAIN-FORMATS.md", 3), ("docs/TESTED.md", 4)]
)
def test_every_exit_code_in_the_prose_is_next_to_its_meaning(doc: str, least: int) -> None:
    text = re.sub(r"\s+", " ", (REPO / doc).read_text())
    found = list(re.finditer(r"\bexit(?:s| with| code)? (\d+)\b", text, re.I))
    assert len(found) >= least, doc  # the check reads something
    for m in found:
        code, window = int(m.group(1)), text[max(0, m.start() - 160) : m.end() + 60].lower()
        assert code in ROWS, (doc, window)
        assert any(w in window for w in _WORDS[code]), f"{doc}: exit {code} in ...{window}..."
