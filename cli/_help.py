"""The help formatter both command lines use: every option's default in its help, epilogs kept as written.

argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: X)`` to every option, flags
and options without a default included (``(default: None)``, ``(default: False)``); this one
appends it only where there is a default to tell and the help text does not already state
it, and keeps the epilog's layout (the exit-code table) as ``RawDescriptionHelpFormatter`` does.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["HelpFormatter"]


#: Help text that already states its default: "(default 2)", "default: the job's", "(default: 5GB)".
_STATES_DEFAULT = re.compile(r"\bdefault[: ]")


class HelpFormatter(argparse.HelpFormatter):
    """Names each option's default (unless None, False or already stated); text of several lines
    (an epilog's exit-code table) is kept as written, one-line text is wrapped as usual."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is False
            or default is argparse.SUPPRESS
            or default == []
            or _STATES_DEFAULT.search(text)
            or not action.option_strings
        ):
            return text
        if isinstance(default, float) and default.is_integer():
            default = int(default)
        return f"{text} (default: {default})" if text else f"(default: {default})"
