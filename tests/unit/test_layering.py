"""The packages' layering, read from the source (nothing is imported): no two modules import each other, directly or
through others, even inside a function (a circle there means a module with two jobs), and ``common`` imports neither
``actors`` nor ``learner``. Imports under ``if TYPE_CHECKING:`` are only for annotations and do not count."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "actors", "learner")


def module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def imported_names(path: Path) -> set[str]:
    """Every absolute import in the module, at any depth, except under ``if TYPE_CHECKING:``; ``from a import b``
    gives both ``a`` and ``a.b`` (``b`` may be a module)."""
    names: set[str] = set()

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names.add(child.module)
                names.update(f"{child.module}.{alias.name}" for alias in child.names)
            walk(child)

    walk(ast.parse(path.read_text()))
    return names


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: (imported_names(path) & files.keys()) - {name} for name, path in files.items()}


def circle_in(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (its modules, the first repeated at the end), or ``[]`` when there is none."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as error:
        return error.args[1]
    return []


def test_the_circle_finder_finds_a_circle_through_three_modules() -> None:
    assert sorted(set(circle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}))) == ["a", "b", "c"]
    assert circle_in({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others() -> None:
    assert circle_in(import_graph()) == []


def test_common_imports_neither_actors_nor_learner() -> None:
    graph = import_graph()
    upward = {name: sorted(m for m in graph[name] if m.split(".")[0] in ("actors", "learner")) for name in graph}
    assert {name: found for name, found in upward.items() if name.startswith("common") and found} == {}
