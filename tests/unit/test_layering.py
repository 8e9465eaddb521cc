"""The packages' layering, read from the source (nothing is imported): no two modules import each other, directly or
through others, even inside a function (a circle there means a module with two jobs), and ``common`` imports neither
``actors`` nor ``learner``. Imports under ``if TYPE_CHECKING:`` are only for annotations and do not count."""

from __future__ import annotations

import ast
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


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_the_circle_finder_finds_a_circle_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others() -> None:
    assert circles(import_graph()) == []


def test_common_imports_neither_actors_nor_learner() -> None:
    graph = import_graph()
    upward = {name: sorted(m for m in graph[name] if m.split(".")[0] in ("actors", "learner")) for name in graph}
    assert {name: found for name, found in upward.items() if name.startswith("common") and found} == {}
