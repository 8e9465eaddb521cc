"""Rollout workflows: how an actor turns one issued prompt group into a :class:`~common.wire.RolloutGroup`.

A workflow is chosen by ``rollout.workflow`` (a name in :data:`WORKFLOWS`, or an import path
``package.module:function`` for your own); it is given the engine as a
:class:`Generator` — token ids in, sampled responses out, each token stamped with the policy version current when it
was sampled — and the group, and returns the rollout the reward worker scores and the learner trains. The actor owns
everything around it (taking groups from the ledger, delivery, weight updates, shutdown), so a new way of producing
trajectories is a function here, not a fork of the actor::

    @register_workflow("my_workflow")
    async def my_workflow(engine: Generator, group: PromptGroup, turn: WorkflowContext) -> RolloutGroup:
        sampling = sampling_for(group, turn, engine.stop_ids)
        responses = await engine.generate(group.prompt_ids.tolist(), sampling, turn.request_id)
        return rollout_group(group, responses, turn)

``single_turn`` is the built-in: K responses to the group's prompt in one vLLM request (``n = K``), the prompt's KV
cache shared. Nothing here imports vLLM: the learner checks ``rollout.workflow`` at ``resolve`` through
:func:`check_workflow`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from common.config import ConfigError, RolloutSection
from common.registry import Registry
from common.wire import PromptGroup, RolloutGroup


@dataclass(frozen=True)
class Sampling:
    """What one generation request samples, in the engine's terms but without its types."""

    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Response:
    """One sampled response: its tokens, their behaviour log-probs (μ) and the policy version of each."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    trained: list[int] = field(default_factory=list)
    """Per token, 1 = sampled by the model (trained), 0 = written into the episode by an environment or a tool (not
    trained); empty = every token was sampled."""


class Generator(Protocol):
    """What a workflow may ask of the actor's engine (``actors.engine.RolloutEngine``)."""

    stop_ids: tuple[int, ...]
    """Token ids that end a response besides EOS: the chat template's end of an assistant turn."""

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, request_id: str) -> list[Response]:
        """``sampling.n`` responses to ``prompt_ids``; ``request_id`` is what the actor aborts at shutdown."""
        ...


@dataclass(frozen=True)
class WorkflowContext:
    """What a workflow knows of the actor that runs it."""

    rollout: RolloutSection
    actor_id: str
    request_id: str


Workflow = Callable[[Generator, PromptGroup, WorkflowContext], Awaitable[RolloutGroup]]
WORKFLOWS: Registry[Workflow] = Registry("rollout workflow")
"""Rollout workflows by the name ``rollout.workflow`` gives (or an import path ``package.module:function``)."""
register_workflow = WORKFLOWS.register


def check_workflow(name: str) -> Workflow:
    """The workflow ``rollout.workflow`` names; a :class:`ConfigError` naming the registered ones otherwise."""
    try:
        return WORKFLOWS.get(name)
    except ValueError as exc:
        raise ConfigError(f"rollout.workflow: {exc}") from None


def sampling_for(group: PromptGroup, turn: WorkflowContext, stop_ids: Sequence[int] = ()) -> Sampling:
    """The group's sampling settings: an eval group carries its own (temperature ≥ 0); a training group samples μ as
    ``[rollout]`` says."""
    rollout = turn.rollout
    own = group.temperature >= 0
    return Sampling(
        n=group.num_samples,
        temperature=group.temperature if own else rollout.temperature,
        top_p=1.0 if own else rollout.top_p,
        max_tokens=group.max_new_tokens or rollout.max_new_tokens,
        stop=tuple(rollout.stop),
        stop_token_ids=tuple(stop_ids),
    )


def rollout_group(
    group: PromptGroup, responses: list[Response], turn: WorkflowContext, timings: dict[str, float] | None = None
) -> RolloutGroup:
    """The rollout of ``group`` made of ``responses``, packed as the wire carries it."""

    def packed(attr: str, dtype: type) -> np.ndarray:
        return np.array([x for r in responses for x in getattr(r, attr)], dtype=dtype)

    logprobs = packed("logprobs", np.float32)
    # A sampled token can have -inf log-prob only through float underflow; clamp so the wire accepts it.
    np.nan_to_num(logprobs, copy=False, neginf=-1e4)
    loss_mask = np.zeros(0, np.int32)  # every token trained
    if any(r.trained for r in responses):
        loss_mask = np.array([x for r in responses for x in r.trained or [1] * len(r.token_ids)], np.int32)
    return RolloutGroup(
        group_id=group.group_id,
        task=group.task,
        prompt=group.prompt,
        prompt_ids=group.prompt_ids,
        answer=group.answer,
        token_ids=packed("token_ids", np.int32),
        logprobs=logprobs,
        versions=packed("versions", np.int32),
        lengths=np.array([len(r.token_ids) for r in responses], np.int32),
        texts=[r.text for r in responses],
        finish_reasons=[r.finish_reason or "abort" for r in responses],
        issued_version=group.issued_version,
        actor_id=turn.actor_id,
        timings=timings or {},
        extra=group.extra,
        purpose=group.purpose,
        loss_mask=loss_mask,
    )


@register_workflow("single_turn")
async def single_turn(engine: Generator, group: PromptGroup, turn: WorkflowContext) -> RolloutGroup:
    """K responses to the group's prompt in one request: the prompt is prefilled once and its KV cache shared."""
    started = time.perf_counter()
    sampling = sampling_for(group, turn, engine.stop_ids)
    responses = await engine.generate(group.prompt_ids.tolist(), sampling, turn.request_id)
    return rollout_group(group, responses, turn, {"generate": time.perf_counter() - started})
