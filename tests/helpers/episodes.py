"""A rollout workflow and an environment for checking both built-in workflows with one real actor (one engine):
``alternate`` runs ``multi_turn`` for rows with an odd ``id`` and ``single_turn`` for the others (and a row that names
an adapter in its ``adapter`` field in that adapter's environment); ``Prodding`` is
never done, so an episode lasts until ``environment.max_turns`` or its token budget. Named by import path in the
run config (the actor needs the repository on ``PYTHONPATH``)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from asyncrl.actors.episodes import multi_turn
from asyncrl.actors.workflows import Generator, WorkflowContext, single_turn
from asyncrl.common.config import EnvironmentSection
from asyncrl.common.environments.protocol import EpisodeRow, Step
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup

ADAPTERS = {"skyrl_gym": {"env": "gsm8k_multi_turn", "extras": {"max_turns": 3}}, "textarena": {}}
"""The adapters' environments a row may name in its ``adapter`` field, with their options."""


def adapter_of(group: PromptGroup | RolloutGroup) -> str:
    """The row's ``adapter`` ("" when it names none)."""
    return json.loads(group.extra).get("adapter", "")


def adapter_section(section: EnvironmentSection, adapter: str) -> EnvironmentSection:
    """``[environment]`` with the adapter's environment in it."""
    return section.model_copy(update={"name": adapter, "options": ADAPTERS[adapter]})


def is_episode(group: PromptGroup | RolloutGroup) -> bool:
    """A row of ours (no adapter) with an odd id: an episode in the run's own environment."""
    return not adapter_of(group) and json.loads(group.extra)["id"] % 2 == 1


async def alternate(engine: Generator, group: PromptGroup, turn: WorkflowContext) -> RolloutGroup:
    """``multi_turn`` in the adapter's environment for a row that names one (single-turn for reasoning-gym's rows),
    else ``multi_turn`` for odd ids and ``single_turn`` for the others."""
    adapter = adapter_of(group)
    if adapter in ADAPTERS:
        return await multi_turn(engine, group, replace(turn, environment=adapter_section(turn.environment, adapter)))
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
