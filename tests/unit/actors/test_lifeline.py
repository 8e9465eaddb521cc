"""Which processes an actor's vLLM process ends with it, and how vLLM reaches the lifeline (``actors/lifeline.py``)."""

from __future__ import annotations

import tomllib
from importlib import import_module
from pathlib import Path

import pytest

from asyncrl.actors import lifeline

ROOT = Path(__file__).resolve().parents[3]
ACTOR = 4242


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int | None]]:
    """What :func:`lifeline.follow_actor` decided, with no thread watching a real process and nothing killed."""
    calls: list[tuple[str, int, int | None]] = []
    monkeypatch.setattr(lifeline, "_following", None)
    monkeypatch.setattr(lifeline, "_watch", lambda actor, core: calls.append(("watch", actor, core)))
    monkeypatch.setattr(lifeline, "_end", lambda actor, core: calls.append(("end", actor, core)))
    monkeypatch.setenv(lifeline.ACTOR_PID_ENV, str(ACTOR))
    return calls


def family(monkeypatch: pytest.MonkeyPatch, parent: int, grandparent: int) -> None:
    monkeypatch.setattr(lifeline.os, "getppid", lambda: parent)
    monkeypatch.setattr(lifeline, "parent_of", lambda pid: grandparent if pid == parent else 0)


def test_vllm_loads_the_lifeline_as_a_general_plugin_in_every_engine_process() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["vllm.general_plugins"]["asyncrl_lifeline"]
    module, _, function = target.partition(":")
    assert getattr(import_module(module), function) is lifeline.follow_actor


def test_engine_core_watches_the_actor_that_is_its_parent(watched, monkeypatch) -> None:
    family(monkeypatch, parent=ACTOR, grandparent=1)
    lifeline.follow_actor().join(5)
    assert watched == [("watch", ACTOR, None)]  # nothing above it to take down but itself


def test_a_worker_under_engine_core_takes_engine_core_down_with_it(watched, monkeypatch) -> None:
    family(monkeypatch, parent=777, grandparent=ACTOR)
    lifeline.follow_actor().join(5)
    assert watched == [("watch", ACTOR, 777)]


def test_an_orphan_ends_alone_and_never_signals_the_reaper_that_adopted_it(watched, monkeypatch) -> None:
    """The actor is gone before the process looked: its parent is PID 1 (or a subreaper), not EngineCore."""
    family(monkeypatch, parent=1, grandparent=0)
    assert lifeline.follow_actor() is None
    assert watched == [("end", ACTOR, None)]


def test_one_watch_per_process_however_often_it_is_asked(watched, monkeypatch) -> None:
    family(monkeypatch, parent=ACTOR, grandparent=1)
    first = lifeline.follow_actor()
    assert lifeline.follow_actor() is first  # the plugin and the receiver extension both call it
    first.join(5)
    assert watched == [("watch", ACTOR, None)]


def test_nothing_to_follow_outside_an_actors_engine(watched, monkeypatch) -> None:
    monkeypatch.delenv(lifeline.ACTOR_PID_ENV)
    assert lifeline.follow_actor() is None  # any other vLLM in the environment loads the plugin too
    monkeypatch.setenv(lifeline.ACTOR_PID_ENV, str(lifeline.os.getpid()))
    assert lifeline.follow_actor() is None  # the actor itself
    assert watched == []


@pytest.mark.parametrize("engine_core", [None, 777], ids=["engine-core", "worker"])
def test_the_end_takes_this_processs_children_first_then_engine_core_then_itself(monkeypatch, engine_core) -> None:
    """A worker EngineCore was spawning when the actor died has loaded nothing yet (no lifeline of its own): it goes
    with its parent. In a worker, EngineCore goes too; the process itself last."""
    me, killed = lifeline.os.getpid(), []
    monkeypatch.setattr(lifeline, "child_pids", lambda pid: [31, 32] if pid == me else [])
    monkeypatch.setattr(lifeline.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    lifeline._end(ACTOR, engine_core)
    expected = [31, 32, *([engine_core] if engine_core else []), me]
    assert killed == [(pid, lifeline.signal.SIGKILL) for pid in expected]


def test_the_sweeper_kills_what_carries_the_actors_pid_until_none_appears(monkeypatch) -> None:
    """Processes found on successive looks (one being spawned appears late) are all killed; the sweeper never kills
    itself, and stops once nothing has turned up for its quiet time."""
    me, killed = lifeline.os.getpid(), []
    looks = iter([[101, me], [], [102], []])
    monkeypatch.setattr(lifeline, "_marked", lambda marker: next(looks, []))
    monkeypatch.setattr(lifeline.os, "kill", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr(lifeline, "SWEEP_QUIET_S", 0.2)
    assert lifeline.sweep(ACTOR) == 2
    assert killed == [101, 102]
