"""A run whose rollout actors are all gone stops instead of waiting for batches nobody can make: the learner's watch
on the registry, and the line the launcher shows for a child that failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.cli.children import root_cause, why_it_failed
from asyncrl.common.wire.messages import Heartbeat
from asyncrl.learner.intake.batch_source import FIRST_SIGHT_S, ActorWatch, NoActorsLeft


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


def test_before_the_first_process_of_a_kind_the_learner_waits_at_least_the_first_sight_grace() -> None:
    """A short ``no_actors_s`` is about processes that are gone: actors still importing vLLM when the learner starts
    have ``FIRST_SIGHT_S`` to show up; once one was seen, the short limit applies. Reward workers get no grace."""
    registry, clock = Registry(), Clock()
    watch = ActorWatch(registry, limit_s=5, clock=clock)
    registry.live = [Heartbeat(process_id="reward-0", kind="reward", state="ready")]
    watch.check()
    clock.now += FIRST_SIGHT_S - 1
    watch.check()  # no actor yet, but still within the grace
    registry.live = [*registry.live, actor()]
    clock.now += 1.0
    watch.check()
    registry.live = registry.live[:1]  # the actor is gone
    clock.now += 1.0
    watch.check()
    clock.now += 5.5
    with pytest.raises(NoActorsLeft, match=r"no rollout actor alive for 5s"):
        watch.check()
    never = ActorWatch(Registry(), limit_s=5, clock=clock)
    never.check()
    clock.now += 6.0
    with pytest.raises(NoActorsLeft, match=r"no reward worker alive for 5s"):
        never.check()


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


def test_the_launcher_line_is_the_whole_cause_without_a_rank_prefix(tmp_path: Path) -> None:
    cause = "CheckpointError: checkpoint not saved: writing /runs/x/.tmp-step-3 " + "x" * 400 + " (run.root)"
    log = tmp_path / "learner.log"
    # the old way a learner died: torch.distributed's excepthook before every line of the traceback it printed
    log.write_text(f"INFO learner started\n[rank0]: Traceback (most recent call last):\n[rank0]: {cause}\n")
    assert root_cause(log) == f"{cause} (the whole log: {log})"  # 478 characters, not cut at 300
    # a command's own last word (cli.util.fail or crash) after its traceback, which ends with a wordier line
    log.write_text(f"Traceback (most recent call last):\nasyncrl.learner.x.{cause}\nerror: {cause}\n")
    assert root_cause(log) == f"{cause} (the whole log: {log})"
    log.write_text("UserWarning: resource_tracker: leaked semaphores\nerror: invalid config: task.options: bad\n")
    assert root_cause(log).startswith("invalid config: task.options: bad (the whole log: ")
    log.write_text("RuntimeError: " + "y" * 5000 + "\n")
    assert root_cause(log).endswith(f"y … (the whole log: {log})")  # a flood is still cut, and says so


def test_an_unhandled_error_is_written_as_one_traceback_then_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncrl.cli.util import crash

    def save() -> None:
        try:
            try:
                raise OSError(28, "No space left on device")
            except OSError:
                raise RuntimeError("unexpected pos 955648\nvs 955536") from None
        except RuntimeError as exc:
            raise ValueError("checkpoint not saved: the disk is full") from exc

    try:
        save()
    except ValueError as exc:
        with pytest.raises(SystemExit) as exited:
            crash(exc)
    assert exited.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and sum("Traceback" in line for line in lines) == 1
    assert lines[-2].startswith("raised from RuntimeError: unexpected pos 955648 vs 955536 (")  # one line each
    assert lines[-2].endswith(", in save)") and sum(line.startswith("raised from") for line in lines) == 1
    assert lines[-1] == "error: ValueError: checkpoint not saved: the disk is full"
