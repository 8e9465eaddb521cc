"""Reward functions for the reward-worker tests, named in a run config by import path.

``tests.helpers.slow_rewards:stall`` with options ``{stall = "prefix", seconds = 2.0, log = "/path"}``
appends each call's group id to ``log`` (so a test can count attempts and see a call begin), sleeps
``seconds`` when the group id starts with ``stall``, refuses a group whose id starts with ``forged`` as a replay
refuses a forged episode (:class:`asyncrl.actors.episode_scoring.EpisodeMismatch`), and scores every response 1.0.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from asyncrl.common.wire.messages import RolloutGroup


def stall(group: RolloutGroup, options: dict[str, Any]) -> list[float]:
    if options.get("log"):
        with Path(options["log"]).open("a") as log:
            log.write(group.group_id + "\n")
    if group.group_id.startswith(options.get("stall", "stall")):
        time.sleep(float(options.get("seconds", 60)))
    if group.group_id.startswith("forged"):
        from asyncrl.actors.episode_scoring import EpisodeMismatch

        raise EpisodeMismatch("an environment turn differs from the environment's observation")
    return [1.0] * group.num_samples


def constant(group: RolloutGroup, options: dict[str, Any]) -> list[float]:
    """``options["value"]`` (default 0.25) for every response."""
    return [float(options.get("value", 0.25))] * group.num_samples
