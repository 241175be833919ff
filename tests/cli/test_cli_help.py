"""The command lines' help, progress bars and one-line log (issue 25, command line).

- every subcommand's ``--help`` lists its options, each with text, with its default where it
  has one, and the exit-code table (``gc --help`` had none; ``shardtrain evaluate --help`` had
  no text for --store, --cases, --max-new-tokens, --timeout, and no defaults were shown);
- a progress bar is drawn on a terminal and left in place (it appeared after 1 s and was
  erased, so a fast run never showed one), never when piped or with ``--quiet``;
- ``log --oneline``: short ids, step, kind, and the journal's time and loss.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import uuid
from typing import Any

import pytest
import torch

import shardstore as ss


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("cli", ["shardstore", "shardtrain"])
def test_every_subcommand_help_lists_options_with_text_defaults_and_exit_codes(cli: str) -> None:
    if cli == "shardstore":
        from shardstore_cli.shardstore_cli import build_parser
    else:
        from shardstore_cli.shardtrain_cli import build_parser
    subs = _subparsers(build_parser())
    assert (
        {"gc", "copy", "unpin", "verify", "log"} <= set(subs)
        if cli == "shardstore"
        else {"evaluate", "grow"} <= set(subs)
    )
    for name, p in subs.items():
        text = p.format_help()
        assert "exit codes:" in text and "  4  " in text, f"{cli} {name} --help has no exit codes"
        formatter = p._get_formatter()
        for a in p._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            assert a.help, f"{cli} {name} {a.option_strings[0]} has no help text"
            if a.default not in (None, False, []) and a.default is not argparse.SUPPRESS:
                assert "default" in formatter._get_help_string(a), (
                    f"{cli} {name} {a.option_strings[0]}: default {a.default!r} not shown"
                )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _small_store(tmp_path: Any) -> ss.Store:
    store = ss.open_store(str(tmp_path / f"s{uuid.uuid4().hex[:6]}"))
    ss.save(store, {"w": torch.arange(1000, dtype=torch.float32)}, step=1, rng=False)
    ss.save(store, {"w": torch.ones(1000)}, step=2, rng=False)
    return store


@pytest.mark.parametrize("argv, bar", [(["verify"], "verify:"), (["gc", "--grace", "1h"], "gc:")])
def test_a_progress_bar_is_visible_on_a_terminal_and_absent_when_piped_or_quiet(
    tmp_path: Any, monkeypatch: Any, argv: list[str], bar: str
) -> None:
    from shardstore_cli.shardstore_cli import main

    store = _small_store(tmp_path)
    for extra, tty, shown in (([], True, True), (["--quiet"], True, False), ([], False, False)):
        err = _Terminal() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        assert main([argv[0], store.url, *argv[1:], *extra]) == 0
        assert (bar in err.getvalue()) == shown, (extra, tty, err.getvalue())
        if shown:  # left in place: the last thing written is the finished bar, not an erased line
            assert err.getvalue().rstrip().splitlines()[-1].lstrip("\r").startswith(bar)


def test_log_oneline_shows_short_ids_step_kind_and_the_journals_time(tmp_path: Any, capsys: Any) -> None:
    from shardstore_cli.shardstore_cli import main

    store = _small_store(tmp_path)
    head = store.ref("main")
    note = f"journal/{store.commit(head).parent}.json"  # replaced by a trainer's note (shardtrain's carry the loss)
    store.storage.delete(note)
    store.storage.write_once(note, b'{"loss": 1.25, "time": 0}')
    assert main(["log", store.url, "--oneline"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(len(line) < 80 for line in lines)
    assert re.fullmatch(rf"{head[:12]}  step +2  train +  20\d\d-\d\d-\d\d \d\d:\d\d:\d\d", lines[0]), lines[0]
    assert lines[1].endswith("step      1  train        1970-01-01 00:00:00  loss 1.2500"), lines[1]
