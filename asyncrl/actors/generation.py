"""What a rollout workflow is given and gives back: the engine as a :class:`Generator` (token ids in, sampled
responses out), the :class:`Sampling` settings of a request, the :class:`Response` it samples, and the
:class:`WorkflowContext` of the actor that runs it; :func:`rollout_group` packs responses for the wire.

Nothing here imports vLLM (``actors/engine.py`` is the :class:`Generator` an actor runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from asyncrl.common.config import EnvironmentSection, RolloutSection, RunConfig
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup

if TYPE_CHECKING:
    from asyncrl.actors.environments.remote import RemoteEnvironments


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
    attestation: str = ""
    """An episode's: what the reward worker that ran its environment signed (``RolloutGroup.attestations``); ``""``
    for none."""
    row_starts: list[int] = field(default_factory=list)
    """Positions where an episode's training rows after the first start (``RolloutGroup.row_starts``); empty = one
    row."""


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
    environment: EnvironmentSection = field(default_factory=EnvironmentSection)
    """``[environment]``: what a multi-turn workflow runs its episodes in."""
    model_path: str = ""
    """``model.path``: where a workflow finds the tokenizer and its chat template."""
    max_model_len: int = 0
    """``model.max_model_len``: prompt and response together at most (0: no limit but the engine's)."""
    environments: RemoteEnvironments | None = None
    """The actor's client of the environments its run's reward workers serve (``environment.isolation =
    "workers"``); None: episodes make their environments in this host's own environment process."""

    @classmethod
    def of(
        cls, config: RunConfig, actor_id: str, request_id: str, environments: RemoteEnvironments | None = None
    ) -> WorkflowContext:
        model = config.model
        return cls(
            config.rollout, actor_id, request_id, config.environment, model.path, model.max_model_len, environments
        )


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
    attestations = [r.attestation for r in responses] if any(r.attestation for r in responses) else []
    row_starts = np.zeros(0, np.int32)  # each response one row
    if any(r.row_starts for r in responses):
        row_starts = np.concatenate([_flags(len(r.token_ids), r.row_starts) for r in responses])
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
        attestations=attestations,
        row_starts=row_starts,
    )


def _flags(length: int, positions: Sequence[int]) -> np.ndarray:
    flags = np.zeros(length, np.int32)
    flags[list(positions)] = 1
    return flags
