"""Rewrite references to SPEC.md's sections from their numbering before issue 35 to today's.

Issue 35 (item 6) split SPEC.md: the lettered insert sections became numbered subsections
(section 9e is now 9.5), shardtrain's records and profiles moved to
``docs/SHARDTRAIN-FORMATS.md`` and the test inventory (section 25) to ``docs/TESTED.md``. Every
numbered section without a letter kept its number. This script rewrites what a branch written
against the old numbering still says, from the explicit table below, in code comments,
docstrings, error messages and documents alike:

    python tools/spec_refs.py PATH...          rewrite in place; print each file changed
    python tools/spec_refs.py --check PATH...  write nothing; print each stale reference, exit 1 if any

A PATH may be a file or a directory (walked for text files, skipping ``.git``, caches and build
output). A file holding the marker ``spec_refs: keep`` (this script, and the test of it, whose
examples are old references by design) is left as it is. It is idempotent: nothing it writes is a key of the table (the old keys
are lettered sections, section 25 and four names no section has), so a second run changes
nothing, and it can be run over a tree that mixes old and new references.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

SPEC = "SPEC.md"
FORMATS = "docs/SHARDTRAIN-FORMATS.md"
TESTED = "docs/TESTED.md"

#: Old section of SPEC.md -> its new number in SPEC.md.
RENUMBERED = {
    "5a": "5.1",
    "9a": "9.1",
    "9b": "9.2",
    "9c": "9.3",
    "9d": "9.4",
    "9e": "9.5",
    "9f": "9.6",
    "14a": "14.1",
    "15a": "15.1",
    "15b": "15.2",
    "15c": "15.3",
    "15d": "15.4",
    "15e": "15.5",
    "16a": "16.1",
    "19a": "19.1",
    "19b": "19.2",
    "19c": "19.3",
}
#: Old section of SPEC.md -> (the document it moved to, its section there, or None for the whole document).
MOVED = {
    "14b": (FORMATS, "1"),
    "14c": (FORMATS, "2"),
    "14d": (FORMATS, "3"),
    "15f": (FORMATS, "5"),
    "25": (TESTED, None),
}
#: Section names that never were (or no longer are) SPEC.md headings -> (document, section).
NAMED = {
    "Export": (SPEC, "19.2"),  # export's rules: exclusive temporaries, a whole export or none
    "Journal": (SPEC, "19.2"),  # "the journal is advisory"
    "Commit protocol": (SPEC, "15"),
    "Numerical profiles": (FORMATS, "5"),
}

_DOC = r"(?P<doc>SPEC(?:\.md)?(?P<ws>\s+))?"
_OLD = re.compile(_DOC + r"§(?P<sec>\d+[a-f]|25)(?![0-9A-Za-z])")
_NAME = re.compile(_DOC + r"§(?P<name>" + "|".join(map(re.escape, NAMED)) + r")\b")
_README = re.compile(
    r"(?P<doc>README(?:\.md)?\s+)§Roles\b"
)  # README's section is "Distillation, evaluation roles and gates"
_TEXT = {".py", ".md", ".txt", ".toml", ".rst", ".cfg", ".ini", ".yaml", ".yml", ".sh"}
_SKIP = {".git", "__pycache__", ".venv", "build", "dist", ".pytest_cache", ".ruff_cache", ".hypothesis"}
#: A file holding this text is never rewritten (spec_refs: keep — this file's table holds the old keys).
KEEP = "spec_refs: keep"


def _ref(doc: str, section: str | None, here: str, ws: str) -> str:
    """The reference to ``section`` of ``doc`` as written in file ``here`` (a path relative to the repository)."""
    if doc == here:
        return f"§{section}" if section else doc
    return f"{doc}{ws or ' '}§{section}" if section else doc


def rewrite(text: str, here: str = "") -> str:
    """``text`` (the contents of file ``here``, relative to the repository root) with every old
    reference to SPEC.md replaced by the new one. A section named without a document is SPEC.md's,
    except inside docs/SHARDTRAIN-FORMATS.md, whose bare references are its own sections: there a
    reference to SPEC.md gains its name."""

    def old(m: re.Match[str]) -> str:
        ws = m["ws"] or ""
        if m["sec"] in RENUMBERED:
            if m["doc"] or here != FORMATS:
                return f"{m['doc'] or ''}§{RENUMBERED[m['sec']]}"
            return f"{SPEC} §{RENUMBERED[m['sec']]}"
        doc, section = MOVED[m["sec"]]
        return _ref(doc, section, here, ws)

    def named(m: re.Match[str]) -> str:
        doc, section = NAMED[m["name"]]
        return _ref(doc, section, here, m["ws"] or "")

    text = _OLD.sub(old, text)
    text = _NAME.sub(named, text)
    return _README.sub(lambda m: f"{m['doc']}§Distillation", text)


def _files(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(
                f
                for f in p.rglob("*")
                if f.is_file() and f.suffix in _TEXT and not _SKIP & set(f.parts) and ".egg-info" not in str(f)
            )
        elif p.is_file():
            out.append(p)
    return out


def _relative(path: Path) -> str:
    """``path`` relative to the repository root (the directory holding SPEC.md above it), as POSIX text."""
    resolved = path.resolve()
    for parent in resolved.parents:
        if (parent / SPEC).is_file():
            return resolved.relative_to(parent).as_posix()
    return path.as_posix()


def main(argv: list[str]) -> int:
    check = argv[:1] == ["--check"]
    paths = argv[1:] if check else argv
    if not paths:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    stale = 0
    for f in _files(paths):
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if KEEP in text:
            continue
        new = rewrite(text, _relative(f))
        if new == text:
            continue
        if check:
            for n, (a, b) in enumerate(zip(text.splitlines(), new.splitlines()), 1):
                if a != b:
                    stale += 1
                    print(f"{f}:{n}: {a.strip()[:160]}")
        else:
            f.write_text(new, encoding="utf-8")
            print(f)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
