"""The framework adapters are a layer of their own (docs/ARCHITECTURE.md): importing shardstore,
its core and its DCP layer imports no framework, and each framework is named only by its adapter
module. One subprocess for all four frameworks (each adapter's own tests import the adapter and
check it works)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# framework (top-level import names) -> the one shardstore module that may import it
ADAPTERS = {
    ("lightning", "pytorch_lightning"): "lightning.py",
    ("transformers",): "transformers.py",
    ("accelerate",): "accelerate.py",
    ("torchtitan",): "torchtitan.py",
}
FRAMEWORKS = sorted(name for names in ADAPTERS for name in names)


def test_importing_shardstore_and_its_layers_imports_no_framework() -> None:
    code = (
        "import sys, shardstore; shardstore.save; shardstore.restore; shardstore.save_state_dict; "
        "shardstore.StateMismatch; import shardstore.dcp, shardstore.state.wrapped; "
        # accelerate's adapter imports accelerate only when one of its functions runs
        "import shardstore.accelerate; shardstore.accelerate.save_accelerator_state; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FRAMEWORKS!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_each_framework_is_imported_only_by_its_adapter() -> None:
    for path in sorted((ROOT / "shardstore").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0]
        for frameworks, module in ADAPTERS.items():
            if path.parent.name == "shardstore" and path.name == module:
                continue
            assert not [m for m in names if m.split(".")[0] in frameworks], f"{path} imports {frameworks}"
