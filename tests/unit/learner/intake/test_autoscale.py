"""The actors a run wants (learner/intake/autoscale.py): more while the learner waits for scored groups, fewer while
actors sit spare, never 0 while the run goes on."""

from __future__ import annotations

import pytest

from asyncrl.common.wire.messages import Heartbeat
from asyncrl.learner.intake.autoscale import ActorDemand, actors_wanted


def beats(*states: str) -> list[Heartbeat]:
    actors = [Heartbeat(process_id=f"actor-{i}", kind="actor", state=s) for i, s in enumerate(states)]
    return [*actors, Heartbeat(process_id="reward-0", kind="reward", state="idle")]


@pytest.mark.parametrize(
    ("actors", "busy", "idle", "wanted"),
    [
        (1, 1.0, 0.5, 2),  # the learner waits half its step on one busy actor: two make a batch in its training time
        (2, 1.0, 0.75, 8),
        (4, 1.0, 0.0, 4),  # every actor busy and the learner never waits: just right
        (4, 0.5, 0.0, 2),  # half of them spare
        (4, 0.3, 0.0, 1),  # 1.2 actors' worth: within the tolerance of one
        (3, 1.0, 0.05, 3),  # 3.16: within the tolerance
        (1, 1.0, 1.0, 10),  # waiting for everything: capped, not infinite
        (0, 0.0, 1.0, 1),  # no actor at all: ask for one
        (5, 0.0, 0.0, 1),  # none busy: keep one
    ],
)
def test_the_formula(actors: int, busy: float, idle: float, wanted: int) -> None:
    assert actors_wanted(actors, busy, idle) == wanted


def test_one_slow_actor_asks_for_more_and_enough_actors_do_not() -> None:
    """One actor always generating while the learner waits 60% of each step: it asks for 3 and keeps asking. Three
    actors that keep the learner fed and each sit spare a third of the time ask for no more than they are."""
    short = ActorDemand()
    for _ in range(30):
        wanted = short.observe(0.6, beats("generating"))
    assert wanted == 3
    enough = ActorDemand()
    for step in range(30):
        states = ["generating", "generating", "waiting-weights"]
        wanted = enough.observe(0.0, beats(*states[step % 3 :], *states[: step % 3]))
    assert wanted == 2  # 3 x 2/3 busy


def test_one_steps_dip_moves_the_average_only_a_little() -> None:
    demand = ActorDemand()
    for _ in range(20):
        demand.observe(0.0, beats("generating", "generating"))
    assert demand.observe(0.9, beats("generating", "generating")) == 2  # one step waited 90%: not yet 20 actors


def test_actors_still_starting_hold_the_signal_instead_of_feeding_it() -> None:
    """One busy actor, the learner idle 60%: it asks for 3. Two more start: while they do, it asks for the 3 there
    are, not for 3 x 3 (a starting actor neither counts as busy nor as demand met). Once they are up and keep the
    learner fed, it asks for what they use."""
    demand = ActorDemand()
    for _ in range(30):
        wanted = demand.observe(0.6, beats("generating"))
    assert wanted == 3
    for _ in range(30):
        assert demand.observe(0.6, beats("generating", "starting", "starting")) == 3
    for _ in range(60):
        wanted = demand.observe(0.0, beats("generating", "generating", "generating"))
    assert wanted == 3
