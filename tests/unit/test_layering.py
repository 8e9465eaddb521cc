"""The packages' layering, read from the source (nothing is imported): no two modules import each other, directly or
through others, even inside a function (a circle there means a module with two jobs); ``common`` imports neither
``actors`` nor ``learner``, nor vLLM or DeepSpeed; ``actors`` and ``learner`` never import each other and ``learner``
never imports vLLM; ``cli``, the commands, may import every part and no part imports it. Imports under ``if
TYPE_CHECKING:`` are only for annotations and do not count. Every part is imported under the one top-level package,
``asyncrl``, whose every module is at the path its name says, and the distribution installs every one of its
packages."""

from __future__ import annotations

import ast
import re
import tomllib
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from tests.helpers.source_imports import imported_names

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "actors", "learner", "cli")


def module_files() -> dict[str, Path]:
    """Every module of the four parts by its importable name, which is its path (``asyncrl.common.plane.keys`` is
    ``asyncrl/common/plane/keys.py``)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / "asyncrl" / package).rglob("*.py"):
            found[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def part(module: str) -> str:
    """``common``, ``actors``, ``learner`` or ``cli`` for a module of asyncrl; the top-level package name otherwise."""
    names = module.split(".")
    return names[1] if names[0] == "asyncrl" and len(names) > 1 else names[0]


def references(path: Path) -> set[str]:
    """What the module uses of other modules, however it names them: every absolute import at any depth, those under
    ``if TYPE_CHECKING:`` included, and every string that is a whole import path (``"asyncrl.common.data.gyms:Task"``
    given to a registry, ``"-m", "asyncrl.cli.learner"`` in a command line), which loads the module all the same."""
    tree = ast.parse(path.read_text())
    names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and IMPORT_PATH.fullmatch(node.value):
            names.add(node.value.split(":")[0])
    return names


IMPORT_PATH = re.compile(r"asyncrl(\.\w+)+(:\w+)?")
"""A string that names a module (and an object in it) to be imported: a registry's path, ``python -m``'s argument."""


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


FORBIDDEN = {
    "common": {"actors", "learner", "cli", "vllm", "deepspeed"},
    "actors": {"learner", "cli", "deepspeed"},
    "learner": {"actors", "cli", "vllm"},
    "cli": set(),  # the roof: the commands may import both wings
}


def test_each_part_imports_only_what_its_layer_allows() -> None:
    crossings = {}
    for name, path in module_files().items():
        found = sorted(m for m in references(path) if part(m) in FORBIDDEN[part(name)])
        if found:
            crossings[name] = found
    assert crossings == {}


def test_the_layering_rule_sees_a_crossing() -> None:
    assert part("asyncrl.learner.update.policy") == "learner" and part("vllm.v1") == "vllm"
    assert part("asyncrl.actors.episodes") in FORBIDDEN["learner"]


def test_nothing_imports_the_parts_outside_the_asyncrl_package() -> None:
    """The root's ``common``, ``actors`` and ``learner`` are links into ``asyncrl/``, not packages: a ``from
    common.plane.keys import …`` works from the repository's root only, and would load a second copy of the module
    beside ``asyncrl.common.plane.keys``."""
    bare = {}
    for path in sorted(ROOT.glob("**/*.py")):
        if ".venv" in path.parts or "build" in path.parts:
            continue
        found = sorted(m for m in imported_names(path) if m.split(".")[0] in PACKAGES)
        if found:
            bare[str(path.relative_to(ROOT))] = found
    assert bare == {}


def test_the_distribution_installs_every_package() -> None:
    """``pyproject.toml`` finds the packages under ``asyncrl`` without mapping a folder (path = module), and only
    regular packages: a folder of modules without an ``__init__.py`` would be left out of the wheel, so there is none;
    the root's links into ``asyncrl/`` are no packages of their own; the presets are the package's data."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"] == {"find": {"include": ["asyncrl", "asyncrl.*"], "namespaces": False}}
    assert setuptools["package-data"] == {"asyncrl": ["presets/*.toml"]} and set(setuptools) == {
        "packages",
        "package-data",
    }
    folders = {path.parent for path in module_files().values()} | {ROOT / "asyncrl"}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()) == []
    for name in PACKAGES:
        assert (ROOT / name).resolve() == ROOT / "asyncrl" / name, f"{name}: a link to asyncrl/{name}"
    assert (ROOT / "configs").resolve() == ROOT / "asyncrl" / "presets", "configs: a link to asyncrl/presets"


COMMON_STACK = (
    "exit_codes", "registry", "openmp", "net", "redact", "config", "observability", "private", "wire", "transport",
    "plane", "weights", "staleness", "sandbox", "data", "rewards", "environments", "tiny_models",
)  # fmt: skip
"""The layers of ``common`` (its sub-packages and top modules), lowest first: a module uses its own layer and those
below it, never one above (docs/development.md draws them)."""
LEARNER_STACK = (
    "jit_lock", "dist", "ranks", "algorithms", "health", "intake", "update", "checkpoint", "weights", "record",
    "run_state", "follower", "loop",
)  # fmt: skip
"""The layers of ``learner``, lowest first, read as ``COMMON_STACK`` is: the training step uses what it is fed and
how its health is judged; checkpoints save the step's engines; the record reads them all; the loop owns everything."""
STACKS = {"common": COMMON_STACK, "learner": LEARNER_STACK}


def layer(module: str, stack: str = "common") -> str | None:
    """The layer of the part ``stack`` a module name is in (``config`` for ``asyncrl.common.config.run``), None
    outside that part."""
    names = module.split(".")
    return names[2] if names[:2] == ["asyncrl", stack] and len(names) > 2 else None


def upward_references(stack: str, files: dict[str, Path]) -> dict[str, list[str]]:
    """Each module of ``files`` in the part ``stack`` that uses a layer above its own, with what it uses there."""
    layers = STACKS[stack]
    height = {name: level for level, name in enumerate(layers)}
    upward = {}
    for name, path in files.items():
        if (mine := layer(name, stack)) is None:
            continue
        above = sorted(m for m in references(path) if (other := layer(m, stack)) and height[other] > height[mine])
        if above:
            upward[name] = above
    return upward


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_common_and_learner_are_stacks_of_layers_each_using_only_those_below(stack: str) -> None:
    files = module_files()
    assert {layer(name, stack) for name in files} - {None} == set(STACKS[stack])  # a new layer is placed in the list
    assert upward_references(stack, files) == {}


def test_the_stack_rule_sees_a_planted_back_edge(tmp_path: Path) -> None:
    """A module of the update that reached up into the loop, or named it as an import path, breaks the stack."""
    planted = tmp_path / "planted.py"
    planted.write_text("from asyncrl.learner.loop import Learner\nSTART = 'asyncrl.learner.record.recorder:Recorder'\n")
    files = {**module_files(), "asyncrl.learner.update.planted": planted}
    assert upward_references("learner", files) == {
        "asyncrl.learner.update.planted": [
            "asyncrl.learner.loop", "asyncrl.learner.loop.Learner", "asyncrl.learner.record.recorder",
        ],
    }  # fmt: skip


def test_the_rules_count_annotations_and_import_path_strings_but_not_prose(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        '"""A docstring that names asyncrl.common.wire.messages uses nothing."""\n'
        "if TYPE_CHECKING:\n    from asyncrl.common.plane.keys import RunKeys\n"
        "REGISTRY.register_path('x', 'asyncrl.common.data.gyms:Task')\n"
    )
    assert references(module) == {
        "asyncrl.common.plane.keys", "asyncrl.common.plane.keys.RunKeys", "asyncrl.common.data.gyms",
    }  # fmt: skip
    assert layer("asyncrl.common.plane.keys") == "plane" and layer("asyncrl.actors.engine") is None
