"""shardstore's public names: one list, each documented (issue 35, item 7).

The list is the ``if TYPE_CHECKING:`` block of ``shardstore/__init__.py`` (before, a dict of
name -> module beside that block, kept equal by hand). Every public name loads, says what it
is (a docstring of its own; for a constant, the string under its assignment) and is named in
README.md or docs/; every subpackage of shardstore says in its docstring what it is and what
it may import.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardstore as ss

REPO = Path(__file__).resolve().parents[2]
DOCS = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def test_all_is_the_type_checking_block_and_the_errors_each_name_written_once() -> None:
    source = (REPO / "shardstore" / "__init__.py").read_text()
    block = next(n for n in ast.parse(source).body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    listed = [a.name for node in block.body if isinstance(node, ast.ImportFrom) for a in node.names]
    assert sorted(ss.__all__) == ss.__all__ == sorted({*listed, *ss.errors.__all__})
    assert len(ss.__all__) == len(listed) + len(ss.errors.__all__)
    for name in listed:  # one list: no second table of names to keep equal by hand
        assert len(re.findall(rf"(?<![.\w]){name}\b", source)) == 1, name  # not counting module paths (.ops.gc)


def test_every_public_name_loads_without_importing_torch_first() -> None:
    """``import shardstore`` stays torch-free; each name then loads from the module the list names."""
    code = "import sys, shardstore; assert 'torch' not in sys.modules; print(len(shardstore.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and int(out.stdout) == len(ss.__all__), out.stderr
    for name in ss.__all__:
        value = getattr(ss, name)
        module = ss._EXPORTS.get(name, "shardstore.errors")
        assert getattr(importlib.import_module(module), name) is value, name


def _attribute_docstring(module: str, name: str) -> str | None:
    """The string literal under ``name = ...`` (or ``name: T = ...``) in ``module``'s source."""
    body = ast.parse(inspect.getsource(importlib.import_module(module))).body
    for node, after in zip(body, body[1:]):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                return str(after.value.value)
    return None


@pytest.mark.parametrize("name", ss.__all__)
def test_every_public_name_has_a_docstring_and_is_in_the_readme_or_docs(name: str) -> None:
    value = getattr(ss, name)
    if inspect.isclass(value):
        doc = value.__dict__.get("__doc__")  # its own, not one inherited from a base class
    elif inspect.isfunction(value) or inspect.isbuiltin(value):
        doc = value.__doc__
    else:
        doc = _attribute_docstring(ss._EXPORTS[name], name)
    assert doc and doc.strip(), f"shardstore.{name} has no docstring"
    assert re.search(rf"(?<![\w.]){name}\b", DOCS), f"shardstore.{name} is named in neither README.md nor docs/"


def test_every_subpackage_says_what_it_is_and_what_it_may_import() -> None:
    packages = [m.name for m in pkgutil.walk_packages(ss.__path__, "shardstore.") if m.ispkg]
    assert len(packages) >= 9, packages
    for name in packages:
        doc = importlib.import_module(name).__doc__
        assert doc and len(doc.split()) >= 20, f"{name} has no docstring"
        assert re.search(r"\bimport", doc), f"{name}'s docstring does not say what it may import"
