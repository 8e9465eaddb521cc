"""A rollout workflow and an environment for checking both built-in workflows with one real actor (one engine):
``alternate`` runs ``multi_turn`` for rows with an odd ``id`` and ``single_turn`` for the others; ``Prodding`` is
never done, so an episode lasts until ``environment.max_turns`` or its token budget. Named by import path in the
run config (the actor needs the repository on ``PYTHONPATH``)."""

from __future__ import annotations

import json
from typing import Any

from actors.workflows import Generator, WorkflowContext, multi_turn, single_turn
from common.environments import EpisodeRow, Step
from common.wire import PromptGroup, RolloutGroup


def is_episode(group: PromptGroup | RolloutGroup) -> bool:
    return json.loads(group.extra)["id"] % 2 == 1


async def alternate(engine: Generator, group: PromptGroup, turn: WorkflowContext) -> RolloutGroup:
    return await (multi_turn if is_episode(group) else single_turn)(engine, group, turn)


class Prodding:
    """Asks again after every turn; scores the turns it was answered."""

    def __init__(self, row: EpisodeRow, options: dict[str, Any]) -> None:
        self.turns = 0

    def step(self, action: str) -> Step:
        self.turns += 1
        return Step(observation=[{"role": "user", "content": f"Are you sure? Say it again ({self.turns})."}])

    def score(self) -> float:
        return float(self.turns)


class Misbehaving(Prodding):
    """Misbehaves at its first step as ``options["how"]`` says: ``crash`` (the process exits), ``hang``, ``hog``
    (asks for 2 GiB), ``garbage``; ``prints`` writes lines that look like answers to descriptor 1, then behaves;
    ``fine`` behaves as :class:`Prodding`."""

    def __init__(self, row: EpisodeRow, options: dict[str, Any]) -> None:
        super().__init__(row, options)
        self.how = options["how"]

    def step(self, action: str) -> Step:
        import os
        import time

        if self.how == "crash":
            os._exit(7)
        if self.how == "hang":
            time.sleep(3600)
        if self.how == "hog":
            self.ballast = bytearray(2 * 2**30)
        if self.how == "garbage":
            return "not a step"  # type: ignore[return-value]
        if self.how == "prints":
            os.write(1, b'42\nnull\n{"id": 1}\n')
        return super().step(action)
