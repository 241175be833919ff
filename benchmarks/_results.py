"""Writing a benchmark's tables into RESULTS.md: each script owns the block between its
``<!-- name:begin -->`` and ``<!-- name:end -->`` markers and rewrites only that."""

from __future__ import annotations

import os

__all__ = ["write_block"]


def write_block(path: str, begin: str, end: str, section: str, text: str) -> None:
    """Put ``text`` between ``begin`` and ``end`` in ``path``, replacing an older block, or
    put it first under ``section`` (appended with it if the file has none)."""
    block = f"{begin}\n{text}\n{end}"
    old = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + block + old[old.index(end) + len(end) :]
    elif section in old:  # the section's first block, above its earlier runs
        i = old.index(section) + len(section)
        new = old[:i] + "\n\n" + block + old[i:]
    else:
        new = old.rstrip("\n") + f"\n\n{section}\n\n{block}\n"
    with open(path, "w") as f:
        f.write(new)
