"""Faults planted in the processes a test starts, at import: a ``sitecustomize.py`` in a folder of its own (first on
those processes' ``PYTHONPATH``, with the repository after it) calls :func:`plant_on_import` when its variable is set,
and its patch is applied to the module it names right after that module executes, in whichever process imports it
(tests/helpers/spike/, tests/helpers/tamper/). Nothing here is imported by asyncrl itself."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


class _PlantOnImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` once, through the normal finders, and patches it right after it executes."""

    def __init__(self, name: str, plant: Callable[[ModuleType], None]) -> None:
        self.name, self.plant = name, plant

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            self.plant(module)

        spec.loader.exec_module = exec_module
        return spec


def plant_on_import(name: str, plant: Callable[[ModuleType], None]) -> None:
    """Call ``plant(module)`` once the module ``name`` has executed, the first time this process imports it."""
    sys.meta_path.insert(0, _PlantOnImport(name, plant))
