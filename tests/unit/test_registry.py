"""The shared registry: duplicate names refused, import paths resolved, snapshots restore."""

from __future__ import annotations

import pytest

from asyncrl.common.registry import Registry


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
    reg.register_path("double", "tests.unit.test_registry:double")
    reg.register_path("double", "tests.unit.test_registry:double")  # the same path again is fine
    reg.register_path("broken", "no_such_module_here:thing")
    assert reg.names() == ["broken", "double"] and "double" in reg
    assert reg.get("double")(3) == 6
    with pytest.raises(ValueError, match="thing import path 'no_such_module_here:thing' cannot be resolved"):
        reg.get("broken")  # refused when used, naming the path
    with pytest.raises(ValueError, match=r"already registered by tests\.unit\.test_registry:double"):
        reg.register("double")(double)
