"""Episodes around a scripted engine, for unit tests of workflows, environments and their replay: a real tiny chat
tokenizer, an engine that says scripted turns, and the run's settings as ``--set`` overrides."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import numpy as np

from asyncrl.actors.environments.remote import RemoteEnvironments
from asyncrl.actors.episode_scoring import replay_episode
from asyncrl.actors.episodes import run_episode
from asyncrl.actors.workflows import Response, Sampling, WorkflowContext, rollout_group, sampling_for
from asyncrl.common.config import load_config
from asyncrl.common.environments.turns import EpisodeTools
from asyncrl.common.tiny_models.chat import build_bpe_tokenizer
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup

CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
QUESTION = [{"role": "user", "content": "What is 6*7?"}]


def tools_for(arch: str) -> EpisodeTools:
    tokenizer = build_bpe_tokenizer(arch)
    return EpisodeTools.for_tokenizer(tokenizer)


class ScriptedEngine:
    """Says the scripted turns in order (each closed with the end of turn unless it is cut), one per request."""

    stop_ids: tuple[int, ...] = ()

    def __init__(self, tools: EpisodeTools, turns: Sequence[str], cut: bool = False) -> None:
        self.tools, self.turns, self.cut = tools, list(turns), cut
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, request_id: str) -> list[Response]:
        self.prompts.append(list(prompt_ids))
        text = self.turns[min(len(self.prompts), len(self.turns)) - 1]
        ids = self.tools.tokenizer(text, add_special_tokens=False)["input_ids"][: sampling.max_tokens]
        ended = not self.cut and len(ids) < sampling.max_tokens
        ids = [*ids, self.tools.end_id] if ended else ids
        version = len(self.prompts)  # a new policy version each turn: weights that changed between turns
        return [Response(ids, [-0.5] * len(ids), [version] * len(ids), text, "stop" if ended else "length")]


def prompt_group(
    tools: EpisodeTools, answer: str = "42", k: int = 1, question: str = "", group_id: str = "g-1"
) -> PromptGroup:
    messages = [{"role": "user", "content": question}] if question else QUESTION
    text = tools.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tools.tokenizer(text, add_special_tokens=False)["input_ids"]
    return PromptGroup(
        group_id=group_id, task="file", prompt=text, prompt_ids=np.array(ids, np.int32), answer=answer, num_samples=k
    )


def context(*overrides: str) -> WorkflowContext:
    """The workflow context of a run with ``overrides``; environments in this process unless they say otherwise
    (``environment.isolation``: a unit test starts no process)."""
    settings = ["rollout.workflow=multi_turn", "environment.name=calculator", "rollout.max_new_tokens=96"]
    settings.append("environment.isolation=thread")
    config = load_config(None, [*settings, *overrides])
    return WorkflowContext.of(config, "actor-0", "g-1-abc")


def episode(
    tools: EpisodeTools,
    turns: Sequence[str],
    *overrides: str,
    cut: bool = False,
    answer: str = "42",
    question="",
    group_id: str = "g-1",
    remote: RemoteEnvironments | None = None,
):
    """(rollout group of one episode, the engine, the workflow context); ``remote``: the reward workers' environments
    the episode runs in, as an actor's would (``environment.isolation = "workers"``)."""
    engine, turn = ScriptedEngine(tools, turns, cut), dataclasses.replace(context(*overrides), environments=remote)
    group = prompt_group(tools, answer, question=question, group_id=group_id)
    sampling = sampling_for(group, turn)
    response = asyncio.run(run_episode(engine, group, 0, sampling, turn, tools))
    return rollout_group(group, [response], turn), engine, turn


def replay(tools: EpisodeTools, rollout: RolloutGroup, turn: WorkflowContext) -> float:
    return asyncio.run(replay_episode(tools, turn.environment, rollout, 0))
