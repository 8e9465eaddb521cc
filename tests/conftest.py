"""Shared fixtures and the tiers.

Tiers are selected by marker, never skipped: ``unit`` (no subprocess, no server, no vLLM), ``integration`` (real
processes and servers on loopback), ``e2e`` (the whole system, ``tests/e2e``) and ``soak`` (long variants of
properties a shorter test also checks). A plain run selects unit + integration; ``--slow`` adds e2e (what CI runs);
``--soak`` adds soak. A test's tier is its folder's unless it is marked ``integration`` or ``soak`` itself.
At the end the run prints what it started (vLLM engines, torchrun launches, warm starts, redis-servers) and its
slowest tests. ``bin/test`` runs the whole suite on two xdist workers: each takes one chain of the tests that start
heavy processes, one after another, and both share the unit tier and the Redis-only modules
(``tests/helpers/chains.py``).
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import tiny_chat_model, tiny_model
from common.keys import connect
from common.redis_server import EmbeddedRedis
from tests.helpers.chains import work_unit
from tests.helpers.costs import StartupCounter

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LIMIT_S = {"unit": 300, "integration": 900, "e2e": 1800, "soak": 3600}
"""Each tier's per-test limit (pytest-timeout), unless a test sets its own: above the longest wait inside its tests."""
SLOWEST = 15


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run the e2e tier (CI does)")
    parser.addoption("--soak", action="store_true", help="also run the soak tier (long variants)")


def tier_of(item: pytest.Item) -> str:
    if item.get_closest_marker("soak"):
        return "soak"
    if "e2e" in Path(str(item.path)).relative_to(ROOT).parts:
        return "e2e"
    if item.get_closest_marker("integration") or "integration" in Path(str(item.path)).parts:
        return "integration"
    return "unit"


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Load scheduling over the work units of :func:`tests.helpers.chains.work_unit`: two chains of heavy tests, one
    per worker, and every other test a unit of its own (``--dist loadgroup`` groups by renaming node ids, which
    pytest 9 ignores)."""
    from xdist.scheduler import LoadScopeScheduling

    class Chains(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Chains(config, log)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups and before `-m` reads the tiers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = {"unit", "integration"}
    wanted |= {"e2e"} if config.getoption("--slow") else set()
    wanted |= {"soak"} if config.getoption("--soak") else set()
    kept, dropped = [], []
    for item in items:
        tier = tier_of(item)
        item.add_marker(tier)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LIMIT_S[tier]))
        (kept if tier in wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller counts every process on the machine
    counter = config.stash[_COUNTER] = StartupCounter().start()
    config.stash[_STARTED] = time.monotonic()
    counter.count_calls(tiny_model, "warm_start", "warm starts")  # the fixtures' in-process warm starts
    counter.count_calls(tiny_chat_model, "warm_start_chat", "warm starts")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The run's own cost: the start-ups it paid and its slowest tests (set-up, call and teardown together)."""
    counter = config.stash.get(_COUNTER, None)
    if counter is None:
        return
    counter.stop()
    terminalreporter.section("cost of this run")
    for line in counter.report(config.stash[_STARTED]):
        terminalreporter.write_line(line)
    spent: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                spent[report.nodeid] = spent.get(report.nodeid, 0.0) + report.duration
    for nodeid, seconds in sorted(spent.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {nodeid}")


_COUNTER = pytest.StashKey[StartupCounter]()
_STARTED = pytest.StashKey[float]()


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """The unit tier's promise, kept: a unit test that starts a process fails, naming the tier it belongs to."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return

    def refuse(self, *args, **kwargs) -> None:
        raise AssertionError("a unit test starts no process: mark it `integration` (tests/conftest.py: tiers)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        patch.setattr(os, "fork", refuse)
        yield


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's model, warm-started once per session on one-digit addition to partial skill (about 40% right).
    Tests read it and never write it (runs keep their checkpoints in their own folders)."""
    folder = tmp_path_factory.mktemp("model") / "tiny-arith"
    command = [BIN / "rl-learner", "init-model", ROOT / "configs/demo.toml", "--set", f"model.path={folder}"]
    subprocess.run([*command, "--warm-steps", "120"], check=True, timeout=300)
    return folder


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A real redis-server with AOF in a temporary folder, stopped after the test."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis):
    client = connect(redis_server.url)
    yield client
    client.close()
