"""Environments people already have: skyrl-gym and TextArena.

Each needs its package (``pip install 'asyncrl[envs]'``), imported only when a run uses it:

==================  ===========  ==========================================================================
name                kind         what it is
==================  ===========  ==========================================================================
``skyrl_gym``       environment  a skyrl-gym ``BaseTextEnv`` by id (``environment.options``: ``env``,
                                 ``env_config``, ``extras``); the row's answer is its ``ground_truth``
``textarena``       environment  the game a ``textarena`` task row opened (``common/data/gyms.py``), replayed
                                 from its seed: each step's new observation, the game's reward for player 0
                                 at the end
==================  ===========  ==========================================================================

The names are registered in ``common/environments/protocol.py`` by import path, so nothing here is imported by a
run that does not use it.
"""

from __future__ import annotations

import json
from typing import Any

from asyncrl.common.data.gyms import TEXTARENA_LOCK, gym_package, textarena_game
from asyncrl.common.environments.protocol import EpisodeRow, Step

# --------------------------------------------------------------------------- skyrl-gym


class SkyRLGym:
    """A skyrl-gym environment (``environment.options.env``, e.g. ``gsm8k_multi_turn``): its per-turn rewards are the
    episode's reward. It is given the row's fields as ``extras``, with ``reward_spec.ground_truth`` = the row's answer
    unless the row has a ``reward_spec``. Its ``init`` runs, but the prompt it may return is not used: the prompt is
    the row's, as the learner made it."""

    def __init__(self, row: EpisodeRow, options: dict[str, Any]) -> None:
        gym = gym_package("skyrl_gym", "environment 'skyrl_gym'")
        extras = {"reward_spec": {"ground_truth": row.answer}, "extra_info": {}, **row.extra}
        extras |= options.get("extras", {})
        self.env = gym.make(options["env"], env_config=options.get("env_config", {}), extras=extras)
        self.env.init([{"role": "user", "content": row.prompt}])

    def step(self, action: str) -> Step:
        out = self.env.step(action)
        return Step(observation=list(out["observations"]), reward=float(out["reward"]), done=bool(out["done"]))

    def score(self) -> float:
        return 0.0


# --------------------------------------------------------------------------- TextArena


class TextArenaGame:
    """The game a :class:`TextArenaTask` row opened, replayed from its seed: each step answers with what the game
    added to its observation; at the end, the game's reward for player 0 is the episode's."""

    def __init__(self, row: EpisodeRow, options: dict[str, Any]) -> None:
        opening = json.loads(row.answer)
        self.env = textarena_game(opening["game"], opening["seed"])
        _, self.seen = self.env.get_observation()
        self.reward = 0.0

    def step(self, action: str) -> Step:
        with TEXTARENA_LOCK:
            done, _ = self.env.step(action)
        if done:
            rewards, _ = self.env.close()
            self.reward = float(rewards.get(0, 0.0))
            return Step(done=True)
        _, observation = self.env.get_observation()
        new = observation[len(self.seen) :] if observation.startswith(self.seen) else observation
        self.seen = observation
        return Step(observation=[{"role": "user", "content": new.strip() or "(the game says nothing new)"}])

    def score(self) -> float:
        return self.reward
