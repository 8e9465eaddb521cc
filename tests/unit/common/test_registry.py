"""The shared registry: duplicate names refused, import paths resolved and held to the registry's contract (the
call asyncrl makes), snapshots restore."""

from __future__ import annotations

import os

import pytest

from asyncrl.common.registry import Contract, Registry


def double(x: int) -> int:
    return 2 * x


def test_a_taken_name_is_refused_to_a_different_object_only() -> None:
    reg: Registry = Registry("thing")
    reg.register("double")(double)
    reg.register("double")(double)  # the same object again (a module reloaded) is fine
    with pytest.raises(ValueError, match="thing name 'double' already registered by double"):
        reg.register("double")(lambda x: x)
    with pytest.raises(ValueError, match="contain no ':'"):
        reg.register("a:b")


def test_unknown_names_list_what_is_registered() -> None:
    reg: Registry = Registry("thing")
    reg.register("double")(double)
    with pytest.raises(ValueError, match="unknown thing 'triple'; registered: double"):
        reg.get("triple")


def test_import_paths_resolve_to_callables_only() -> None:
    reg: Registry = Registry("thing")
    assert reg.get("asyncrl.common.registry:Registry") is Registry
    assert reg.get("asyncrl.common.registry:Registry.snapshot") is Registry.snapshot  # dotted attributes
    with pytest.raises(ValueError, match="cannot be resolved: ModuleNotFoundError"):
        reg.get("no_such_module:x")
    with pytest.raises(ValueError, match="not something callable"):
        reg.get("asyncrl.common.registry:_IMPORTED")
    with pytest.raises(ValueError, match="not of the form"):
        reg.get("asyncrl.common.registry:")


def test_snapshot_undoes_registrations() -> None:
    reg: Registry = Registry("thing")
    reg.register("double")(double)
    with reg.snapshot():
        reg.register("extra")(double)
        assert reg.names() == ["double", "extra"]
    assert reg.names() == ["double"]


def test_a_name_registered_by_import_path_is_imported_when_first_used() -> None:
    reg: Registry = Registry("thing")
    reg.register_path("double", "tests.unit.common.test_registry:double")
    reg.register_path("double", "tests.unit.common.test_registry:double")  # the same path again is fine
    reg.register_path("broken", "no_such_module_here:thing")
    assert reg.names() == ["broken", "double"] and "double" in reg
    assert reg.loaded("double") is None  # a check may ask without importing it
    assert reg.get("double")(3) == 6
    reg.register("triple")(double)
    assert reg.loaded("triple") is double and reg.loaded("unknown") is None
    with pytest.raises(ValueError, match="thing import path 'no_such_module_here:thing' cannot be resolved"):
        reg.get("broken")  # refused when used, naming the path
    with pytest.raises(ValueError, match=r"already registered by tests\.unit\.common\.test_registry:double"):
        reg.register("double")(double)


# --------------------------------------------------------------------------- contracts of import paths

CALLED_WITH_TWO = Contract("f(group, options) -> scores", args=2)
A_CLASS_WITH_STEP = Contract("a class Env(row, options) with step(action)", args=2, methods=("step",))


def scorer(group: object, options: dict) -> list[float]:
    return []


def settings_only(settings: object) -> None: ...


class Stepper:
    def __init__(self, row: object, options: dict) -> None: ...

    def step(self, action: str) -> None: ...


class NoStep:
    def __init__(self, row: object, options: dict) -> None: ...


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("os:system", "it is one of Python's builtins (system), which was not written for this call"),
        ("operator:add", "it is one of Python's builtins (add)"),  # a builtin whose signature (a, b, /) would bind
        ("builtins:str.upper", "it is one of Python's builtins"),  # a method descriptor
        ("tests.unit.common.test_registry:settings_only", "its signature (settings) cannot take that call (too many"),
        ("tests.unit.common.test_registry:Stepper", "it is a class (Stepper), not a function"),
    ],
)
def test_an_import_path_that_is_not_the_registry_s_kind_of_function_is_refused(path: str, why: str) -> None:
    reg: Registry = Registry("reward function", CALLED_WITH_TWO)
    with pytest.raises(ValueError) as refused:
        reg.get(path, "reward.functions[0].name")
    expects = "not a reward function (expects f(group, options) -> scores): "
    assert str(refused.value).startswith(f"reward.functions[0].name = {path!r}: {expects}{why}")
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=rf"^reward function import path {path!r}: not a reward function"):
        reg.get(path)  # without a setting, the path is named
    assert reg.get("tests.unit.common.test_registry:scorer", "reward.functions[0].name").__name__ == "scorer"
    assert Registry("anything").get("os:system") is os.system  # a registry without a contract checks only callable


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("os:system", "it is a builtin_function_or_method, not a class"),
        ("tests.unit.common.test_registry:NoStep", "class NoStep has no step method"),
        ("collections:OrderedDict", "class OrderedDict has no step method"),
    ],
)
def test_an_import_path_that_is_not_the_registry_s_kind_of_class_is_refused(path: str, why: str) -> None:
    reg: Registry = Registry("environment", A_CLASS_WITH_STEP)
    with pytest.raises(ValueError, match=rf"^environment\.name = {path!r}: not an environment \(expects .*\): {why}"):
        reg.get(path, "environment.name")
    assert reg.get("tests.unit.common.test_registry:Stepper").__name__ == "Stepper"


def test_a_deferred_entry_is_held_to_the_contract_and_an_unknown_name_names_the_setting() -> None:
    reg: Registry = Registry("reward function", CALLED_WITH_TWO)
    reg.register_path("shell", "os:system")
    with pytest.raises(ValueError, match=r"^reward\.functions\[1\]\.name = 'shell': not a reward function"):
        reg.get("shell", "reward.functions[1].name")
    with pytest.raises(ValueError, match=r"^reward\.functions\[1\]\.name = 'nope': unknown reward function 'nope'"):
        reg.get("nope", "reward.functions[1].name")


def test_every_built_in_entry_fulfils_its_registry_s_contract() -> None:
    """What asyncrl registers itself is held to the contract a user's import path is held to (a deferred entry whose
    optional package is not installed here is skipped)."""
    from asyncrl.common.environments.protocol import ENVIRONMENTS
    from asyncrl.common.rewards.functions import REWARDS
    from asyncrl.common.rewards.verifiers import VERIFIERS
    from asyncrl.learner.algorithms.registries import ALL_REGISTRIES

    checked = 0
    for registry in (REWARDS, VERIFIERS, ENVIRONMENTS, *ALL_REGISTRIES):
        assert registry.contract is not None, registry.kind
        for name in registry.names():
            try:
                entry = registry.get(name)
            except ValueError as exc:
                assert "cannot be resolved: ModuleNotFoundError" in str(exc), exc
                continue
            assert registry.contract.problem(entry) is None, (registry.kind, name)
            checked += 1
    assert checked > 30


def test_an_installed_packages_entry_points_add_names_and_never_replace_asyncrls(tmp_path, monkeypatch) -> None:
    """A package declaring ``asyncrl.environments`` / ``asyncrl.rewards`` entry points: its names resolve to its
    objects, an unknown name lists them, and its claim on a built-in name (``python``) loses to the built-in."""
    from asyncrl.common import registry
    from asyncrl.common.environments.protocol import ENVIRONMENTS
    from asyncrl.common.environments.python_tool import PythonTool
    from asyncrl.common.rewards.functions import REWARDS
    from asyncrl.environments import EpisodeRow
    from tests.helpers.plugin_dist import installed_plugin

    monkeypatch.syspath_prepend(str(installed_plugin(tmp_path / "site")))
    registry.installed_entry_points.cache_clear()
    monkeypatch.setattr(registry, "installed_entry_points", registry.installed_entry_points)  # cleared again after
    try:
        lookup = ENVIRONMENTS.get("kv_lookup", "environment.name")
        env = lookup(EpisodeRow(prompt="k", answer="", extra={"table": {"k": "v"}}), {})
        env.step("v")
        assert env.score() == 1.0 and "kv_lookup" in ENVIRONMENTS and "kv_lookup" in ENVIRONMENTS.names()
        assert ENVIRONMENTS.get("python") is PythonTool  # the built-in wins
        assert REWARDS.get("exact_ok").__module__ == "kv_envs"
        with pytest.raises(ValueError, match=r"unknown reward function 'nope'; registered: .*exact_ok"):
            REWARDS.get("nope")
    finally:
        registry.installed_entry_points.cache_clear()


def test_a_registry_without_a_group_reads_no_entry_points() -> None:
    reg: Registry = Registry("thing")
    assert reg.group is None and reg.names() == []
