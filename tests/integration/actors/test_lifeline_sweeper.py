"""The actor's sweeper (``actors/lifeline.py``) with real processes: after a ``kill -9`` of the actor it ends every
process started with the actor's PID in its environment — also one that renamed itself as vLLM's processes do — and
nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from asyncrl.actors.lifeline import ACTOR_PID_ENV
from tests.helpers.stack import running
from tests.helpers.waits import wait_for

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
ACTOR = """
import subprocess, sys, time
from asyncrl.actors.lifeline import export_actor_pid, start_sweeper
export_actor_pid()
start_sweeper()
# as vLLM's EngineCore: started by a fresh exec, then renamed (setproctitle rewrites the memory after argv)
code = "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); time.sleep(600)"
engine = subprocess.Popen([sys.executable, "-c", code])
print(engine.pid, flush=True)
time.sleep(600)
"""


def test_a_kill_9_of_the_actor_ends_every_process_that_carries_its_pid_and_only_those() -> None:
    actor = subprocess.Popen([sys.executable, "-c", ACTOR], stdout=subprocess.PIPE, text=True)
    engine = int(actor.stdout.readline())
    other = subprocess.Popen(SLEEPER, env={**os.environ, ACTOR_PID_ENV: str(actor.pid + 1)})
    try:
        wait_for(lambda: Path(f"/proc/{engine}/cmdline").read_bytes().startswith(b"VLLM::"), "the engine's title")
        assert running(engine) and actor.poll() is None
        actor.kill()
        actor.wait()
        wait_for(lambda: not running(engine), "the renamed engine process to end", timeout_s=20)
        assert other.poll() is None  # another actor's process is left alone
    finally:
        for process in (actor, other):
            if process.poll() is None:
                process.kill()
            process.wait()
        if running(engine):
            os.kill(engine, 9)


CLEAN_ACTOR = """
import subprocess, sys
from asyncrl.actors.lifeline import engine_shut_down, export_actor_pid, start_sweeper
export_actor_pid()
start_sweeper()
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # still exiting, as it were
print(engine.pid, flush=True)
sys.stdin.readline()
if sys.argv[1] == "clean":
    engine_shut_down()
"""


def test_after_an_orderly_engine_shutdown_what_is_left_is_ended_without_an_error() -> None:
    """An actor (or an offline eval) whose engine shut down in order, exiting while the engine's last process still
    exits: the sweeper ends it and says nothing; the same exit without the shutdown is logged as the error it is."""
    for how, says_error in (("clean", False), ("crash", True)):
        actor = subprocess.Popen(
            [sys.executable, "-c", CLEAN_ACTOR, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        engine = int(actor.stdout.readline())
        try:
            _, said = actor.communicate("\n", timeout=60)  # returns once the sweeper, which shares stderr, is done
            wait_for(lambda e=engine: not running(e), "the left engine process to end", timeout_s=20)
            assert ("the rollout actor is gone" in said) == says_error, (how, said)
        finally:
            if running(engine):
                os.kill(engine, 9)
