"""The one module users write against: every name it offers is the object of its home module, and importing it
loads neither wing (each name is imported when first used)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import asyncrl.api as api
from tests.helpers.source_imports import imported_names

ROOT = Path(__file__).resolve().parents[2]


def test_every_name_is_its_home_modules_object() -> None:
    for name in api.__all__:
        home = importlib.import_module(api._HOME_OF[name])
        assert getattr(api, name) is getattr(home, name), name
    assert set(dir(api)) == set(api.__all__)
    with pytest.raises(AttributeError, match="no attribute 'register_los'"):
        api.register_los  # noqa: B018


def test_the_contracts_the_docs_name_are_all_there() -> None:
    wanted = {
        "Environment", "ToolEnvironment", "EpisodeRow", "Step", "function_spec",  # environments
        "RewardFn", "register_reward", "Verifier", "register_verifier", "Task", "register_task",  # rewards, tasks
        "Workflow", "register_workflow",  # rollout workflows
        "AdvantageInput", "AdvantageOutput", "LossInput", "LossOutput", "Settings", "Need",  # algorithms
        "register_advantage", "register_loss", "register_aggregation",
    }  # fmt: skip
    assert wanted <= set(api.__all__)


def test_importing_it_loads_no_part_of_asyncrl() -> None:
    """Only what runs when the module is imported counts: the names under ``if TYPE_CHECKING:`` are for editors."""
    loaded = {name for name in imported_names(ROOT / "asyncrl" / "api.py") if name.startswith("asyncrl")}
    assert loaded == set()


def test_the_names_offered_are_the_names_placed() -> None:
    assert api.__all__ == sorted(api._HOME_OF)
