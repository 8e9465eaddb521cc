"""The actor's sweeper (``actors/lifeline.py``) with real processes: after a ``kill -9`` of the actor it ends every
process started with the actor's PID in its environment, whatever that process is doing, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from asyncrl.actors.lifeline import ACTOR_PID_ENV
from tests.helpers.stack import running
from tests.helpers.waits import wait_for

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_a_kill_9_of_the_actor_ends_every_process_that_carries_its_pid_and_only_those() -> None:
    actor = subprocess.Popen(SLEEPER)  # stands in for the actor: the sweeper only watches its PID
    marked = subprocess.Popen(SLEEPER, env={**os.environ, ACTOR_PID_ENV: str(actor.pid)})
    other = subprocess.Popen(SLEEPER, env={**os.environ, ACTOR_PID_ENV: str(actor.pid + 1)})
    sweeper = subprocess.Popen([sys.executable, "-m", "asyncrl.actors.lifeline", str(actor.pid)])
    try:
        time.sleep(1)  # the sweeper waits on the actor, touching nothing while it lives
        assert marked.poll() is None and sweeper.poll() is None
        actor.kill()
        actor.wait()
        wait_for(lambda: not running(marked.pid), "the marked process to end", timeout_s=20)
        assert sweeper.wait(20) == 0  # done once nothing marked has appeared for a while
        assert other.poll() is None  # another actor's process is left alone
    finally:
        for process in (actor, marked, other, sweeper):
            if process.poll() is None:
                process.kill()
            process.wait()
