"""How many rollout actors the run wants: the signal an autoscaler follows (``asyncrl_learner_actors_wanted``, read by
KEDA's or the HPA's component in ``k8s/components``).

The prompt queue cannot serve: actors take every group admission releases as soon as it is released, so it stays
near 0 whether actors are short or not. The learner's own clock can. With ``N`` actors, a step of ``T`` seconds in
which the learner waited ``f·T`` for scored groups (``step/idle_fraction``), and a share ``b`` of the actors busy
(generating, loading weights or still starting, against waiting for admission or with nothing to do):

    wanted = ceil(N · b / (1 − f) − TOLERANCE),   at least 1 while the run goes on, 0 once it has finished

The reasoning, for a pipelined run whose actors each add the same generation rate: the learner waits when the actors
need longer to make a batch (``G``) than it needs to train on one (``C``); then ``f = 1 − C/G`` and every actor is
busy (``b = 1``), and ``N/(1 − f) = N·G/C`` actors make a batch in ``C``. When they make it faster, the learner
never waits (``f = 0``) and each actor is busy ``b = G/C`` of the time, so ``N·b`` of them suffice. In a synchronous
run (``staleness.max_staleness = 0``) ``f`` is the generation's share of the step and ``b`` about the same, so the
signal asks for more actors while generation takes longer than training and fewer once it is shorter.

``f`` and ``b`` are averaged over recent steps (:data:`SMOOTHING`), over the actors that are up (``N`` and ``b``
leave out actors still starting their engine). While any actor is starting, the signal holds at the actors there
are: the shortage it measured is being met, and asking again before the new actors generate would ask twice for
the same shortage (and, each round, for more). ``TOLERANCE`` keeps a run that needs 2.1 actors from asking for 3.
The components also cap how fast actors are added (two a minute) and removed (one a minute, after five minutes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from asyncrl.common.wire.messages import Heartbeat

BUSY_STATES = frozenset({"generating", "syncing"})
"""States of an actor that is up and busy: one loading weights is needed, not spare."""
STARTING = "starting"
"""An actor's state while its engine starts (``actors/rollout.py``): not yet counted in the demand."""
SMOOTHING = 0.1
"""Weight of the newest step in the moving averages of ``f`` and ``b`` (about the last ten steps)."""
TOLERANCE = 0.2
"""Actors' worth of demand forgiven before one more is asked for."""
MAX_IDLE = 0.9
"""``f`` is capped here: a learner that waits for everything (no actor yet) asks for ten times the actors, not
infinitely many; the autoscaler's maximum bounds it anyway."""


def actors_wanted(actors: int, busy_share: float, idle_fraction: float) -> int:
    """The module docstring's formula, for a run that goes on (at least 1)."""
    if actors == 0:
        return 1
    demand = actors * busy_share / (1.0 - min(max(idle_fraction, 0.0), MAX_IDLE))
    return max(1, math.ceil(demand - TOLERANCE))


@dataclass
class ActorDemand:
    """The moving averages of the learner's idle fraction and the actors' busy share, one step at a time."""

    idle: float | None = None
    busy: float | None = None
    actors: int = 0

    def observe(self, idle_fraction: float, live: Iterable[Heartbeat]) -> int:
        """Fold in one step (its ``step/idle_fraction`` and the live heartbeats); the actors wanted now."""
        states = [beat.state for beat in live if beat.kind == "actor"]
        up = [state for state in states if state != STARTING]
        self.actors = len(up)
        busy = sum(state in BUSY_STATES for state in up) / len(up) if up else 1.0
        self.idle = _average(self.idle, idle_fraction)
        self.busy = _average(self.busy, busy)
        if len(up) < len(states):  # actors on their way: hold at the count there is until they are up
            return len(states)
        return actors_wanted(self.actors, self.busy, self.idle)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
