"""Tasks from data sets and games people already have: reasoning-gym and TextArena.

Each needs its package (``pip install 'asyncrl[envs]'``), imported only when a run uses it:

==================  ===========  ==========================================================================
name                kind         what it is
==================  ===========  ==========================================================================
``reasoning_gym``   task         a reasoning-gym procedural dataset (``task.options``: ``dataset``, ``size``,
                    + verifier   ``seed``, ``config``), scored by the dataset's own ``score_answer``
``textarena``       task         the opening of a single-player TextArena game (``task.options``: ``game``,
                                 ``seeds``); the game itself is the environment that plays it on
                                 (``common/environments/gyms.py``)
==================  ===========  ==========================================================================

The names are registered in ``common/data/tasks.py`` and ``common/rewards/verifiers.py`` by import path, so nothing
here is imported by a run that does not use it.
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

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def gym_package(module: str, what: str) -> Any:
    """The optional package ``module`` that ``what`` needs, or a ``ValueError`` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{what} needs the {module} package: pip install 'asyncrl[envs]'") from None


# --------------------------------------------------------------------------- reasoning-gym


@functools.lru_cache(maxsize=16)
def _reasoning_dataset(name: str, seed: int, size: int, config: str) -> Any:
    rg = gym_package("reasoning_gym", "task 'reasoning_gym'")
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


# --------------------------------------------------------------------------- TextArena


TEXTARENA_LOCK = threading.Lock()
"""TextArena seeds and draws from the process-wide ``random``: two games made or played at once (in the threads of
an environments' process) would take each other's draws, and the replay would meet another game."""


def textarena_game(name: str, seed: int) -> Any:
    """A new single-player TextArena game ``name``, reset with ``seed`` (under :data:`TEXTARENA_LOCK`)."""
    ta = gym_package("textarena", "textarena")
    with TEXTARENA_LOCK:
        env = ta.make(name)
        env.reset(num_players=1, seed=seed)
    return env


class TextArenaTask(Task):
    """The opening observation of a single-player TextArena game (``game``) with a seed drawn from ``seeds``."""

    name: ClassVar[str] = "textarena"

    def __init__(self, game: str = "GuessTheNumber-v0", seeds: int = 10000) -> None:
        self.game, self.seeds = game, seeds
        textarena_game(game, 0)  # an unknown game is refused now

    def sample(self, rng: random.Random) -> TaskExample:
        seed = rng.randrange(self.seeds)
        _, opening = textarena_game(self.game, seed).get_observation()
        return TaskExample(str(opening).strip(), json.dumps({"game": self.game, "seed": seed}))
