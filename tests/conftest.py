"""Shared fixtures and the tiers.

Tiers are selected by marker, never skipped: ``unit`` (no subprocess, no server, no vLLM), ``integration`` (real
processes and servers on loopback), ``e2e`` (the whole system, ``tests/e2e``) and ``soak`` (long variants of
properties a shorter test also checks). A plain run selects unit + integration; ``--slow`` adds e2e (what CI runs);
``--soak`` adds soak. A test's tier is its folder's (``tests/unit``, ``tests/integration``, ``tests/e2e``): a test that
starts a process lives under ``tests/integration``; ``soak`` alone is a marker, on the long variant of a test.
At the end the run prints what it started (vLLM engines, torchrun launches, warm starts, redis-servers) and its
slowest tests. ``bin/test`` runs the whole suite on two xdist workers: one takes every test that starts heavy
processes, one after another; the other the unit tier and the Redis-only modules (:func:`runs_serially`).
"""

from __future__ import annotations

from asyncrl.common.openmp import passive_waits

# As every asyncrl command does, before anything loads torch: the two xdist workers and the processes tests start
# share two cores, and OpenMP threads that spin hold the cores the others need (common/openmp.py).
passive_waits()

import contextlib
import functools
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.actors.vllm_facts import CACHE_DIR_ENV
from asyncrl.common.plane.audit import flush as flush_audit
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.redis_server import EmbeddedRedis
from asyncrl.common.tiny_models import character as tiny_model
from asyncrl.common.tiny_models import chat as tiny_chat_model
from tests.helpers import prefetch
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


TIERS = ("unit", "integration", "e2e")
"""The tiers, each a folder under ``tests/``."""


def tier_of(item: pytest.Item) -> str:
    """``soak`` for a test marked so, else the folder it lives in."""
    if item.get_closest_marker("soak"):
        return "soak"
    folder = Path(str(item.path)).relative_to(ROOT).parts[1]
    assert folder in TIERS, f"{item.nodeid}: a test lives under tests/unit, tests/integration or tests/e2e"
    return folder


SHARED_CORES = {
    # a redis-server or ZeroMQ sockets only
    "test_accounting.py", "test_audit.py", "test_channel.py", "test_control.py", "test_dead_letters.py",
    "test_dispatcher.py", "test_faulted_groups.py", "test_metrics_endpoints.py", "test_metrics_loopback.py",
    "test_replay.py",
    # short command-line runs that exit before any engine, model or sandbox starts; a wheel built and installed
    "test_wheel.py", "test_check_data.py", "test_children.py", "test_cli.py", "test_preflight_cli.py",
    "test_run_file_modes.py", "test_task_file_refused.py", "test_top.py", "test_config_bounds.py", "test_k8s.py",
    "test_plugin_names.py",
    # reward workers whose time limits only ever cut calls that hang for a minute, or serve environments
    "test_reward_worker.py", "test_environment_workers.py", "test_garbage_flood.py",
    # the experiment trackers' own packages writing to disk (W&B's service process included)
    "test_trackers.py",
    # sleeping processes and an actor's sweeper ending them
    "test_lifeline_sweeper.py", "test_actors_gone.py",
    # DeepSpeed engines in the test's own process, offline `rl-learner` runs and two-rank torchruns: training whose
    # checks compare numbers, never a clock
    "test_checkpoint.py", "test_checkpoint_disk.py", "test_critic.py", "test_dpo_offline.py", "test_learner_engine.py",
    "test_learner_ranks.py", "test_lora_engine.py", "test_preset_updates.py",
    # one vLLM engine at a time whose checks compare tokens and numbers, with no deadline under minutes: the token
    # accounting of chat models, a real shape's bf16 run, the model checks (each engine uses about half the two cores
    # the chain's runs leave, measured by the summary's CPU seconds)
    "test_chat_models.py", "test_real_shape.py", "test_check_model.py",
    # the installed vLLM asked what it can take, with no engine
    "test_vllm_facts.py",
    # runs of one actor whose checks read what the run recorded, with faults planted at step numbers or none
    "test_mismatch_guard.py", "test_eval.py",
}
"""Modules whose tests start no sandbox or timed fault (no deadline, TTL or time budget decides what they check) and
at most one vLLM engine at a time: under ``-n 2`` they run beside the serial chain, like the unit tier. Everything else
(other integration modules, the other e2e runs) runs on one worker, one test after another, so no two of them ever
compete for the two cores. Training beside the chain costs its runs a core's share, not their results: every process
sleeps while it waits (``OMP_WAIT_POLICY=PASSIVE``, common/openmp.py), where spinning OpenMP threads once made a 0.4 s
critic test take 14 s beside an e2e run."""


@functools.cache
def runs_serially_in(path: Path) -> bool:
    return path.parts[:2] != ("tests", "unit") and path.name not in SHARED_CORES


def runs_serially(nodeid: str) -> bool:
    """Whether a test joins the one serial chain under ``-n 2``: decided from its path alone, because xdist's
    controller schedules node ids and never sees markers. The unit tier never does (it starts no process)."""
    return runs_serially_in(Path(nodeid.split("::", 1)[0]))


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Load scheduling where every test that :func:`runs_serially` forms one work unit (one worker, in order), each
    other integration module is a unit (its module-scoped servers and models are made once), and every other test is
    a unit of its own (``--dist loadgroup`` groups by renaming node ids, which pytest 9 ignores). An e2e module beside
    the chain is a unit too: its run, a module fixture, is made once."""
    from xdist.scheduler import LoadScopeScheduling

    class SerialChain(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if runs_serially(nodeid):
                return "serial"
            module = nodeid.split("::", 1)[0]
            return module if module.startswith(("tests/integration/", "tests/e2e/")) else nodeid

    return SerialChain(config, log)


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
    items[:] = sorted(kept, key=uses_a_prefetched_model)  # stable: those last, the rest in their order


def uses_a_prefetched_model(item: pytest.Item) -> bool:
    """Whether ``item`` waits for a model built in the background: it runs at the end of the chain, so the build has
    the whole chain to finish in (tests/helpers/prefetch.py)."""
    return any(p.wanted_by([item.nodeid]) for p in prefetch.PREFETCHES)


@pytest.hookimpl(optionalhook=True)  # an xdist hook, in the controller
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """Start, once per session, the background build of each prefetched model a collected test uses."""
    builds = node.config.stash.setdefault(_BUILDS, {})
    root = node.config._tmp_path_factory.getbasetemp()  # the workers' temp folders are inside it
    for wanted in prefetch.PREFETCHES:
        if wanted.name not in builds and wanted.wanted_by(ids):
            builds[wanted.name] = prefetch.start(root, wanted)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller counts every process on the machine
    if CACHE_DIR_ENV not in os.environ:  # the run's own cache of vLLM's facts, not the user's (the workers inherit it)
        os.environ[CACHE_DIR_ENV] = config.stash[_CACHE] = tempfile.mkdtemp(prefix="asyncrl-tests-cache-")
    counter = config.stash[_COUNTER] = StartupCounter().start()
    config.stash[_STARTED] = time.monotonic()
    counter.count_calls(tiny_model, "warm_start", "warm starts")  # the fixtures' in-process warm starts
    counter.count_calls(tiny_chat_model, "warm_start_chat", "warm starts")


def pytest_unconfigure(config: pytest.Config) -> None:
    for build in config.stash.get(_BUILDS, {}).values():
        prefetch.stop(build)
    if cache := config.stash.get(_CACHE, None):
        shutil.rmtree(cache, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_AT_START] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """The teardown report carries the test's CPU seconds (:func:`_cpu_seconds`): the summary's costliest modules."""
    outcome = yield
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        outcome.get_result().user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_AT_START]))


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of every child process it has waited for, with theirs: what a
    test spent, counted when its processes end (a module's shared servers are counted with its last test)."""
    own, children = os.times()[:2], os.times()[2:4]
    return sum(own) + sum(children)


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
    cpu: dict[str, float] = {}
    spans: list[tuple[str, float, float]] = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                spent[report.nodeid] = spent.get(report.nodeid, 0.0) + report.duration
                module = report.nodeid.split("::", 1)[0]
                cpu[module] = cpu.get(module, 0.0) + dict(report.user_properties).get("cpu_s", 0.0)
                if runs_serially(report.nodeid):  # only the serial chain starts engines: the others ran beside it
                    spans.append((report.nodeid, report.start, report.stop))
    engines = counter.by_module("vLLM engines", spans)
    if engines:
        paid = ", ".join(f"{module} {n}" for module, n in engines.most_common())
        terminalreporter.write_line(f"vLLM engines by module: {paid}")
    for nodeid, seconds in sorted(spent.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {nodeid}")
    chain = sum(seconds for nodeid, seconds in spent.items() if runs_serially(nodeid))
    beside = sum(spent.values()) - chain
    terminalreporter.write_line(f"tests' seconds: the serial chain {chain:.0f}, beside it {beside:.0f}")
    terminalreporter.write_line(f"CPU seconds of the tests' processes: {sum(cpu.values()):.0f}; the costliest modules:")
    for module, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        chain = "chain " if runs_serially_in(Path(module)) else "beside"
        terminalreporter.write_line(f"{seconds:8.1f} CPU s  {chain}  {module}")


_COUNTER = pytest.StashKey[StartupCounter]()
_CPU_AT_START = pytest.StashKey[float]()
_STARTED = pytest.StashKey[float]()
_BUILDS = pytest.StashKey[dict]()
_CACHE = pytest.StashKey[str]()


BESIDE_NICE = 10
"""CPU niceness of a test beside the serial chain (and of what it starts) under xdist: when both workers want the two
cores, the chain's tests, some of which check what happens within a time limit, get them first."""


@pytest.fixture(autouse=True)
def _the_chain_comes_first(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under xdist, a test beside the chain runs at :data:`BESIDE_NICE`, one in it at 0 (a worker may run both)."""
    if hasattr(request.config, "workerinput"):
        niceness = 0 if runs_serially(request.node.nodeid) else BESIDE_NICE
        with contextlib.suppress(PermissionError):  # only root may lower it again
            os.setpriority(os.PRIO_PROCESS, 0, niceness)
    yield


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """The unit tier's promise, kept: a unit test that starts a process fails, naming the tier it belongs to."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return

    def refuse(self, *args, **kwargs) -> None:
        raise AssertionError("a unit test starts no process: move it to tests/integration (tests/conftest.py: tiers)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        patch.setattr(os, "fork", refuse)
        yield


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's model, warm-started once per session on one-digit addition to partial skill (about 72% right).
    Tests read it and never write it (runs keep their checkpoints in their own folders)."""
    folder = tmp_path_factory.mktemp("model") / "tiny-arith"
    command = [BIN / "rl-learner", "init-model", ROOT / "configs/demo.toml", "--set", f"model.path={folder}"]
    subprocess.run([*command, "--warm-steps", "120"], check=True, timeout=300)
    return folder


@pytest.fixture(scope="session")
def session_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """One real redis-server with AOF for the session (for each xdist worker), stopped at its end."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("session-redis") / "redis").start()
    try:
        yield server
    finally:
        stop_after_the_audit_trail(server)


@pytest.fixture
def redis_server(session_redis: EmbeddedRedis) -> EmbeddedRedis:
    """The session's redis-server, emptied for this test (``FLUSHALL``): a test that needs only keys of its own pays no
    server start. A test that stops, kills or restarts its server takes :func:`own_redis_server`."""
    if session_redis.process is None or session_redis.process.poll() is not None:
        session_redis.restart()  # a test stopped it after all: the next one still gets a server
    client = connect(session_redis.url)
    try:
        client.flushall()
    finally:
        client.close()
    return session_redis


@pytest.fixture
def own_redis_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A real redis-server with AOF of the test's own, in a temporary folder, stopped after the test."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield server
    finally:
        stop_after_the_audit_trail(server)


def stop_after_the_audit_trail(server: EmbeddedRedis) -> None:
    """Stop ``server`` once this process's audit writer has written what the test recorded to it: a writer left with
    entries for a stopped server retries them for a minute and logs after the test's output is closed."""
    if server.process is not None and server.process.poll() is None:
        client = connect(server.url)
        try:
            flush_audit(5.0, client)
        finally:
            client.close()
    server.stop()


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis):
    client = connect(redis_server.url)
    yield client
    client.close()
