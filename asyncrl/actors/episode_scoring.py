"""How the reward worker scores a multi-turn episode without taking the actor's word for any of it.

:func:`replay_episode` makes a fresh environment from the same row and seed as the actor did (``actors/episodes.py``),
steps it with the model's turns as decoded from the trained tokens, checks that every environment segment is exactly
what the template writes for its observation, and returns the episode's reward: the per-turn rewards summed, plus the
environment's final :meth:`~asyncrl.common.environments.protocol.Environment.score`.

An environment that cannot be replayed (``replayable = False``) is scored by :func:`attested_turns` instead: the same
walk over the model's turns, each environment answer taken from the episode's attestation once its signature verifies
with a key a reward worker of the run advertised (``common/wire/attestation.py``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from asyncrl.actors.episodes import (
    ENVIRONMENT_ERROR,
    ServedContext,
    close_environment,
    episode_row,
    final_score,
    open_environment,
    take_step,
)
from asyncrl.common.config import EnvironmentSection
from asyncrl.common.environments.protocol import EnvironmentFailed, Step, is_replayable
from asyncrl.common.environments.turns import EpisodeTools, episode_tools, turn_text
from asyncrl.common.rewards.functions import needs_time, takes_from_run
from asyncrl.common.wire.attestation import (
    EpisodeAttestation,
    EpisodeIdentity,
    KnownSigners,
    score_message,
    step_message,
    verifies,
)
from asyncrl.common.wire.messages import RolloutGroup, model_turns, segments


class EpisodeMismatch(ValueError):
    """An episode the environment, replayed on the model's turns, would not have produced: the reward worker
    dead-letters its group at once (a replay of the same tokens gives the same answer; retrying it only costs)."""


async def replay_episode(tools: EpisodeTools, section: EnvironmentSection, group: RolloutGroup, index: int) -> float:
    """The reward of episode ``index`` of ``group``: the sum of :func:`replay_turns`."""
    return sum(await replay_turns(tools, section, group, index))


async def replay_turns(
    tools: EpisodeTools, section: EnvironmentSection, group: RolloutGroup, index: int
) -> tuple[float, ...]:
    """The reward of each model turn of episode ``index`` of ``group``, from a fresh environment stepped with the
    model's turns: a turn's step reward, and on the last turn the environment's final score too (a turn that was
    cut, never stepped, earns 0).

    :class:`EpisodeMismatch` when the episode is not what that environment gives: an environment segment that is not
    the template's tokens for the replayed observation, turns after the environment was done, more model turns than
    ``environment.max_turns``, or an episode that does not start with a model turn.

    An environment that fails in the replay raises :class:`EnvironmentFailed` (the reward worker tries again), except
    on the last model turn of an episode that the actor's environment ended the same way (finish reason
    ``environment_error``): that episode's rewards are 0.
    """
    episode = _model_segments(section, group, index)
    failed_there = group.finish_reasons[index] == ENVIRONMENT_ERROR
    try:
        env = await open_environment(section, episode_row(group, index))
    except EnvironmentFailed:
        if failed_there and not episode.parts:
            return ()
        raise

    async def step(action: str) -> Step:
        return await take_step(env, action, section.step_timeout_s)

    try:
        rewards = await _walk(tools, episode, failed_there, step, lambda: final_score(env))
    finally:
        close_environment(env)
    return tuple(rewards) if rewards is not None else (0.0,) * episode.turns


@dataclass(frozen=True)
class RecordedEpisode:
    """Episode ``index`` of a group as the actor sent it: its token ids, its segments
    (``common/environments/turns.py: segments``), where its rows start and its number of model turns."""

    index: int
    ids: np.ndarray
    parts: list[tuple[int, int, bool]]
    row_starts: tuple[int, ...]
    turns: int

    def row_before(self, position: int) -> list[int]:
        """The tokens of the row that holds the token before ``position``, up to it."""
        start = max((p for p in self.row_starts if p < position), default=0)
        return self.ids[start:position].tolist()


def _model_segments(section: EnvironmentSection, group: RolloutGroup, index: int) -> RecordedEpisode:
    """Episode ``index``'s :class:`RecordedEpisode`; :class:`EpisodeMismatch` for an episode that does not start with
    a model turn or has more model turns than ``environment.max_turns``."""
    ids, _, _ = group.response(index)
    trained = group.trained(index)
    parts, turns = segments(trained), model_turns(trained)
    if parts and not parts[0][2]:
        raise EpisodeMismatch(f"episode {index} starts with tokens the model did not sample")
    if turns > section.max_turns:
        raise EpisodeMismatch(f"episode {index} has more model turns than environment.max_turns")
    starts = tuple(start for start, _ in group.rows(index)[1:])
    return RecordedEpisode(index, ids, parts, starts, turns)


async def _walk(
    tools: EpisodeTools,
    episode: RecordedEpisode,
    failed_there: bool,
    step: Callable[[str], Awaitable[Step]],
    score: Callable[[], Awaitable[float]],
) -> list[float] | None:
    """Each model turn's reward up to the last one stepped, with the final score on the last turn; ``None`` when the
    environment failed where the actor's did. ``step(text)`` is the environment's answer to a model turn (a replayed
    environment's, or an attested one's), ``score()`` its final score."""
    ids, parts, index = episode.ids, episode.parts, episode.index
    served = ServedContext(tools)
    rewards: list[float] = []
    for n, (start, end, trained) in enumerate(parts):
        if not trained:
            continue
        last = n == len(parts) - 1
        said = ids[start:end].tolist()
        if tools.end_id in said[:-1]:  # the engine stops at the end of a turn: what follows it is not the model's
            raise EpisodeMismatch(f"episode {index}: a model turn goes on past its end of turn")
        rewards.append(0.0)
        if said[-1] != tools.end_id:
            if not last:
                raise EpisodeMismatch(f"episode {index}: a turn that did not end goes on")
            break
        action = turn_text(tools.tokenizer, said)
        try:
            answer = await step(action)
        except EnvironmentFailed:
            if last and failed_there:
                return None
            raise
        rewards[-1] = answer.reward
        if answer.done or last:
            if not last:
                raise EpisodeMismatch(f"episode {index}: turns after the environment was done")
            break
        _check_context(served, episode, parts[n + 1][:2], action, answer)
    final = await score()
    if rewards:
        rewards[-1] += final
    return rewards


# --------------------------------------------------------------------------- the check of signatures


async def attested_turns(
    tools: EpisodeTools,
    section: EnvironmentSection,
    group: RolloutGroup,
    index: int,
    run: str,
    signers: KnownSigners,
) -> tuple[float, ...]:
    """The reward of each model turn of episode ``index`` of ``group``, an episode of an environment that cannot be
    replayed: the walk of :func:`replay_turns` over the model's turns, each environment answer taken from the
    episode's attestation (``common/wire/attestation.py``) once its signature verifies for this run, this episode,
    this turn and the model's turn as decoded from the trained tokens.

    :class:`EpisodeMismatch` for whatever :func:`replay_turns` refuses, and when the episode carries no attestation,
    one that is malformed, signed with a key no reward worker of the run advertised (``signers``), a signature that
    does not verify, a step or a score missing or left over, or when it ended on an environment error (an honest
    actor never sends one to be scored: its group is generated again).
    """
    episode = _model_segments(section, group, index)
    if group.finish_reasons[index] == ENVIRONMENT_ERROR:
        raise EpisodeMismatch(f"episode {index} ended on an environment error and has no attested ending")
    witness = AttestedEnvironment(_attestation(group, index), EpisodeIdentity(run, group.group_id, index, ""))
    if not signers.knows(witness.record.signer):
        raise EpisodeMismatch(f"episode {index} is signed by a key that no reward worker of this run advertised")
    rewards = await _walk(tools, episode, False, witness.step, witness.score)
    return tuple(rewards or ())


def _attestation(group: RolloutGroup, index: int) -> EpisodeAttestation:
    """Episode ``index``'s attestation; :class:`EpisodeMismatch` when it has none, or a malformed one."""
    text = group.attestations[index] if index < len(group.attestations) else ""
    if not text:
        raise EpisodeMismatch(f"episode {index} carries no attestation of what its environment said")
    try:
        return EpisodeAttestation.from_json(text)
    except ValueError as exc:
        raise EpisodeMismatch(f"episode {index}'s attestation is malformed: {exc}") from None


class AttestedEnvironment:
    """An episode's environment as its attestation tells it: each answer given only once its signature verifies
    (``step`` for the next turn, ``score`` after the last), :class:`EpisodeMismatch` otherwise."""

    def __init__(self, record: EpisodeAttestation, identity: EpisodeIdentity) -> None:
        self.record = record
        self.identity = replace(identity, episode=record.episode)
        self.turns = 0

    async def step(self, action: str) -> Step:
        index, turn = self.identity.index, self.turns + 1
        if turn > len(self.record.steps):
            raise EpisodeMismatch(f"episode {index}: model turn {turn} was stepped but has no attested answer")
        signed = self.record.steps[turn - 1]
        message = step_message(self.identity, turn, action, signed.observation, signed.reward, signed.done)
        if not verifies(self.record.signer, message, signed.signature):
            raise EpisodeMismatch(
                f"episode {index}: the signature of turn {turn} does not verify for this run, episode, turn and the "
                "model's turn as trained (its action, observation, reward or done is not what the worker signed)"
            )
        self.turns = turn
        return Step(observation=signed.observation, reward=signed.reward, done=signed.done)

    async def score(self) -> float:
        index, record = self.identity.index, self.record
        if len(record.steps) != self.turns:
            raise EpisodeMismatch(f"episode {index}: {len(record.steps)} attested steps for {self.turns} model turns")
        if record.score is None:
            raise EpisodeMismatch(f"episode {index} carries no attested score")
        if not verifies(record.signer, score_message(self.identity, self.turns, record.score), record.score_signature):
            raise EpisodeMismatch(f"episode {index}: the signature of its score does not verify")
        return record.score


def _check_context(
    served: ServedContext, episode: RecordedEpisode, span: tuple[int, int], action: str, step: Step
) -> None:
    """That the episode's environment turn at ``span`` (and whether a row starts there) is what the replayed ``step``
    gives after the model's turn ``action`` — or the same with some of its time-limited calls stopped at their limit —
    and take that conversation. A replay whose own call ran out of time where the episode's did not proves nothing
    either way: :class:`EnvironmentFailed`, so the reward worker tries again."""
    start, end = span
    recorded = (episode.ids[start:end].tolist(), start in episode.row_starts)
    row = episode.row_before(start)
    for observation in step.observations_given():
        ids, new_row, history = served.following(row, action, observation)
        if (ids, new_row) == recorded:
            served.history = history
            return
    if step.timed_out:
        why = "a tool call ran out of time in the replay, not in the episode"
        raise EnvironmentFailed(f"episode {episode.index}: {why}")
    raise EpisodeMismatch(
        f"episode {episode.index}: an environment turn differs from the environment's observation as the chat "
        "template renders it"
    )


def replay_time_limit(section: EnvironmentSection) -> float:
    """The longest a group's replay may take when every step takes its whole limit: opening the environment and
    ``max_turns`` steps, ``(max_turns + 1) × step_timeout_s`` (the K episodes are replayed at once). The reward
    worker gives the ``environment`` function at least this, whatever ``reward.timeout_s`` says."""
    return (section.max_turns + 1) * section.step_timeout_s


@needs_time(lambda options: replay_time_limit(EnvironmentSection.model_validate(options["environment"])))
@takes_from_run(lambda run, _options: dict(run.episodes))
def environment_reward(group: RolloutGroup, options: dict[str, Any]) -> list[tuple[float, ...]]:
    """The ``environment`` reward function: each episode replayed (:func:`replay_turns`), or for an environment that
    cannot be replayed its attestation checked (:func:`attested_turns`); a reward per model turn (the episode's
    reward is their sum). Its options are bound by the reward worker (``common.rewards.functions.bind_functions``):
    ``environment`` (the ``[environment]`` table), ``model`` (``model.path``) and ``run`` (``run.name``) from the
    config, and ``signers``, the :class:`~asyncrl.common.wire.attestation.KnownSigners` of the run's reward workers
    that the worker keeps (needed only for an environment that cannot be replayed)."""
    if "environment" not in options or "model" not in options:
        raise ValueError("environment needs options.environment and options.model (bind_functions sets them)")
    section = EnvironmentSection.model_validate(options["environment"])
    signers = _signers(section, options)
    tools = episode_tools(str(options["model"]), section.past_reasoning)
    score = functools.partial(replay_turns, tools, section)
    if signers is not None:
        score = functools.partial(attested_turns, tools, section, run=str(options.get("run", "")), signers=signers)

    async def score_all() -> list[tuple[float, ...]]:  # at once: K episodes' steps overlap, as they did on the actor
        return list(await asyncio.gather(*(score(group, i) for i in range(group.num_samples))))

    return asyncio.run(score_all())


def _signers(section: EnvironmentSection, options: dict[str, Any]) -> KnownSigners | None:
    """The signing keys an episode of ``section``'s environment must be signed with (``options["signers"]``); None
    for an environment that is replayed. ``ValueError`` for one that cannot be, where no reward worker gave them."""
    if is_replayable(section.name):
        return None
    signers = options.get("signers")
    if not isinstance(signers, KnownSigners):
        raise ValueError(
            f"environment {section.name!r} cannot be replayed: its episodes are scored from what the run's reward "
            "workers signed, which only a reward worker can check (its options.signers)"
        )
    return signers
