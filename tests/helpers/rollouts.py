"""Tiny hand-built rollout groups: the texts, finish reasons and lengths a reward function reads."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np

from common.control import ControlPlane
from common.wire import PromptGroup, RolloutGroup


def make_group(
    texts: Sequence[str],
    *,
    finish_reasons: Sequence[str] | None = None,
    lengths: Sequence[int] | None = None,
    task: str = "arithmetic",
    prompt: str = "12+7=",
    answer: str = "19",
    group_id: str | None = None,
) -> RolloutGroup:
    """A group with one response per text; lengths default to the character counts (a character-level model).

    Token ids, log-probs and versions are zeros of the right sizes: no reward function reads them.
    """
    lengths = [len(t) for t in texts] if lengths is None else list(lengths)
    total = sum(lengths)
    return RolloutGroup(
        group_id=group_id or uuid.uuid4().hex,
        task=task,
        prompt=prompt,
        prompt_ids=np.zeros(len(prompt), np.int32),
        answer=answer,
        token_ids=np.zeros(total, np.int32),
        logprobs=np.zeros(total, np.float32),
        versions=np.zeros(total, np.int32),
        lengths=np.asarray(lengths, np.int32),
        texts=list(texts),
        finish_reasons=list(finish_reasons or ["stop"] * len(texts)),
        actor_id="test-actor",
    )


def issue(plane: ControlPlane, *groups: RolloutGroup) -> None:
    """Store each group's issue record as the learner's dispatcher does when it releases a prompt group: reward
    workers and the learner accept only groups that answer a record in flight (``common/provenance.py``)."""
    records = [
        PromptGroup(
            group_id=g.group_id,
            task=g.task,
            prompt=g.prompt,
            prompt_ids=g.prompt_ids,
            answer=g.answer,
            num_samples=g.num_samples,
            issued_version=g.issued_version,
        )
        for g in groups
    ]
    plane.prompts.record_issued(records)
    plane.prompts.save_groups(records, {})
