"""Environments in their own process (``environment.isolation = "process"``, the default): one that crashes the
process, hangs, asks for more memory than ``environment.max_memory_mb`` or returns garbage ends its own episode as an
environment error — the process that drives the episodes (here the test, as an actor would) goes on, the next
episode gets a working environment, and the reward worker's replay through the same kind of process scores it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from asyncrl.actors.environment_host import EnvironmentHost
from asyncrl.actors.episodes import close_environment_hosts, environment_host
from asyncrl.common.config import load_config
from asyncrl.common.environments.protocol import EnvironmentFailed
from asyncrl.common.environments.turns import segments
from asyncrl.common.observability.procs import child_pids
from tests.helpers.scripted_episodes import episode, replay, tools_for
from tests.helpers.stack import running

pytestmark = pytest.mark.integration
TOOLS = tools_for("qwen2")
HOSTED = ("environment.isolation=process", "environment.step_timeout_s=2", "environment.max_memory_mb=512")


@pytest.fixture(autouse=True, scope="module")
def _hosts_end_with_the_module():
    yield
    close_environment_hosts()


def hosted(how: str) -> tuple[str, ...]:
    return (*HOSTED, "environment.name=tests.helpers.episodes:Misbehaving", f"environment.options={{how='{how}'}}")


@pytest.mark.parametrize("how", ["crash", "hang", "hog", "garbage"])
def test_an_environment_that_misbehaves_in_its_process_ends_only_its_episode(how: str) -> None:
    rollout, engine, turn = episode(TOOLS, ["first", "second"], *hosted(how))
    assert len(engine.prompts) == 1 and rollout.trained(0).all()  # the first turn kept, nothing after it
    assert replay(TOOLS, rollout, turn) == 0.0  # the replay meets the same failure: the episode scores 0
    host = environment_host(turn.environment)
    fine, engine, turn = episode(TOOLS, ["first", "second", "third"], *hosted("fine"), "environment.max_turns=3")
    assert [t for _, _, t in segments(fine.trained(0))] == [True, False, True, False, True]  # a new one works
    assert replay(TOOLS, fine, turn) == 3.0
    if how == "crash":
        assert host.restarts >= 1


def test_what_an_environment_prints_never_reaches_the_answers() -> None:
    """Lines written straight to descriptor 1 (as a C library or a subprocess would), some of them valid JSON."""
    rollout, _, turn = episode(TOOLS, ["first", "second", "third"], *hosted("prints"), "environment.max_turns=3")
    assert [t for _, _, t in segments(rollout.trained(0))] == [True, False, True, False, True]
    assert replay(TOOLS, rollout, turn) == 3.0


def test_the_environments_process_ends_with_the_process_it_serves() -> None:
    """Killed with -9, the parent cannot stop its child: the child ends when its stdin closes."""
    script = (
        "import asyncio, sys, time\n"
        "from asyncrl.actors.environment_host import EnvironmentHost, HostedEnvironment\n"
        "from asyncrl.common.config import load_config\n"
        "from asyncrl.common.environments.protocol import EpisodeRow\n"
        "section = load_config(None, ['environment.name=calculator']).environment\n"
        "asyncio.run(HostedEnvironment.open(EnvironmentHost(section), EpisodeRow('', '1')))\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        [child] = child_pids(parent.pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = running(child)
        assert not alive, "the environments' process outlived the process it served"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_host_refuses_an_unknown_environment_by_name() -> None:
    section = load_config(None, ["environment.name=calculator"]).environment.model_copy(update={"name": "nowhere"})
    host = EnvironmentHost(section)
    try:
        with pytest.raises(Exception, match="unknown environment 'nowhere'"):
            row = {"prompt": "", "answer": ""}
            asyncio.run(host.call_async("make", episode="e1", name="nowhere", options={}, row=row))
    finally:
        host.close()


def test_a_process_that_stops_reading_costs_a_step_its_limit_and_is_replaced() -> None:
    """A frozen process (SIGSTOP: as one whose environment holds the interpreter) stops reading its requests; once its
    pipe is full a write would block. The write waits off the event loop: the step fails at its limit, the loop goes
    on meanwhile, the process is replaced, and the next request is answered by the new one."""
    section = load_config(None, ["environment.name=calculator", "environment.step_timeout_s=1"]).environment
    host = EnvironmentHost(section)
    row = {"prompt": "", "answer": "1"}

    async def frozen_then_fine() -> tuple[str, int]:
        await host.call_async("make", episode="e1", name="calculator", options={}, row=row)
        frozen = host._child.proc.pid
        os.kill(frozen, signal.SIGSTOP)
        watchdog = threading.Timer(20, lambda: running(frozen) and os.kill(frozen, signal.SIGKILL))
        watchdog.start()  # were the write made on the event loop, this would be what ends it (and the test fails)
        ticks = 0

        async def tick() -> None:  # the event loop keeps running while the write waits
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticking = asyncio.create_task(tick())
        with pytest.raises(EnvironmentFailed) as failed:
            await host.call_async("step", episode="e1", action="x" * 2**20)  # far past a pipe's buffer
        ticking.cancel()
        watchdog.cancel()
        assert host._child is None or host._child.proc.pid != frozen
        await host.call_async("make", episode="e2", name="calculator", options={}, row=row)
        assert host._child.proc.pid != frozen and not running(frozen)  # killed, and a new one answered
        return str(failed.value), ticks

    try:
        message, ticks = asyncio.run(frozen_then_fine())
        assert "took no request for 1 s" in message and ticks >= 10, (message, ticks)
        assert host.restarts == 1
    finally:
        host.close()


def frozen_at_start(host: EnvironmentHost, thaw_after_s: float | None) -> list[int]:
    """Every child ``host`` starts is stopped (SIGSTOP) before it can say it is ready, and let go (SIGCONT)
    ``thaw_after_s`` later, as a machine too loaded to start a Python process at once would; the children's pids."""
    pids: list[int] = []
    start = host._start_child

    def start_frozen():
        child = start()
        os.kill(child.proc.pid, signal.SIGSTOP)
        pids.append(child.proc.pid)
        if thaw_after_s is not None:
            threading.Timer(
                thaw_after_s, lambda: running(child.proc.pid) and os.kill(child.proc.pid, signal.SIGCONT)
            ).start()
        return child

    host._start_child = start_frozen
    return pids


def test_a_slow_start_of_the_process_is_not_charged_to_the_first_request() -> None:
    """The request's limit (1 s here) is the environment's own time: a child that takes 3 s to start still makes it."""
    section = load_config(None, ["environment.name=calculator", "environment.step_timeout_s=1"]).environment
    host = EnvironmentHost(section)
    pids = frozen_at_start(host, thaw_after_s=3)
    try:
        row = {"prompt": "", "answer": "1"}
        asyncio.run(host.call_async("make", episode="e1", name="calculator", options={}, row=row))
        assert len(pids) == 1 and host.restarts == 0
    finally:
        host.close()


def test_a_process_that_never_starts_fails_the_request_naming_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("asyncrl.actors.environment_host.START_TIMEOUT_S", 1.0)
    section = load_config(None, ["environment.name=calculator", "environment.step_timeout_s=1"]).environment
    host = EnvironmentHost(section)
    pids = frozen_at_start(host, thaw_after_s=None)
    try:
        row = {"prompt": "", "answer": "1"}
        with pytest.raises(EnvironmentFailed, match="did not start within 1 s"):
            asyncio.run(host.call_async("make", episode="e1", name="calculator", options={}, row=row))
        assert not running(pids[0])  # killed, not left stopped
    finally:
        host.close()
