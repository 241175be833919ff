"""No private name crosses a module (STYLE.md; issue 35, item 2).

A name with a leading underscore is its module's own: no other module of shardstore,
shardtrain or the CLI imports it (``from .optim import _probe_torch``), reads it off an
imported module (``regroup._journal``), or reaches a private attribute of a class another
module defines (``storage._call``, as the S3 request layer once did through a Protocol
naming S3Storage's plumbing). What two modules share is public, named and documented where
it lives. A private *module* (``cli/_render.py``) is its package's: its siblings import it
by its public names.

Checked over the package sources with ``ast``; each test lists every offence it finds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"shardstore": "shardstore", "shardtrain": "shardtrain", "cli": "shardstore_cli"}  # directory -> import name


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules() -> Iterator[tuple[str, str, Path, ast.Module]]:
    """(module name, its package, path, tree) of every source module."""
    for directory, top in PACKAGES.items():
        for path in sorted((REPO / directory).rglob("*.py")):
            parts = [top, *path.relative_to(REPO / directory).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            module = ".".join(parts[:-1] if is_package else parts)
            package = module if is_package else module.rpartition(".")[0]
            yield module, package, path, ast.parse(path.read_text(encoding="utf-8"), str(path))


def _source(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports(modules: list[tuple[str, str, Path, ast.Module]]) -> list[str]:
    """``from ours import _name`` and ``ours_module._name``, in any module of ours."""
    ours = tuple(PACKAGES.values())
    found: list[tuple[Path, int, str]] = []
    for module, package, path, tree in modules:
        imported: dict[str, str] = {}  # local name -> the module of ours it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _source(node, package)
                if src.split(".")[0] not in ours:
                    continue
                for alias in node.names:
                    if _private(alias.name):
                        found.append((path, node.lineno, f"from {src} import {alias.name}"))
                    imported[alias.asname or alias.name] = f"{src}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in ours:
                        imported[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in imported
            ):
                found.append((path, node.lineno, f"{node.value.id}.{node.attr} ({imported[node.value.id]})"))
    return [f"{p.relative_to(REPO)}:{line}: {what}" for p, line, what in sorted(found)]


def _is_protocol(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(b).split(".")[-1].split("[")[0] == "Protocol" for b in cls.bases)


def _class_privates(tree: ast.Module) -> set[str]:
    """The private attributes the classes of a module define: methods, class attributes, ``self._x = ...``
    (a Protocol defines nothing: it names what another class has)."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and not _is_protocol(n)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and node in cls.body:
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return {n for n in names if _private(n)}


def foreign_private_attributes(modules: list[tuple[str, str, Path, ast.Module]]) -> list[str]:
    """``obj._x`` (``obj`` not ``self`` / ``cls``) in a module whose own classes define no ``_x``,
    where a class of another module of ours does: a private attribute reached across modules."""
    defined = {module: _class_privates(tree) for module, _, _, tree in modules}
    found: list[tuple[Path, int, str]] = []
    for module, _, path, tree in modules:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)) or node.attr in defined[module]:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owners = sorted(m for m, names in defined.items() if node.attr in names)
            if owners:
                found.append((path, node.lineno, f".{node.attr} (defined in {', '.join(owners)})"))
    return [f"{p.relative_to(REPO)}:{line}: {what}" for p, line, what in sorted(found)]


def private_protocol_members(modules: list[tuple[str, str, Path, ast.Module]]) -> list[str]:
    """Members of a ``Protocol`` with a private name: a Protocol is a surface other modules use,
    so what it names is public (a Protocol over another class's plumbing hides a private reach)."""
    found = []
    for _, _, path, tree in modules:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and _is_protocol(n)):
            for node in cls.body:
                name = (
                    node.name
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    else node.target.id
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    else None
                )
                if name is not None and _private(name):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {cls.name}.{name}")
    return found


@pytest.fixture(scope="module")
def modules() -> list[tuple[str, str, Path, ast.Module]]:
    found = list(_modules())
    assert len(found) > 100, "the package sources were not found"
    return found


def test_no_private_name_is_imported_from_another_module(modules: list[tuple[str, str, Path, ast.Module]]) -> None:
    assert private_imports(modules) == []


def test_no_private_attribute_of_another_modules_class_is_reached(
    modules: list[tuple[str, str, Path, ast.Module]],
) -> None:
    assert foreign_private_attributes(modules) == []


def test_no_protocol_names_a_private_member(modules: list[tuple[str, str, Path, ast.Module]]) -> None:
    assert private_protocol_members(modules) == []


def test_the_checks_find_what_they_look_for() -> None:
    """Each check finds a planted offence of each kind it names (so a pass means none, not a blind check)."""
    a = ast.parse("class Storage:\n    def __init__(self):\n        self._sem = None\n    def _call(self): ...\n")
    b = ast.parse(
        "from .a import _helper, public\nimport shardstore.state.a as a\n"
        "def f(storage):\n    a._helper()\n    storage._call()\n    storage._sem\n    self_like._own\n"
        "class Own:\n    def _own(self): ...\n"
        "class Requester(Protocol):\n    url: str\n    _sem: int\n    def _call(self): ...\n"
    )
    mods = [
        ("shardstore.state.a", "shardstore.state", REPO / "a.py", a),
        ("shardstore.state.b", "shardstore.state", REPO / "b.py", b),
    ]
    assert private_imports(mods) == [
        "b.py:1: from shardstore.state.a import _helper",
        "b.py:4: a._helper (shardstore.state.a)",
    ]
    assert foreign_private_attributes(mods) == [  # the Protocol's _call and _sem are not b's own
        "b.py:5: ._call (defined in shardstore.state.a)",
        "b.py:6: ._sem (defined in shardstore.state.a)",
    ]
    assert private_protocol_members(mods) == ["b.py:12: Requester._sem", "b.py:13: Requester._call"]
