"""References to the specification's sections resolve (issue 35, item 6).

SPEC.md is the store format; shardtrain's records and rules are docs/SHARDTRAIN-FORMATS.md; the
test inventory is docs/TESTED.md. Code, tests and documents cite their sections as ``§5.1`` or
``SPEC.md §5.1`` (numbered) or ``SPEC.md §Chunked payloads`` (by heading). Here: every such
reference in the packages, the CLI, the tests, the benchmarks, the tools, README.md and docs/
names a heading of the document it names, and none still uses the numbering before issue 35,
which ``tools/spec_refs.py`` rewrites (it is tested here too: its table lands on headings that
exist, and a second run changes nothing).
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPEC, FORMATS, TESTED = "SPEC.md", "docs/SHARDTRAIN-FORMATS.md", "docs/TESTED.md"
#: What is scanned: the packages, the CLI, tests, benchmarks, tools and the documents.
SCANNED = ("shardstore", "shardtrain", "cli", "tests", "benchmarks", "tools", "docs", "README.md", "SPEC.md")
_TEXT = {".py", ".md", ".txt", ".toml"}
#: The rewriting table and this test's examples of it hold old references by design, and say so
#: with the marker that makes the script leave them alone (spec_refs: keep).
_OLD_BY_DESIGN = ("tools/spec_refs.py", "tests/test_spec_refs.py")

_HEADING = re.compile(r"^#{1,6} +(?:(?P<num>\d+(?:\.\d+)*)\.? +)?(?P<title>.+?) *$", re.M)
_REF = re.compile(
    r"(?:(?P<doc>SPEC(?:\.md)?|README(?:\.md)?|docs/[A-Z-]+\.md)\s+)?"
    r"§(?P<ref>\d+(?:\.\d+)*[a-z]?|[A-Z][A-Za-z0-9-]*(?:\s+[a-z][a-z0-9-]*)*)"
)


def _tool():
    spec = importlib.util.spec_from_file_location("spec_refs", REPO / "tools" / "spec_refs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _headings(doc: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """A document's section numbers and its headings' titles (numbers removed)."""
    text = (REPO / doc).read_text()
    found = list(_HEADING.finditer(text))
    return frozenset(m["num"] for m in found if m["num"]), tuple(m["title"] for m in found)


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9][A-Za-z0-9'-]*", text)


def _named(ref: str, titles: tuple[str, ...]) -> bool:
    """Whether ``ref`` (a heading's words, perhaps followed by prose) names one of ``titles``:
    its words begin a title (``§Block exchange`` for "Block exchange (sharded tensors)"), or it
    begins with a whole title up to the title's first punctuation (``§Transitions states...``
    for "Transitions: repartition and grow")."""
    words = ref.split()
    for title in titles:
        whole = _words(title)
        core = _words(re.split(r"[:(,;`]", title)[0])
        if whole[: len(words)] == words or (core and words[: len(core)] == core):
            return True
    return False


def _document(name: str | None, here: str) -> str:
    if name is None:  # a bare reference is to the document it stands in, if numbered, else to SPEC.md
        return here if here in (SPEC, FORMATS) else SPEC
    if name.startswith("README"):
        return "README.md"
    return SPEC if name.startswith("SPEC") else name


def _files() -> list[Path]:
    out: list[Path] = []
    for name in SCANNED:
        p = REPO / name
        out += (
            [p]
            if p.is_file()
            else sorted(f for f in p.rglob("*") if f.suffix in _TEXT and "__pycache__" not in f.parts)
        )
    return out


def _references() -> list[tuple[str, int, str, str]]:
    """(file, line, document, reference) of every section reference in the scanned files."""
    out = []
    for f in _files():
        here = f.relative_to(REPO).as_posix()
        if here in _OLD_BY_DESIGN:
            continue
        text = f.read_text()
        for m in _REF.finditer(text):
            ref = re.sub(r"\s+", " ", m["ref"])
            out.append((here, text.count("\n", 0, m.start()) + 1, _document(m["doc"], here), ref))
    return out


def test_every_section_reference_names_a_heading_of_its_document():
    refs = _references()
    assert len(refs) > 500  # the scan reads what it should
    bad = []
    for here, line, doc, ref in refs:
        if not (REPO / doc).is_file():
            bad.append(f"{here}:{line}: {doc} §{ref}: no such document")
            continue
        numbers, titles = _headings(doc)
        ok = ref in numbers if ref[0].isdigit() else _named(ref, titles)
        if not ok:
            bad.append(f"{here}:{line}: {doc} §{ref}")
    assert not bad, "references to no heading:\n" + "\n".join(bad)


def test_no_reference_uses_the_numbering_before_issue_35():
    """What ``python tools/spec_refs.py --check`` reports: nothing (a branch written against the
    old numbering fails here until the script has been run over it)."""
    tool = _tool()
    stale = []
    for f in _files():
        here = f.relative_to(REPO).as_posix()
        if here not in _OLD_BY_DESIGN and tool.rewrite(f.read_text(), here) != f.read_text():
            stale.append(here)
    assert not stale, f"run python tools/spec_refs.py over {stale}"


def test_the_rewriting_table_lands_on_headings_that_exist():
    tool = _tool()
    assert all(tool.KEEP in (REPO / f).read_text() for f in _OLD_BY_DESIGN)
    spec_numbers, _ = _headings(SPEC)
    assert set(tool.RENUMBERED.values()) <= spec_numbers
    for doc, section in list(tool.MOVED.values()) + list(tool.NAMED.values()):
        assert (REPO / doc).is_file() and (section is None or section in _headings(doc)[0]), (doc, section)
    # every old lettered section is in the table, and no number that kept its meaning is
    assert {"5a", "9a", "9b", "9c", "9d", "9e", "9f", "14a", "14b", "14c", "14d", "15a", "15b", "15c", "15d",
            "15e", "15f", "16a", "19a", "19b", "19c", "25"} == set(tool.RENUMBERED) | set(tool.MOVED)  # fmt: skip


@pytest.mark.parametrize(
    "here, old, new",
    [
        ("shardstore/x.py", "(SPEC.md §9e, §9f)", "(SPEC.md §9.5, §9.6)"),
        ("shardstore/x.py", "SPEC §5a-§5a", "SPEC §5.1-§5.1"),
        ("README.md", "bounds (SPEC.md\n§14c), or", "bounds (docs/SHARDTRAIN-FORMATS.md\n§2), or"),
        (
            "SPEC.md",
            "(§15f's labels; §25, rows 10-13)",
            "(docs/SHARDTRAIN-FORMATS.md §5's labels; docs/TESTED.md, rows 10-13)",
        ),
        (
            "docs/SHARDTRAIN-FORMATS.md",
            "as §14a says, and §14c's bounds; SPEC.md §19b",
            "as SPEC.md §14.1 says, and §2's bounds; SPEC.md §19.2",
        ),
        (
            "shardtrain/x.py",
            "(SPEC.md §Numerical profiles), SPEC §Journal",
            "(docs/SHARDTRAIN-FORMATS.md §5), SPEC.md §19.2",
        ),
        ("tests/x.py", "README §Roles; §9.5 and §8.3 stay", "README §Distillation; §9.5 and §8.3 stay"),
    ],
)
def test_the_script_rewrites_old_references_once(here, old, new):
    tool = _tool()
    assert tool.rewrite(old, here) == new
    assert tool.rewrite(new, here) == new  # idempotent: a second run changes nothing
