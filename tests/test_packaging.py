"""The built wheel installs only the project's own top-level names (no generic `cli`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_wheel_top_level_names(tmp_path):
    src = tmp_path / "src"
    # Build from a copy of what the build reads, so that the checkout gains no build/ or
    # egg-info directories (and a virtualenv inside the checkout is not copied).
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for package in ("shardstore", "shardtrain", "cli"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip(f"cannot build a wheel here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("shardstore-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"shardstore", "shardtrain", "shardstore_cli"}, top
    assert "shardstore_cli/shardstore_cli.py" in names and "shardstore_cli/shardtrain_cli.py" in names
    # Every module of every subpackage is installed (setuptools' `packages` list names each one).
    sources = {
        str(f.relative_to(src)) for package in ("shardstore", "shardtrain") for f in (src / package).rglob("*.py")
    }
    assert sources - set(names) == set(), sorted(sources - set(names))
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "shardstore = shardstore_cli.shardstore_cli:main" in entry_points
    assert "shardtrain = shardstore_cli.shardtrain_cli:main" in entry_points
