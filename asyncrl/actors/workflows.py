"""Rollout workflows: how an actor turns one issued prompt group into a
:class:`~asyncrl.common.wire.messages.RolloutGroup`.

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

Built-ins: ``single_turn``, K responses to the group's prompt in one vLLM request (``n = K``), the prompt's KV
cache shared; ``multi_turn``, K episodes in the run's environment (``actors/episodes.py``, registered by import path
so that nothing of it loads until a run names it). Nothing here imports vLLM: ``rl-learner resolve`` checks
``rollout.workflow`` through :func:`check_workflow_name` before anything starts.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from asyncrl.actors.generation import (
    Generator,
    Response,
    Sampling,
    WorkflowContext,
    rollout_group,
    sampling_for,
)
from asyncrl.common.config import ConfigError
from asyncrl.common.registry import Registry
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup

__all__ = [
    "WORKFLOWS",
    "Generator",
    "Response",
    "Sampling",
    "WorkflowContext",
    "register_workflow",
    "rollout_group",
    "sampling_for",
]


Workflow = Callable[[Generator, PromptGroup, WorkflowContext], Awaitable[RolloutGroup]]

WORKFLOWS: Registry[Workflow] = Registry("rollout workflow")
"""Rollout workflows by the name ``rollout.workflow`` gives (or an import path ``package.module:function``)."""
register_workflow = WORKFLOWS.register
WORKFLOWS.register_path("multi_turn", "asyncrl.actors.episodes:multi_turn")


def check_workflow_name(name: str) -> None:
    """A :class:`ConfigError` naming the registered workflows unless ``name`` is one of them; an import path is
    imported (it is the user's own code) so that a typo in it fails here too."""
    try:
        if ":" in name or name not in WORKFLOWS:
            WORKFLOWS.get(name)  # imports the path; raises naming the registered ones for an unknown name
    except ValueError as exc:
        raise ConfigError(f"rollout.workflow: {exc}") from None


def check_workflow(name: str) -> Workflow:
    """The workflow ``rollout.workflow`` names; a :class:`ConfigError` naming the registered ones otherwise."""
    check_workflow_name(name)
    return WORKFLOWS.get(name)


@register_workflow("single_turn")
async def single_turn(engine: Generator, group: PromptGroup, turn: WorkflowContext) -> RolloutGroup:
    """K responses to the group's prompt in one request: the prompt is prefilled once and its KV cache shared."""
    started = time.perf_counter()
    sampling = sampling_for(group, turn, engine.stop_ids)
    responses = await engine.generate(group.prompt_ids.tolist(), sampling, turn.request_id)
    return rollout_group(group, responses, turn, {"generate": time.perf_counter() - started})
