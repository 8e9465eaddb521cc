"""The test folders have no ``__init__.py`` (pytest imports each file by its basename), so two test files with one
basename in different tiers break collection of the whole suite: refused here, with both paths named."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"rename one of each: {shared}"


def test_a_tests_tier_is_its_folder_alone() -> None:
    """No module marks a tier itself (a unit module once ran in the chain because one of its tests was marked
    ``integration``); the folders under ``tests/`` are the three tiers, the helpers and their data."""
    from tests.conftest import TIERS

    marked = re.compile(r"pytest\.mark\.(unit|integration|e2e)\b")
    assert [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if marked.search(p.read_text())] == []
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {*TIERS, "helpers", "data"}, folders


def test_no_test_module_imports_another() -> None:
    """What two modules share lives in ``tests/helpers`` (a test module imported by another runs its fixtures and
    registrations twice, under two names)."""
    imports = re.compile(r"^\s*(from|import) tests\.(unit|integration|e2e)\b", re.M)
    assert [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if imports.search(p.read_text())] == []


def test_the_unit_and_integration_tiers_mirror_the_package() -> None:
    """A test module under ``tests/<tier>/X/`` tests the code of ``asyncrl/X/`` (a folder of the package); those at a
    tier's top test what spans the parts (the public API, the docs, the layering, a model through actor and learner)."""
    package = TESTS.parent / "asyncrl"
    for tier in ("unit", "integration"):
        folders = {p.parent.relative_to(TESTS / tier) for p in (TESTS / tier).rglob("test_*.py")} - {Path(".")}
        assert [str(f) for f in sorted(folders) if not (package / f).is_dir()] == [], tier


def test_tests_that_start_heavy_processes_join_the_serial_chain() -> None:
    """Under ``bin/test`` (two xdist workers) only the unit tier, the Redis-only modules, the short command-line runs
    and training whose checks compare numbers go beside the chain; every module that starts a vLLM engine or a sandbox,
    or whose checks depend on a clock, joins it."""
    from tests.conftest import runs_serially

    assert runs_serially("tests/e2e/test_system.py::test_demo_reward_rises_within_the_staleness_bound")
    assert runs_serially(
        "tests/integration/actors/test_rollout_actor.py::test_kill_9_of_an_actor_leaves_no_vllm_process"
    )
    assert runs_serially(
        "tests/integration/common/sandbox/test_sandbox.py::test_a_fork_bomb_does_not_starve_runs_beside_it"
    )
    assert not runs_serially("tests/unit/common/wire/test_wire.py::test_truncated_messages_raise_only_wire_error")
    assert runs_serially(
        "tests/integration/common/plane/test_redis_outage.py::test_a_delivery_cut_by_the_restart_is_read_again"
    )
    assert runs_serially(
        "tests/integration/learner/test_time_budget.py::test_the_learner_stops_when_its_time_budget_is_spent"
    )
    assert not runs_serially(
        "tests/integration/learner/checkpoint/test_checkpoint.py::test_a_missing_file_is_refused_by_rl_learner"
    )
    assert not runs_serially("tests/integration/common/plane/test_replay.py::test_maxlen_trims_the_oldest_entries")
    assert not runs_serially("tests/integration/cli/test_cli.py::test_invalid_override_exits_with_the_field_named")


def test_every_module_beside_the_chain_exists() -> None:
    """A renamed module must not fall silently into the chain: each name in ``SHARED_CORES`` is a real module."""
    from tests.conftest import SHARED_CORES

    present = {path.name for tier in ("e2e", "integration", "unit") for path in (TESTS / tier).rglob("test_*.py")}
    assert not SHARED_CORES - present, sorted(SHARED_CORES - present)


def test_each_prefetched_model_has_its_test_module_and_is_wanted_only_by_it() -> None:
    """A prefetch names the module whose fixture waits for it: a renamed module would leave the build unwanted (and
    the test paying it in the chain), so each named module exists, and only its node ids want the build."""
    from tests.helpers.prefetch import PREFETCHES

    for prefetch in PREFETCHES:
        assert (TESTS.parent / prefetch.module).is_file(), prefetch.module
        assert prefetch.wanted_by([f"{prefetch.module}::test_x", "tests/unit/common/wire/test_wire.py::test_y"])
        assert not prefetch.wanted_by(["tests/unit/common/wire/test_wire.py::test_y", f"{prefetch.module}x::test_z"])
