"""Environments in their own process (``environment.isolation = "process"``, the default): one that crashes the
process, hangs, asks for more memory than ``environment.max_memory_mb`` or returns garbage ends its own episode as an
environment error — the process that drives the episodes (here the test, as an actor would) goes on, the next
episode gets a working environment, and the reward worker's replay through the same kind of process scores it.
The process is fenced off from the one it serves: an environment that tries to kill, trace or write into it ends
only its own process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl.actors.environments import fence as environment_fence
from asyncrl.actors.environments.host import EnvironmentHost
from asyncrl.actors.episodes import close_environment_hosts, environment_host
from asyncrl.common.config import load_config
from asyncrl.common.environments.protocol import EnvironmentFailed
from asyncrl.common.observability.procs import child_pids
from asyncrl.common.wire.messages import segments
from tests.helpers.scripted_episodes import episode, replay, tools_for
from tests.helpers.stack import running

TOOLS = tools_for("qwen2")
HOSTED = ("environment.isolation=process", "environment.step_timeout_s=5", "environment.max_memory_mb=512")


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


def test_an_environment_imports_what_asyncrl_never_loaded_under_the_umask_of_every_command() -> None:
    """Every asyncrl command runs with umask 077 (common/private.py); behind the fence, the folders on the way to the
    interpreter's own library (under ``/root`` on this machine) stay enterable by the host's uid all the same."""
    previous = os.umask(0o077)
    try:
        rollout, _, turn = episode(TOOLS, ["first"], *HOSTED, "environment.name=tests.helpers.stdlib_environment:Hues")
    finally:
        os.umask(previous)
    assert rollout.finish_reasons[0] != "environment_error", rollout.finish_reasons
    assert replay(TOOLS, rollout, turn) == 1.0


def test_what_an_environment_prints_never_reaches_the_answers() -> None:
    """Lines written straight to descriptor 1 (as a C library or a subprocess would), some of them valid JSON."""
    rollout, _, turn = episode(TOOLS, ["first", "second", "third"], *hosted("prints"), "environment.max_turns=3")
    assert [t for _, _, t in segments(rollout.trained(0))] == [True, False, True, False, True]
    assert replay(TOOLS, rollout, turn) == 3.0


def test_the_environments_process_ends_with_the_process_it_serves() -> None:
    """Killed with -9, the parent cannot stop its child: the child ends when its stdin closes."""
    script = (
        "import asyncio, sys, time\n"
        "from asyncrl.actors.environments.host import EnvironmentHost, HostedEnvironment\n"
        "from asyncrl.common.config import load_config\n"
        "from asyncrl.common.environments.protocol import EpisodeRow\n"
        "section = load_config(None, ['environment.name=calculator']).environment\n"
        # held, as an actor holds its host: the child was started on the host's writer thread, and its parent-death
        # signal follows that thread, which ends when a host nobody holds is collected
        "hosted = asyncio.run(HostedEnvironment.open(EnvironmentHost(section), EpisodeRow('', '1')))\n"
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
        stop_group(host, signal.SIGSTOP)
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
        os.killpg(child.proc.pid, signal.SIGSTOP)  # its session: the launcher and the child behind it
        pids.append(child.proc.pid)
        if thaw_after_s is not None:
            threading.Timer(
                thaw_after_s, lambda: running(child.proc.pid) and os.killpg(child.proc.pid, signal.SIGCONT)
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
    monkeypatch.setattr("asyncrl.actors.environments.host.START_TIMEOUT_S", 1.0)
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


def stop_group(host: EnvironmentHost, sig: signal.Signals) -> None:
    """``sig`` to a child's session: its launcher and the child itself (behind a fence, a process in a PID namespace
    of its own whose pid here is not the launcher's)."""
    os.killpg(host._child.proc.pid, sig)


# --------------------------------------------------------------------------- the fence

ACTOR = """
import json, os, sys
from prometheus_client import REGISTRY
from asyncrl.actors.episodes import environment_host
from tests.helpers.scripted_episodes import episode, tools_for

hows, victim_file, fence = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
if fence == "user-namespaces":  # the fence of an actor that is not root, on a machine where this one is
    from asyncrl.actors.environments import fence as environment_fence
    from asyncrl.common.sandbox.fences import host_candidates
    fence, environment_fence._FENCES["auto"] = "auto", host_candidates(network=True)[1]
tools, said = tools_for("qwen2"), {}
for how in hows:  # one attack after another, each on the host of its own options, each followed by a fine episode
    options = {"how": how, "victim": os.getpid(), "victim_pidns": os.readlink("/proc/self/ns/pid"), "file": victim_file}
    table = "{" + ", ".join(f"{key} = {json.dumps(value)}" for key, value in options.items()) + "}"
    settings = ("environment.isolation=process", "environment.step_timeout_s=20", f"environment.fence={fence}",
                "environment.name=tests.helpers.hostile_environments:Hostile", f"environment.options={table}")
    ended = lambda: REGISTRY.get_sample_value("asyncrl_actor_episode_endings_total", {"ending": "environment_error"})
    before = ended() or 0.0
    attacked, _, turn = episode(tools, ["first", "second"], *settings, answer="attack")
    fine, _, _ = episode(tools, ["first", "second"], *settings, answer="42")
    said[how] = {"attacked": attacked.finish_reasons[0], "fine": fine.finish_reasons[0], "errors": ended() - before,
                 "fine_turns": int(sum(fine.trained(0)[1:] != fine.trained(0)[:-1]) + 1),
                 "restarts": environment_host(turn.environment).restarts}
    print(json.dumps(said), flush=True)
"""


def play_the_actor(hows: str, victim_file: Path, fence: str = "auto") -> tuple[int, dict, str]:
    """Run :data:`ACTOR`, a disposable process that plays the actor (the host's parent and the attacks' victim) and
    meets the attacks ``hows`` (comma-separated) in turn: (its exit status, what it said of each attack it lived
    through, its stderr). Were the fence gone, the victim is that process, not pytest."""
    actor = subprocess.run([sys.executable, "-c", ACTOR, hows, str(victim_file), fence], capture_output=True,
                           text=True, timeout=240, check=False)
    lines = actor.stdout.strip().splitlines()
    return actor.returncode, json.loads(lines[-1]) if lines else {}, actor.stderr


@pytest.fixture
def victim_file() -> Path:
    """A file of the actor's, 0600 in a 0700 folder, as the run folder's are (outside the temporary folder, whose
    fenced view is the host's own)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="asyncrl-victim-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    path = folder / "state"
    path.write_text("the actor's")
    path.chmod(0o600)
    yield path
    shutil.rmtree(folder)


ATTACKS = ("kill_parent", "kill_all", "trace")


@pytest.mark.parametrize("fence", ["auto", "user-namespaces"])
def test_an_environment_cannot_kill_trace_or_write_into_the_actor(fence: str, victim_file: Path) -> None:
    """A step that kills its parent (and the actor's pid), kills every process it may (``kill(-1, 9)``), or traces or
    writes into the actor (one actor meets the three in turn): the actor lives, each attacked episode ends as an
    environment error, the host that ended itself is replaced at the next make, and the next episode runs to its turn
    limit. Behind this machine's fence, and behind the user-namespace fence of an actor that is not root."""
    if fence == "user-namespaces" and os.geteuid() != 0:
        fence = "auto"  # which is that fence: the test above says so
    status, results, stderr = play_the_actor(",".join(ATTACKS), victim_file, fence)
    assert status == 0, f"the actor died (exit {status}) after {list(results)}: {stderr[-2000:]}"
    assert "ESCAPED" not in stderr, stderr[-2000:]
    assert list(results) == list(ATTACKS), results
    for how, result in results.items():
        assert result["attacked"] == "environment_error" and result["errors"] == 1.0, (how, result)
        assert result["restarts"] >= 1, (how, result)
        assert result["fine"] == "max_turns" and result["fine_turns"] == 7, (how, result)  # 4 model turns, 3 answers
    assert victim_file.read_text() == "the actor's"


def test_without_the_fence_the_attack_reaches_the_actor(victim_file: Path) -> None:
    """What the fence stops, shown on the disposable actor: with ``environment.fence = "none"`` its step kills it."""
    status, _, _ = play_the_actor("kill_parent", victim_file, fence="none")
    assert status == -signal.SIGKILL


def test_the_fence_here_is_the_strongest_this_machine_has() -> None:
    """Root with namespaces (CI, this test's machines) gets a uid of its own; any other user a user namespace. A
    machine that allows neither fails here rather than passing unfenced."""
    fence = environment_fence.host_fence("auto")
    assert fence.fence == ("namespaces" if os.geteuid() == 0 else "user-namespaces"), fence
    assert not fence.refused, fence
