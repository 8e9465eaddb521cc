"""The test folders have no ``__init__.py`` (pytest imports each file by its basename), so two test files with one
basename in different tiers break collection of the whole suite: refused here, with both paths named."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_basename() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"rename one of each: {shared}"


def test_tests_that_start_heavy_processes_join_a_chain_and_the_chains_are_balanced() -> None:
    """Under ``bin/test`` (two xdist workers) only the unit tier and the Redis-only modules run outside the two
    chains; a module stays in one chain; each tier's heavy modules are dealt so that neither chain has more than the
    other plus its longest module."""
    from tests.helpers.chains import CHAINS, DEFAULT_COST_S, MODULE_COST_S, chain_of_module, work_unit

    assert work_unit("tests/e2e/test_system.py::test_demo_reward_rises_within_the_staleness_bound") in CHAINS
    assert work_unit("tests/integration/test_rollout_actor.py::test_second_actor_shares_the_work") in CHAINS
    assert work_unit("tests/unit/test_sandbox.py::test_a_fork_bomb_does_not_starve_runs_beside_it") in CHAINS
    for light in ("tests/unit/test_wire.py::test_truncated", "tests/integration/test_replay.py::test_maxlen"):
        assert work_unit(light) == light
    assert len({work_unit(f"tests/e2e/test_system.py::{name}") for name in ("a", "b", "c[ppo]")}) == 1
    for tier in ("e2e", "integration"):
        loads = dict.fromkeys(CHAINS, 0.0)
        longest = 0.0
        for module, chain in chain_of_module().items():
            if (module.parts[1] == "e2e") == (tier == "e2e"):
                cost = MODULE_COST_S.get(module.name, DEFAULT_COST_S)
                loads[chain] += cost
                longest = max(longest, cost)
        assert abs(loads["chain-a"] - loads["chain-b"]) <= longest, (tier, loads)
