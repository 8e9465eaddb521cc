"""Which xdist worker runs which heavy test under ``bin/test`` (two workers on the two cores).

Tests that start heavy processes (vLLM, DeepSpeed, torchrun, sandboxes, whole runs) form two chains, one per worker;
a chain runs its tests one after another, so at most two heavy tests run at once and never two on one worker. A
module stays whole in one chain (its module-scoped runs and actors are started once). Modules are dealt to the chains
longest first, each to the chain with less work so far (longest processing time first), tier by tier, so that a plain
run (unit + integration) and a ``--slow`` run (e2e added) are both balanced. Everything else (the unit tier and the
Redis-only modules) is a work unit of its own, which either worker takes when its chain runs low.

:data:`MODULE_COST_S` only balances the chains; a module missing from it counts :data:`DEFAULT_COST_S`.
"""

from __future__ import annotations

import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHAINS = ("chain-a", "chain-b")
SHARED_CORES = {"test_control.py", "test_dispatcher.py", "test_audit.py", "test_channel.py", "test_replay.py"}
"""Integration modules that need only a redis-server or ZeroMQ sockets: light enough to run beside the chains."""
DEFAULT_COST_S = 30.0
MODULE_COST_S = {  # seconds of each module on the 2-core machine, from bin/test [--slow] --durations=0
    # e2e
    "test_system.py": 640,
    "test_multi_host.py": 200,
    "test_redis_restart.py": 175,
    "test_eval.py": 100,
    "test_chat_run.py": 90,
    "test_resume.py": 90,
    "test_curve.py": 85,
    "test_ranks_in_the_loop.py": 80,
    "test_mismatch_guard.py": 80,
    "test_forged_groups.py": 70,
    # integration, and unit modules that start processes
    "test_rollout_actor.py": 450,
    "test_chat_models.py": 160,
    "test_learner_ranks.py": 125,
    "test_reward_worker.py": 105,
    "test_checkpoint.py": 95,
    "test_dpo_offline.py": 70,
    "test_tiny_model.py": 65,
    "test_cli.py": 65,
    "test_redis_outage.py": 57,
    "test_garbage_flood.py": 29,
    "test_learner_engine.py": 20,
    "test_time_budget.py": 16,
    "test_sandbox.py": 15,
}


def is_heavy(path: Path) -> bool:
    """A module under ``tests/unit`` with a test marked ``integration`` (it starts processes), or any integration
    module beyond :data:`SHARED_CORES`, or any e2e module."""
    if path.parts[:2] == ("tests", "unit"):
        return "pytest.mark.integration" in (ROOT / path).read_text()
    return path.name not in SHARED_CORES


@functools.cache
def chain_of_module() -> dict[Path, str]:
    """Every heavy module on disk (relative to the repository) → its chain."""
    groups: dict[str, list[Path]] = {"e2e": [], "rest": []}
    for path in sorted((ROOT / "tests").glob("*/test_*.py")):
        relative = path.relative_to(ROOT)
        if is_heavy(relative):
            groups["e2e" if relative.parts[1] == "e2e" else "rest"].append(relative)
    chains: dict[Path, str] = {}
    for modules in groups.values():
        load = dict.fromkeys(CHAINS, 0.0)
        for module in sorted(modules, key=lambda m: -MODULE_COST_S.get(m.name, DEFAULT_COST_S)):
            lighter = min(CHAINS, key=lambda chain: load[chain])
            chains[module] = lighter
            load[lighter] += MODULE_COST_S.get(module.name, DEFAULT_COST_S)
    return chains


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its chain for a heavy test, else the test itself. Decided from the path alone,
    because xdist's controller schedules node ids and never sees markers."""
    return chain_of_module().get(Path(nodeid.split("::", 1)[0]), nodeid)
