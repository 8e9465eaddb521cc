"""Adapters for tasks and environments people already have: reasoning-gym, skyrl-gym and TextArena.

Each needs its package (``pip install 'asyncrl[envs]'``), imported only when a run uses it:

==================  ===========  ==========================================================================
name                kind         what it is
==================  ===========  ==========================================================================
``reasoning_gym``   task         a reasoning-gym procedural dataset (``task.options``: ``dataset``, ``size``,
                    + verifier   ``seed``, ``config``), scored by the dataset's own ``score_answer``
``skyrl_gym``       environment  a skyrl-gym ``BaseTextEnv`` by id (``environment.options``: ``env``,
                                 ``env_config``, ``extras``); the row's answer is its ``ground_truth``
``textarena``       task         the opening of a single-player TextArena game (``task.options``: ``game``,
                    + environ-   ``seeds``), then the game itself as the environment: each step's new
                    ment         observation, the game's reward for player 0 at the end
==================  ===========  ==========================================================================

The names are registered in ``common/data/tasks.py``, ``common/environments/protocol.py`` and
``common/rewards/verifiers.py`` by import path, so nothing here is imported by a run that does not use it.
"""

from __future__ import annotations

import functools
import importlib
import json
import random
import re
import threading
from typing import Any, ClassVar

from asyncrl.common.data.tasks import Task, TaskExample
from asyncrl.common.environments.protocol import EpisodeRow, Step

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _package(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{what} needs the {module} package: pip install 'asyncrl[envs]'") from None


# --------------------------------------------------------------------------- reasoning-gym


@functools.lru_cache(maxsize=16)
def _reasoning_dataset(name: str, seed: int, size: int, config: str) -> Any:
    rg = _package("reasoning_gym", "task 'reasoning_gym'")
    try:
        return rg.create_dataset(name, seed=seed, size=size, **json.loads(config))
    except Exception as exc:  # an unknown dataset or a bad config option
        raise ValueError(f"task 'reasoning_gym': dataset {name!r}: {type(exc).__name__}: {exc}") from None


class ReasoningGymTask(Task):
    """Rows of a reasoning-gym dataset, drawn at random; the answer records which row (the verifier rebuilds it)."""

    name: ClassVar[str] = "reasoning_gym"

    def __init__(self, dataset: str, size: int = 10000, seed: int = 0, config: dict[str, Any] | None = None) -> None:
        self.key = {"dataset": dataset, "seed": seed, "size": size, "config": json.dumps(config or {}, sort_keys=True)}
        self.dataset = _reasoning_dataset(dataset, seed, size, self.key["config"])

    def sample(self, rng: random.Random) -> TaskExample:
        index = rng.randrange(self.key["size"])
        return TaskExample(self.dataset[index]["question"], json.dumps({**self.key, "index": index}))


def verify_reasoning_gym(response: str, answer: str) -> float:
    """The dataset's own ``score_answer`` on the response (its ``<answer>…</answer>`` when it has one), in [0, 1]."""
    row = json.loads(answer)
    dataset = _reasoning_dataset(row["dataset"], row["seed"], row["size"], row["config"])
    tagged = _ANSWER_TAG.findall(response)
    said = tagged[-1] if tagged else response
    return min(1.0, max(0.0, float(dataset.score_answer(said.strip(), dataset[row["index"]]))))


# --------------------------------------------------------------------------- skyrl-gym


class SkyRLGym:
    """A skyrl-gym environment (``environment.options.env``, e.g. ``gsm8k_multi_turn``): its per-turn rewards are the
    episode's reward. It is given the row's fields as ``extras``, with ``reward_spec.ground_truth`` = the row's answer
    unless the row has a ``reward_spec``. Its ``init`` runs, but the prompt it may return is not used: the prompt is
    the row's, as the learner made it."""

    def __init__(self, row: EpisodeRow, options: dict[str, Any]) -> None:
        gym = _package("skyrl_gym", "environment 'skyrl_gym'")
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


_TEXTARENA = threading.Lock()
"""TextArena seeds and draws from the process-wide ``random``: two games made or played at once (in the threads of
an environments' process) would take each other's draws, and the replay would meet another game."""


def _game(name: str, seed: int) -> Any:
    ta = _package("textarena", "textarena")
    with _TEXTARENA:
        env = ta.make(name)
        env.reset(num_players=1, seed=seed)
    return env


class TextArenaTask(Task):
    """The opening observation of a single-player TextArena game (``game``) with a seed drawn from ``seeds``."""

    name: ClassVar[str] = "textarena"

    def __init__(self, game: str = "GuessTheNumber-v0", seeds: int = 10000) -> None:
        self.game, self.seeds = game, seeds
        _game(game, 0)  # an unknown game is refused now

    def sample(self, rng: random.Random) -> TaskExample:
        seed = rng.randrange(self.seeds)
        _, opening = _game(self.game, seed).get_observation()
        return TaskExample(str(opening).strip(), json.dumps({"game": self.game, "seed": seed}))


class TextArenaGame:
    """The game a :class:`TextArenaTask` row opened, replayed from its seed: each step answers with what the game
    added to its observation; at the end, the game's reward for player 0 is the episode's."""

    def __init__(self, row: EpisodeRow, options: dict[str, Any]) -> None:
        opening = json.loads(row.answer)
        self.env = _game(opening["game"], opening["seed"])
        _, self.seen = self.env.get_observation()
        self.reward = 0.0

    def step(self, action: str) -> Step:
        with _TEXTARENA:
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
