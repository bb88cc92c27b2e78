"""The package floors of DESIGN §2, read from the source: which package may import which, no
import circle between modules, and an engine that imports nothing of the model.

Every import statement counts, wherever it stands: at the top level, under ``TYPE_CHECKING``
(a type is a dependency too, and a circle hidden from the interpreter is still a circle for a
reader) and inside functions (a lazy import only postpones a circle to the first call).
Relative imports are resolved against the importing module's package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAY_IMPORT = {
    "graphs": {"graphs"},
    "platforms": {"graphs", "platforms"},
    "dsv4": {"graphs", "dsv4"},
    "runners": {"graphs", "platforms", "dsv4", "runners"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in MAY_IMPORT:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imported_names(tree: ast.AST, package: str) -> Iterator[str]:
    """Every name an import statement anywhere in ``tree`` imports (``from m import x`` yields
    ``m`` and ``m.x``); relative imports are resolved against ``package``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def _imports(module: str) -> set[str]:
    """The repository modules ``module`` imports, wherever its import statements stand."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for name in _imported_names(ast.parse(path.read_text()), package):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def test_each_package_imports_only_the_floors_below_it() -> None:
    wrong = {
        (module, imported)
        for module in MODULES
        for imported in _imports(module)
        if imported.split(".")[0] not in MAY_IMPORT[module.split(".")[0]]
    }
    assert wrong == set()


def test_the_engine_imports_nothing_of_the_model() -> None:
    engine = [m for m in MODULES if m.startswith("runners.engine")]
    assert engine and all(
        not imported.startswith("dsv4") for module in engine for imported in _imports(module)
    )


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one
    module (Tarjan), each as its sorted modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def test_imports_inside_functions_and_relative_imports_are_read() -> None:
    source = "import a\ndef f():\n    from b import c\n    from . import d\n    from .e import g\n"
    found = set(_imported_names(ast.parse(source), "p.q"))
    assert {"a", "b", "b.c", "p.q", "p.q.d", "p.q.e", "p.q.e.g"} <= found


def test_no_import_circle_between_modules() -> None:
    graph = {m: _imports(m) for m in MODULES}
    # a package's __init__ runs before its submodules: an edge from a submodule to a package
    # above it is that order, not a circle
    graph = {m: {d for d in deps if not m.startswith(f"{d}.")} for m, deps in graph.items()}
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}}) == [
        ["a", "b", "c"],
        ["d", "e"],
    ]
