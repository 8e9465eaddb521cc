"""An environment whose module imports a standard-library module that asyncrl itself never imports (``colorsys``):
in an environment's host it is read from the interpreter's own library folder, behind the fence."""

from __future__ import annotations

import colorsys
from typing import Any

from asyncrl.environments import EpisodeRow, Step


class Hues:
    """Answers a turn with the hue of pure red, and ends the episode."""

    def __init__(self, row: EpisodeRow, options: dict[str, Any]) -> None:
        self.turns = 0

    def step(self, action: str) -> Step:
        self.turns += 1
        hue = colorsys.rgb_to_hsv(1.0, 0.0, 0.0)[0]
        return Step(observation=[{"role": "user", "content": f"hue {hue}"}], reward=1.0, done=True)

    def score(self) -> float:
        return 0.0
