"""Everything a user's own code is written against, in one module: import these, and nothing deeper in asyncrl.

What you can write, and where the guide is:

- an environment for multi-turn episodes: :class:`Environment` (or :class:`ToolEnvironment` with its tools), made
  from an :class:`EpisodeRow`, answering each model turn with a :class:`Step` (docs/environments.md);
- a reward function ``f(group, options) -> list[reward]`` (:data:`RewardFn`) or a verifier
  ``f(response, answer) -> float`` (:data:`Verifier`) (docs/configuration.md);
- a task that draws prompts: a :class:`Task` subclass (docs/configuration.md);
- a rollout workflow ``async f(generator, prompt_group, context) -> RolloutGroup`` (:data:`Workflow`);
- an advantage estimator ``f(AdvantageInput, settings) -> AdvantageOutput``, a policy loss
  ``f(LossInput, settings) -> LossOutput`` or an aggregation, each with its :class:`Settings` subclass saying in
  ``requires()`` which :class:`Need` the learner computes for it (docs/algorithms.md).

Name yours in the config by import path (``my_pkg.losses:my_loss``) or register it under a name with the matching
``register_*`` decorator, or declare it as an entry point of your package (``asyncrl.environments``,
``asyncrl.rewards``, ``asyncrl.verifiers``, ``asyncrl.tasks``, ``asyncrl.advantages``, ``asyncrl.losses``) so that
every process of a run finds it by name.

Each name is imported when first used: ``from asyncrl.api import register_loss`` loads the learner's algorithms and
nothing of the actors', and a reward function's module loads none of the training code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "asyncrl.environments": (
        "Environment", "EnvironmentFailed", "EpisodeRow", "OutOfTime", "Step", "ToolEnvironment", "function_spec",
        "register_environment",
    ),
    "asyncrl.common.rewards.functions": ("RewardFn", "register_reward"),
    "asyncrl.common.rewards.verifiers": ("Verifier", "register_verifier"),
    "asyncrl.common.data.tasks": ("Task", "register_task"),
    "asyncrl.common.wire.messages": ("PromptGroup", "RolloutGroup"),
    "asyncrl.actors.workflows": ("Workflow", "register_workflow"),
    "asyncrl.actors.generation": ("WorkflowContext",),
    "asyncrl.learner.algorithms": (
        "AdvantageInput", "AdvantageOutput", "GlobalCounts", "LossInput", "LossOutput", "Need", "Settings",
        "register_advantage", "register_aggregation", "register_loss",
    ),
}  # fmt: skip
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "AdvantageInput",
    "AdvantageOutput",
    "Environment",
    "EnvironmentFailed",
    "EpisodeRow",
    "GlobalCounts",
    "LossInput",
    "LossOutput",
    "Need",
    "OutOfTime",
    "PromptGroup",
    "RewardFn",
    "RolloutGroup",
    "Settings",
    "Step",
    "Task",
    "ToolEnvironment",
    "Verifier",
    "Workflow",
    "WorkflowContext",
    "function_spec",
    "register_advantage",
    "register_aggregation",
    "register_environment",
    "register_loss",
    "register_reward",
    "register_task",
    "register_verifier",
    "register_workflow",
]
"""The names offered, each from its home module (:data:`_HOMES`)."""


def __getattr__(name: str) -> Any:
    """A name of :data:`__all__`, imported from its home module on first use."""
    if name not in _HOME_OF:
        raise AttributeError(f"module 'asyncrl.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # what a type checker and an editor see: the same names, from their homes
    from asyncrl.actors.generation import WorkflowContext
    from asyncrl.actors.workflows import Workflow, register_workflow
    from asyncrl.common.data.tasks import Task, register_task
    from asyncrl.common.rewards.functions import RewardFn, register_reward
    from asyncrl.common.rewards.verifiers import Verifier, register_verifier
    from asyncrl.common.wire.messages import PromptGroup, RolloutGroup
    from asyncrl.environments import (
        Environment,
        EnvironmentFailed,
        EpisodeRow,
        OutOfTime,
        Step,
        ToolEnvironment,
        function_spec,
        register_environment,
    )
    from asyncrl.learner.algorithms import (
        AdvantageInput,
        AdvantageOutput,
        GlobalCounts,
        LossInput,
        LossOutput,
        Need,
        Settings,
        register_advantage,
        register_aggregation,
        register_loss,
    )
