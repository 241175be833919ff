"""The checker against fixed bytes: small broken stores checked in with the exact output
``shardstore verify`` must give each (restic's testdata for its checker; issue 35, item 8).

``tests/data/broken/<version>-<case>.tar.gz`` is a store of format version 3 (written by the
row-band writer of commit 3066e75) or 4 (the tile grid), damaged one way: a flipped byte, a
missing object, a forged manifest, an orphan shard manifest, a ref to a missing commit
(``tests/data/make_broken_stores.py`` says how each was made). ``<version>-<case>.txt``
beside it holds the command, what it printed (the store's path written STORE) and its exit
code. A change in what verify finds, or in how it says it, shows here as a diff.
"""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import pytest

from shardstore_cli.shardstore_cli import main

DATA = Path(__file__).resolve().parents[2] / "data" / "broken"
ARCHIVES = sorted(DATA.glob("*.tar.gz"))
CASES = ("flipped-byte", "missing-object", "forged-manifest", "orphan-shard", "missing-commit")


def test_every_case_is_checked_in_for_both_versions_small() -> None:
    want = {f"v{v}-{case}.tar.gz" for v in (3, 4) for case in CASES}
    assert {a.name for a in ARCHIVES} == want
    for archive in ARCHIVES:
        assert archive.stat().st_size < 16 << 10, archive.name  # tiny: mostly zeros
        assert archive.with_name(archive.name.replace(".tar.gz", ".txt")).exists(), archive.name


@pytest.mark.parametrize("archive", ARCHIVES, ids=lambda p: p.name.replace(".tar.gz", ""))
def test_verify_says_exactly_what_is_checked_in(archive: Path, tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "store"
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    code = main(["verify", str(root)])
    out, err = capsys.readouterr()
    got = ("$ shardstore verify STORE\n" + out + err + f"exit {code}\n").replace(str(root), "STORE")
    assert got == archive.with_name(archive.name.replace(".tar.gz", ".txt")).read_text()
