"""Rollouts as a forger or a stranger sends them into a live run: shaped as an actor would send them, for groups the
run issued, and the reward workers they are sent to."""

from __future__ import annotations

import numpy as np

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup


def honest(issued: PromptGroup, lengths: list[int], versions: int = 0, actor: str = "forger") -> RolloutGroup:
    """A rollout shaped as an actor would send it for ``issued`` (zeros for tokens: any in-vocabulary id would do)."""
    total = sum(lengths)
    return RolloutGroup(
        group_id=issued.group_id,
        task=issued.task,
        prompt=issued.prompt,
        prompt_ids=issued.prompt_ids,
        answer=issued.answer,
        token_ids=np.zeros(total, np.int32),
        logprobs=np.full(total, -1.0, np.float32),
        versions=np.full(total, versions, np.int32),
        lengths=np.asarray(lengths, np.int32),
        texts=["1"] * len(lengths),
        finish_reasons=["stop"] * len(lengths),
        actor_id=actor,
        issued_version=issued.issued_version,
    )


def right_texts(plane: ControlPlane, actor: str = "forger") -> list[RolloutGroup]:
    """A group for every id in flight, as a stranger who predicted the ids would send them: K responses of token 0."""
    return [honest(plane.prompts.load_group(g), [1] * 8, actor=actor) for g in sorted(plane.prompts.ledger())]


def reward_endpoints(plane: ControlPlane) -> list[str]:
    """The endpoints of the live reward workers in the run's registry."""
    return [h.endpoint for h in plane.registry.processes()[0] if h.kind == "reward"]
