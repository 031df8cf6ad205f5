"""The house rules of CONTRIBUTING.md, checked on the source: where modules live, their size, no import cycle."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rolloutcli"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60  # the body: a typer command's option declarations (its signature) do not count


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every rolloutcli module ``path`` imports, at the top or inside a function (lazily), TYPE_CHECKING aside."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:  # ``from package import module`` imports the module
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
    return {name for name in found if name in known}


def test_the_top_level_is_the_library_and_the_command_line_one_package() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert not [name for name in top if name.startswith(("cli", "render"))]
    assert (PACKAGE / "cli" / "app.py").is_file()
    outside = [p for p in MODULES if "cli" not in p.relative_to(PACKAGE).parts[:1] and p.name != "__main__.py"]
    known = {_name(p) for p in MODULES}
    assert not [str(p) for p in outside if any(m.startswith("rolloutcli.cli") for m in _imports(p, known))]


def test_the_names_users_import_from_the_top_level() -> None:
    import rolloutcli

    for name in ("RolloutStorage", "ShardDataset", "RolloutDataset", "TrajectoryDataset", "CircularBuffer"):
        assert isinstance(getattr(rolloutcli, name), type)
    assert callable(rolloutcli.compute_gae)
    for package in ("record", "compat"):
        assert importlib.import_module(f"rolloutcli.{package}").__name__ == f"rolloutcli.{package}"
    assert callable(importlib.import_module("rolloutcli.__main__").run)  # the console script's entry point


def test_no_import_cycle_lazy_imports_included() -> None:
    known = {_name(p) for p in MODULES}
    graph = {_name(p): _imports(p, known) - {_name(p)} for p in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for imported in sorted(graph[module]):
            if not module.startswith(imported + "."):  # a package's own __init__ runs first anyway
                visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size_functions_and_first_line(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    tree = ast.parse(source)
    doc = ast.get_docstring(tree)
    assert doc and doc.splitlines()[0].strip(), "the module's first line says what it is for"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
            assert node.end_lineno - body[0].lineno + 1 <= MAX_FUNCTION_LINES, f"{node.name} is too long"
