"""What a module imports, read from its source (nothing is imported): the layering test's and the public API's."""

from __future__ import annotations

import ast
from pathlib import Path


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
