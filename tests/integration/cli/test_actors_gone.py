"""``rl-launch run`` never starts a rollout actor again: once every actor it started has exited, the run stops at once
(it once waited ``learner.no_actors_s``, 300 s, with nothing on screen) — unless the run finished (its actors exit
then) or an actor started by hand still serves it. Real child processes and the run's real Redis."""

from __future__ import annotations

import subprocess
import sys

from asyncrl.cli.children import ActorsGone
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.wire.messages import Heartbeat


def _actors(lives: list[bool]) -> dict[str, subprocess.Popen]:
    """Child processes named as the launcher names its actors: one that lasts for each True, one that has exited for
    each False (the launcher's own children, without making this process a subreaper as ``Children`` does)."""
    procs = {}
    for i, lasts in enumerate(lives):
        code = "import time; time.sleep(60)" if lasts else "pass"
        procs[f"actor-{i}"] = subprocess.Popen([sys.executable, "-c", code])
    for proc, lasts in zip(procs.values(), lives, strict=True):
        if not lasts:
            proc.wait(30)
    return procs


def test_the_run_has_no_actor_once_every_launched_one_exited(redis_server, redis_client) -> None:
    procs = _actors([False, True])
    try:
        gone = ActorsGone(procs, 2, redis_server.url, "run")
        assert not gone.all_gone()  # actor-1 lives
    finally:
        procs["actor-1"].kill()
        procs["actor-1"].wait()
    assert gone.all_gone()
    plane = ControlPlane(redis_client, "run")
    plane.registry.beat(Heartbeat(process_id="actor-9", kind="actor", state="ready"), ttl_s=30)
    assert not gone.all_gone()  # one started by hand serves the run
    plane.registry.leave("actor-9")
    assert gone.all_gone()
    plane.run.mark_finished(4)
    assert not gone.all_gone()  # a finished run's actors exit by themselves


def test_a_run_launched_with_no_actor_never_stops_for_that(redis_server) -> None:
    assert not ActorsGone(_actors([]), 0, redis_server.url, "run").all_gone()
