"""No import cycle between the project's modules.

The layers import downward only (docs/development.md, "Layout"): a cycle, even through an import
inside a function, means two modules that cannot be read, tested or replaced one without the
other. Imports under ``if TYPE_CHECKING:`` never run and are left out. Module-level and
function-level imports count alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dbo", "moe", "distributed", "launch")


def _modules(root: Path) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest project module that ``name`` is or lies under."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for statement in branch.body
        for node in ast.walk(statement)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            names.update(f"{base}.{alias.name}" for alias in node.names)
            names.add(base)
    return names


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports at run time (itself and its packages left
    out)."""
    modules = _modules(root)
    graph = {}
    for module, path in modules.items():
        targets = {_resolve(name, modules) for name in _imported_names(module, path)}
        # a package's own __init__ runs before any of its modules: ``from pkg import sibling``
        # in pkg.mod names a sibling, not a cycle through pkg
        graph[module] = {
            t
            for t in targets
            if t
            and t != module
            and not (modules[t].name == "__init__.py" and module.startswith(t + "."))
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_the_projects_modules():
    found = cycles(import_graph())
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "__init__.py").write_text("")
    (tmp_path / "moe" / "a.py").write_text("from moe.b import x\n")
    (tmp_path / "moe" / "b.py").write_text("def x():\n    from moe import a\n")
    (tmp_path / "moe" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from moe.a import y\n"
    )
    for package in ("dbo", "distributed", "launch"):
        (tmp_path / package).mkdir()
    assert cycles(import_graph(tmp_path)) == [["moe.a", "moe.b"]]
