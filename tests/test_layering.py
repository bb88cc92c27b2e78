"""The package floors of DESIGN §2, read from the source: which package may import which, no
import circle between modules, and an engine that imports nothing of the model.

Imports are read with ``ast`` from every module's top level, ``TYPE_CHECKING`` blocks included (a
type is a dependency too, and a circle hidden from the interpreter is still a circle for a
reader); imports inside functions are not module-level and are not counted.
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


def _top_level(body: list[ast.stmt]) -> Iterator[str]:
    for node in body:
        if isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", []))):
                yield from _top_level(block)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _imports(module: str) -> set[str]:
    """The repository modules ``module`` imports at its top level."""
    tree = ast.parse(MODULES[module].read_text())
    found = set()
    for name in _top_level(tree.body):
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


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (the modules on it, the first repeated last), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            circle = visit(imported)
            if circle is not None:
                return circle
        path.pop()
        done.add(module)
        return None

    return next((c for m in sorted(graph) if (c := visit(m)) is not None), None)


def test_no_import_circle_between_modules() -> None:
    graph = {m: _imports(m) for m in MODULES}
    # a package's __init__ runs before its submodules: an edge from a submodule to a package
    # above it is that order, not a circle
    graph = {m: {d for d in deps if not m.startswith(f"{d}.")} for m, deps in graph.items()}
    assert _circle(graph) is None
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
