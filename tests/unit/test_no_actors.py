"""A run whose rollout actors are all gone stops instead of waiting for batches nobody can make: the learner's watch
on the registry, and the line the launcher shows for a child that failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.common.wire.messages import Heartbeat
from asyncrl.learner.batch_source import ActorWatch, NoActorsLeft
from asyncrl.learner.children import root_cause, why_it_failed


class Registry:
    """The registry's ``processes()``: the live heartbeats the test sets, and no lost ones."""

    def __init__(self) -> None:
        self.live: list[Heartbeat] = []

    def processes(self) -> tuple[list[Heartbeat], dict[str, str]]:
        return list(self.live), {}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def actor(name: str = "actor-0") -> Heartbeat:
    return Heartbeat(process_id=name, kind="actor", state="ready")


def test_no_actor_for_the_limit_stops_the_run_and_one_in_time_resets_the_clock() -> None:
    registry, clock = Registry(), Clock()
    watch = ActorWatch(registry, limit_s=30, clock=clock)
    watch.check()  # none at the first look: the clock starts (a learner started before its actors)
    for _ in range(20):  # 29 s
        clock.now += 1.45
        watch.check()
    registry.live = [actor(), Heartbeat(process_id="reward-0", kind="reward", state="ready")]
    clock.now += 1.0
    watch.check()
    registry.live = registry.live[1:]  # the actor is gone, the reward worker is not
    for _ in range(20):
        clock.now += 1.45
        watch.check()
    clock.now += 2.5
    with pytest.raises(NoActorsLeft, match=r"learner.no_actors_s"):
        watch.check()


def test_no_reward_worker_for_the_limit_stops_the_run_too() -> None:
    """Actors alive but every reward worker gone: no group can be scored, so the watch stops the run all the same,
    naming the reward workers."""
    registry, clock = Registry(), Clock()
    watch = ActorWatch(registry, limit_s=30, clock=clock)
    registry.live = [actor(), Heartbeat(process_id="reward-0", kind="reward", state="ready")]
    watch.check()
    registry.live = [actor()]
    for _ in range(20):  # 29 s without a reward worker
        clock.now += 1.45
        watch.check()
    clock.now += 2.5
    with pytest.raises(NoActorsLeft, match=r"no reward worker alive for 30s \(learner.no_actors_s\)"):
        watch.check()


def test_zero_turns_the_watch_off_and_the_registry_is_read_once_a_second() -> None:
    registry, clock = Registry(), Clock()
    off = ActorWatch(registry, limit_s=0, clock=clock)
    off.check()
    clock.now += 10**6
    off.check()
    reads = []
    registry.processes = lambda: reads.append(1) or ([], {})  # type: ignore[method-assign]
    watch = ActorWatch(registry, limit_s=30, clock=clock)
    for _ in range(10):
        watch.check()
        clock.now += 0.25
    assert len(reads) == 3  # at 0, 1.0 and 2.0 s


def test_the_root_cause_is_the_last_error_line_that_is_not_a_pointer_back(tmp_path: Path) -> None:
    log = tmp_path / "actor-0.log"
    log.write_text(
        "INFO starting\n"
        "Traceback (most recent call last):\n"
        "RuntimeError: Unsupported CPU attention configuration: head_dim=16\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
    )
    line = root_cause(log)
    assert line.startswith("RuntimeError: Unsupported CPU attention configuration: head_dim=16")
    assert str(log) in line
    (tmp_path / "quiet.log").write_text("just a line\n")
    assert root_cause(tmp_path / "quiet.log").startswith("just a line")
    assert "no log" in root_cause(tmp_path / "missing.log")


def test_a_child_killed_by_a_signal_is_said_to_be_killed_not_what_its_log_ended_with(tmp_path: Path) -> None:
    log = tmp_path / "actor-0.log"
    log.write_text("UserWarning: resource_tracker: There appear to be 1 leaked semaphore objects\n")
    assert why_it_failed(-9, log).startswith("killed by SIGKILL, from outside the run")
    assert why_it_failed(1, log).startswith("UserWarning: resource_tracker")  # an exit status: its log says why
