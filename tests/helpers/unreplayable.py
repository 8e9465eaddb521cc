"""An environment that cannot be replayed (``replayable = False``): what it says comes from the operating system's
random source, never from the episode's seed, so no second run of it gives the same observations, rewards or score.
Named by import path in the run config (the reward worker that runs it needs the repository on ``PYTHONPATH``)."""

from __future__ import annotations

import random
import secrets
from typing import Any

from asyncrl.environments import EpisodeRow, Step

ENOUGH = "enough"
"""A turn that says it ends the episode."""


class Dice:
    """Rolls a die for every turn until the model says :data:`ENOUGH`; each turn's reward and the score are random."""

    replayable = False

    def __init__(self, row: EpisodeRow, options: dict[str, Any]) -> None:
        self.rolls: list[int] = []
        self.random = random.SystemRandom()

    def step(self, action: str) -> Step:
        reward = round(self.random.uniform(-1.0, 1.0), 6)
        if ENOUGH in action:
            return Step(reward=reward, done=True)
        self.rolls.append(secrets.randbelow(6) + 1)
        said = f"The die shows {self.rolls[-1]} (draw {secrets.token_hex(4)}). Roll again, or say {ENOUGH}."
        return Step(observation=[{"role": "user", "content": said}], reward=reward)

    def score(self) -> float:
        return sum(self.rolls) / 10 + self.random.random()
