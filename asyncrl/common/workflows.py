"""The names of the rollout workflows, known to both sides.

A rollout workflow turns one issued prompt group into a rollout group (``asyncrl.actors.workflows`` says how, and is
where you write your own). ``rollout.workflow`` names one: a name registered here, or an import path
``package.module:function``. The built-ins are registered by import path, so the learner checks a config's name at
``resolve`` (:func:`check_workflow_name`) without importing actor code; the actor resolves the name to its function.
"""

from __future__ import annotations

from typing import Any

from asyncrl.common.config import ConfigError
from asyncrl.common.registry import Registry

WORKFLOWS: Registry[Any] = Registry("rollout workflow")
"""Rollout workflows by the name ``rollout.workflow`` gives (or an import path ``package.module:function``)."""
register_workflow = WORKFLOWS.register

WORKFLOWS.register_path("single_turn", "asyncrl.actors.workflows:single_turn")
WORKFLOWS.register_path("multi_turn", "asyncrl.actors.episodes:multi_turn")


def check_workflow_name(name: str) -> None:
    """A :class:`ConfigError` naming the registered workflows unless ``name`` is one of them; an import path is
    imported (it is the user's own code) so that a typo in it fails here too."""
    try:
        if ":" in name or name not in WORKFLOWS:
            WORKFLOWS.get(name)  # imports the path; raises naming the registered ones for an unknown name
    except ValueError as exc:
        raise ConfigError(f"rollout.workflow: {exc}") from None
