"""The README's commands and example run as written.

The "Train your own model" section runs in tests/shardtrain/job/test_own_model.py (its end-to-end test
executes the section's commands on a model built there), so it is not run twice.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_library_example_runs(tmp_path):
    block = re.search(r"## Using shardstore from your trainer\s+```python\n(.*?)```", README, re.S).group(1)
    code = block.replace("/tmp/readme-store", str(tmp_path / "store"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"commit [0-9a-f]{64} learned-state root [0-9a-f]{64}", out.stdout)


def test_readme_dcp_example_runs(tmp_path):
    """The "With torch.distributed.checkpoint" block: DCP's own save and load through shardstore."""
    block = re.search(r"## With torch.distributed.checkpoint\s+.*?```python\n(.*?)```", README, re.S).group(1)
    code = block.replace("/tmp/dcp-store", str(tmp_path / "store"))
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"commit [0-9a-f]{64} restored True epoch 3\n", out.stdout), out.stdout
    assert (
        subprocess.run(  # the commit verifies from the command line too
            [sys.executable, "-m", "shardstore_cli.shardstore_cli", "verify", str(tmp_path / "store")], timeout=120
        ).returncode
        == 0
    )


def test_readme_quick_start_commands_are_the_real_ones():
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", README, re.S).group(1)
    lines = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    installs = [c.strip() for c in lines[0].split("&&")]
    assert installs == [
        'pip install -c constraints.txt -e ".[dev]"',
        "pip install -c constraints.txt --no-deps torchtitan triton",  # torchtitan's deps cap fsspec (.ci/run)
    ]
    assert lines[2] == "python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text()
    for install in installs:  # .ci/run installs exactly what a newcomer does
        assert install.replace("pip install", "python -m pip install -q", 1) in ci
    assert lines[2] in ci


def test_readme_main_job_is_the_demo():
    """The demo itself runs in tests/test_demo.py; here: the README names it exactly."""
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", README, re.S).group(1)
    assert block.strip().splitlines()[1].split("#")[0].split() == ["shardtrain", "demo", "--home", "/tmp/demo"]


@pytest.mark.long  # two fresh interpreters through the whole tour (~10 s): .ci/run's second step
def test_quickstart_tour_runs_twice_with_equal_commit_ids(tmp_path):
    outs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "shardstore_cli.quickstart", str(tmp_path / f"run{i}")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stdout + out.stderr
        outs.append(re.findall(r"^commit ([0-9a-f]{64})", out.stdout, re.M))
    assert len(outs[0]) == 2 and outs[0] == outs[1]


def test_readme_state_dict_example_runs(tmp_path):
    block = re.search(r"## Saving a state dict\s.*?```python\n(.*?)```", README, re.S).group(1)
    code = block.replace("/tmp/readme-state-dict", str(tmp_path / "store"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"commit [0-9a-f]{64} tensors \['optimizer_states/0/state/0/exp_avg', ", out.stdout), out.stdout
