"""Multi-turn episodes: the actor's ``multi_turn`` workflow, and the reward worker's replay that scores them.

The actor runs the K episodes of a group at once. Each alternates a model turn (one vLLM request on the whole episode so
far: the prompt's and the earlier turns' KV cache is reused through prefix caching where it is on) and an environment
step on that turn's text (:mod:`asyncrl.common.environments.protocol`), whose observation is appended as the chat
template writes it (:class:`asyncrl.common.environments.turns.TurnEncoder`). The episode travels as one response: its
tokens, μ and versions on the model's tokens (0 and the last sampled version on the environment's), and a loss mask that
is 1 on the model's tokens only, so the learner trains those and nothing the environment wrote.

After a model turn the environment steps only when the turn ended with the template's end of turn; a turn cut by
its token budget, or one the model ended with EOS, ends the episode. An episode also ends when the environment says
done, at ``environment.max_turns``, at ``environment.max_episode_tokens`` (or the context left by the prompt), past
``environment.episode_timeout_s`` (checked before each model turn), and when
a step fails, hangs past ``environment.step_timeout_s`` or returns something unusable — then it ends with the tokens
it has, and the failure is counted (``asyncrl_actor_episode_endings_total{ending="environment_error"}``).
Environments run in a process of their own (``actors/environment_host.py``), on the run's reward workers with
``environment.isolation = "workers"`` (``actors/remote_environments.py``), or in the actor with ``"thread"``.

The reward worker does not take the actor's word for any of it: :func:`replay_episode` makes a fresh environment from
the same row and seed, steps it with the model's turns as decoded from the trained tokens, checks that every
environment segment is exactly what the template writes for its observation, and returns the episode's reward: the
per-turn rewards summed, plus the environment's final :meth:`~asyncrl.common.environments.protocol.Environment.score`.

An environment that cannot be replayed (``replayable = False``) runs on the run's reward workers, which sign each of
its answers; the actor takes its score at the episode's end and carries the signed answers with the episode
(``RolloutGroup.attestations``). Such an episode is scored by :func:`attested_turns` instead of a replay: the same
walk over the model's turns, each environment answer taken from its attestation once its signature verifies with a
key a reward worker of the run advertised (``common/wire/attestation.py``).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import json
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from asyncrl.actors.environment_host import EnvironmentHost, HostedEnvironment
from asyncrl.actors.generation import Generator, Response, Sampling, WorkflowContext, rollout_group, sampling_for
from asyncrl.actors.remote_environments import RemoteEnvironments
from asyncrl.common.config import EnvironmentSection
from asyncrl.common.environments.protocol import (
    Environment,
    EnvironmentFailed,
    EpisodeRow,
    Step,
    checked_score,
    checked_step,
    is_replayable,
    make_environment,
    recorded_as_given,
)
from asyncrl.common.environments.turns import EpisodeTools, episode_tools, segments, turn_text
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.metrics import (
    ACTOR_ENVIRONMENT_STEP_SECONDS,
    ACTOR_EPISODE_ENDINGS,
    ACTOR_EPISODE_TURNS,
)
from asyncrl.common.wire.attestation import (
    EpisodeAttestation,
    EpisodeIdentity,
    KnownSigners,
    score_message,
    step_message,
    verifies,
)
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup, model_turns

log = get_logger("episodes")

EpisodeEnvironment = Environment | HostedEnvironment
"""An episode's environment: one in this process, or a hosted one (:func:`open_environment`), whose every call,
``score`` too, is awaited."""


class EpisodeMismatch(ValueError):
    """An episode the environment, replayed on the model's turns, would not have produced: the reward worker
    dead-letters its group at once (a replay of the same tokens gives the same answer; retrying it only costs)."""


ENVIRONMENT_ERROR = "environment_error"
FINISH_REASONS = {
    "max_turns": "max_turns",
    "max_tokens": "length",
    "deadline": "deadline",
    ENVIRONMENT_ERROR: ENVIRONMENT_ERROR,
}
"""An episode's finish reason by its ending (``stop`` otherwise: the environment said done, or the model ended its
turn without a call): ``length`` when the token limit cut it (as a single-turn response's), ``max_turns`` at
``environment.max_turns``, ``deadline`` past ``environment.episode_timeout_s``, and ``environment_error`` when its
environment failed — which the replay must know to tell that failure (score 0) from one of its own (retried)."""


def episode_row(group: PromptGroup | RolloutGroup, index: int) -> EpisodeRow:
    """The row episode ``index`` of ``group`` is made from; its seed is fixed by the group id and the index, so the
    reward worker's replay makes the same environment as the actor did."""
    extra = json.loads(group.extra) if group.extra else {}
    seed = zlib.crc32(f"{group.group_id}/{index}".encode())
    return EpisodeRow(prompt=group.prompt, answer=group.answer, extra=extra, seed=seed)


_HOSTS: dict[str, EnvironmentHost] = {}
_HOSTS_LOCK = threading.Lock()


def environment_host(section: EnvironmentSection) -> EnvironmentHost:
    """This process's host for ``section``'s environments (started at its first request, ended at exit)."""
    key = section.model_dump_json()
    with _HOSTS_LOCK:
        if key not in _HOSTS:
            _HOSTS[key] = EnvironmentHost(section)
            atexit.register(_HOSTS[key].close)
        return _HOSTS[key]


def close_environment_hosts() -> None:
    """End this process's environment hosts (they also end at exit, and with this process)."""
    with _HOSTS_LOCK:
        hosts = list(_HOSTS.values())
        _HOSTS.clear()
    for host in hosts:
        host.close()


_REMOTE: list[RemoteEnvironments] = []


def use_remote_environments(remote: RemoteEnvironments | None) -> None:
    """Make this process's episodes open their environments on the run's reward workers (an actor with
    ``environment.isolation = "workers"``); None goes back to this process's own environment process."""
    _REMOTE[:] = [remote] if remote is not None else []


async def open_environment(
    section: EnvironmentSection, row: EpisodeRow, identity: dict[str, Any] | None = None
) -> EpisodeEnvironment:
    """The environment of ``row``: on the run's reward workers (``environment.isolation = "workers"``, in an actor that
    reaches them), in the environments' own process (``"process"``, and ``"workers"`` anywhere else: a reward
    worker's replay, an offline eval), or in this one (``"thread"``). ``identity`` (``group_id``, ``index``) names
    the episode it is for: what a worker signs an environment that cannot be replayed for."""
    if section.isolation == "thread":
        return make_environment(section.name, section.options, row)
    host = _REMOTE[0] if section.isolation == "workers" and _REMOTE else environment_host(section)
    try:
        return await HostedEnvironment.open(host, row, identity)
    except EnvironmentFailed as exc:
        raise EnvironmentFailed(f"environment {section.name!r} could not be made: {exc}") from exc


def close_environment(env: EpisodeEnvironment | None) -> None:
    """Free a hosted environment in its process (one in this process goes with its episode)."""
    if isinstance(env, HostedEnvironment):
        env.close()


async def signed_ending(env: EpisodeEnvironment | None) -> str:
    """The attestation an ended episode carries (JSON): its worker's signed answers with its signed final score,
    taken now; ``""`` for an environment whose worker signs nothing (one that can be replayed)."""
    if not isinstance(env, HostedEnvironment) or env.attestation is None:
        return ""
    await final_score(env)
    return env.attestation.to_json()


async def final_score(env: EpisodeEnvironment) -> float:
    """``env.score()``, awaited when it is a coroutine, checked."""
    try:
        value = env.score()
        return checked_score(await value if inspect.isawaitable(value) else value)
    except EnvironmentFailed:
        raise
    except Exception as exc:
        raise EnvironmentFailed(f"score raised {type(exc).__name__}: {exc}") from exc


_STEPS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="environment-step")
"""Where synchronous steps run in ``isolation = "thread"``: a hung one holds a thread of this pool, never one of the
event loop's default executor (which the actor's own Redis and socket calls use)."""


async def take_step(
    env: EpisodeEnvironment, action: str, timeout_s: float, observe: Callable[[float], None] = lambda seconds: None
) -> Step:
    """One step within ``timeout_s``; ``observe`` gets its seconds. A synchronous ``step`` runs in a thread
    (:data:`_STEPS`), so a slow one never stalls the actor's other episodes; an ``async`` one (a hosted environment's
    among them: its host keeps the time limit itself) is awaited."""

    async def call() -> Any:
        if inspect.iscoroutinefunction(env.step):
            return await env.step(action)
        result = await asyncio.get_running_loop().run_in_executor(_STEPS, env.step, action)
        return await result if inspect.isawaitable(result) else result

    started = time.perf_counter()
    try:
        if isinstance(env, HostedEnvironment):
            return checked_step(await call())
        return checked_step(await asyncio.wait_for(call(), timeout_s))
    except TimeoutError:
        raise EnvironmentFailed(f"step took longer than environment.step_timeout_s = {timeout_s:g}") from None
    except EnvironmentFailed:
        raise
    except Exception as exc:
        raise EnvironmentFailed(f"step raised {type(exc).__name__}: {exc}") from exc
    finally:
        observe(time.perf_counter() - started)


def observation_ids(tools: EpisodeTools, step: Step) -> list[int]:
    """The template's tokens for ``step``'s observation; a template that refuses it (one that enforces the order of
    roles, say) fails the step, not the group."""
    try:
        return tools.encoder.ids(step.observation)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise EnvironmentFailed(f"the chat template cannot render the observation: {why}") from exc


def episode_budget(turn: WorkflowContext, prompt_len: int) -> int:
    """Tokens an episode may hold after its prompt: ``environment.max_episode_tokens``, within the context left."""
    limits = [turn.environment.max_episode_tokens or 2**31]
    if turn.max_model_len:
        limits.append(turn.max_model_len - prompt_len)
    return max(0, min(limits))


async def multi_turn(engine: Generator, group: PromptGroup, turn: WorkflowContext) -> RolloutGroup:
    """K episodes of the group's row in ``[environment]``, run at once; one response each."""
    started = time.perf_counter()
    sampling = sampling_for(group, turn, engine.stop_ids)
    tools = episode_tools(turn.model_path, turn.environment.past_reasoning)
    episodes = [run_episode(engine, group, i, sampling, turn, tools) for i in range(group.num_samples)]
    responses = list(await asyncio.gather(*episodes))
    return rollout_group(group, responses, turn, {"generate": time.perf_counter() - started})


async def run_episode(
    engine: Generator, group: PromptGroup, index: int, sampling: Sampling, turn: WorkflowContext, tools: EpisodeTools
) -> Response:
    """Episode ``index`` of ``group``: model turns and environment turns until it ends (module docstring)."""
    section, prompt = turn.environment, group.prompt_ids.tolist()
    budget = episode_budget(turn, len(prompt))
    episode = Response()
    ending, turns, env = "max_turns", 0, None
    try:
        env = await open_environment(section, episode_row(group, index), {"group_id": group.group_id, "index": index})
        deadline = time.monotonic() + (section.episode_timeout_s or float("inf"))
        for turns in range(1, section.max_turns + 1):
            if turns > 1 and time.monotonic() >= deadline:
                ending, turns = "deadline", turns - 1
                break
            room = min(sampling.max_tokens, budget - len(episode.token_ids))
            if room <= 0:
                ending = "max_tokens"
                break
            request = replace(sampling, n=1, max_tokens=room)
            [said] = await engine.generate(prompt + episode.token_ids, request, f"{turn.request_id}-{index}-{turns}")
            _append(episode, said.token_ids, said.logprobs, said.versions, trained=1)
            if not said.token_ids or said.token_ids[-1] != tools.end_id:
                ending = "max_tokens" if said.finish_reason == "length" else "stopped"
                break
            action = turn_text(tools.tokenizer, said.token_ids)
            step = await take_step(env, action, section.step_timeout_s, ACTOR_ENVIRONMENT_STEP_SECONDS.observe)
            if step.done:
                ending = "done"
                break
            observation = observation_ids(tools, step)
            if turns == section.max_turns:
                break
            if len(episode.token_ids) + len(observation) >= budget:
                ending = "max_tokens"
                break
            last = episode.versions[-1]
            _append(episode, observation, [0.0] * len(observation), [last] * len(observation), trained=0)
        episode.attestation = await signed_ending(env)
    except EnvironmentFailed as exc:
        ending = "environment_error"
        log.warning("episode ended by its environment", group=group.group_id, episode=index, error=str(exc))
    finally:
        close_environment(env)
    ACTOR_EPISODE_TURNS.observe(turns)
    ACTOR_EPISODE_ENDINGS.labels(ending).inc()
    episode.text = tools.tokenizer.decode(episode.token_ids, skip_special_tokens=True)
    episode.finish_reason = FINISH_REASONS.get(ending, "stop")
    return episode


def _append(episode: Response, ids: list[int], logprobs: list[float], versions: list[int], trained: int) -> None:
    episode.token_ids += ids
    episode.logprobs += logprobs
    episode.versions += versions
    episode.trained += [trained] * len(ids)


# --------------------------------------------------------------------------- the reward worker's replay


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
    ids, parts, turns = _model_segments(section, group, index)
    failed_there = group.finish_reasons[index] == ENVIRONMENT_ERROR
    try:
        env = await open_environment(section, episode_row(group, index))
    except EnvironmentFailed:
        if failed_there and not parts:
            return ()
        raise

    async def step(action: str) -> Step:
        return await take_step(env, action, section.step_timeout_s)

    try:
        rewards = await _walk(tools, ids, parts, index, failed_there, step, lambda: final_score(env))
    finally:
        close_environment(env)
    return tuple(rewards) if rewards is not None else (0.0,) * turns


def _model_segments(
    section: EnvironmentSection, group: RolloutGroup, index: int
) -> tuple[np.ndarray, list[tuple[int, int, bool]], int]:
    """Episode ``index``'s token ids, its segments (``common/environments/turns.py: segments``) and its number of
    model turns; :class:`EpisodeMismatch` for an episode that does not start with a model turn or has more model turns
    than ``environment.max_turns``."""
    ids, _, _ = group.response(index)
    trained = group.trained(index)
    parts, turns = segments(trained), model_turns(trained)
    if parts and not parts[0][2]:
        raise EpisodeMismatch(f"episode {index} starts with tokens the model did not sample")
    if turns > section.max_turns:
        raise EpisodeMismatch(f"episode {index} has more model turns than environment.max_turns")
    return ids, parts, turns


async def _walk(
    tools: EpisodeTools,
    ids: np.ndarray,
    parts: list[tuple[int, int, bool]],
    index: int,
    failed_there: bool,
    step: Callable[[str], Awaitable[Step]],
    score: Callable[[], Awaitable[float]],
) -> list[float] | None:
    """Each model turn's reward up to the last one stepped, with the final score on the last turn; ``None`` when the
    environment failed where the actor's did. ``step(text)`` is the environment's answer to a model turn (a replayed
    environment's, or an attested one's), ``score()`` its final score."""
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
        try:
            answer = await step(turn_text(tools.tokenizer, said))
        except EnvironmentFailed:
            if last and failed_there:
                return None
            raise
        rewards[-1] = answer.reward
        if answer.done or last:
            if not last:
                raise EpisodeMismatch(f"episode {index}: turns after the environment was done")
            break
        _check_observation(tools, answer, ids[parts[n + 1][0] : parts[n + 1][1]].tolist(), index)
    final = await score()
    if rewards:
        rewards[-1] += final
    return rewards


# --------------------------------------------------------------------------- the reward worker's check of signatures


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
    ids, parts, _ = _model_segments(section, group, index)
    if group.finish_reasons[index] == ENVIRONMENT_ERROR:
        raise EpisodeMismatch(f"episode {index} ended on an environment error and has no attested ending")
    witness = AttestedEnvironment(_attestation(group, index), EpisodeIdentity(run, group.group_id, index, ""))
    if not signers.knows(witness.record.signer):
        raise EpisodeMismatch(f"episode {index} is signed by a key that no reward worker of this run advertised")
    rewards = await _walk(tools, ids, parts, index, False, witness.step, witness.score)
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


def _check_observation(tools: EpisodeTools, step: Step, recorded: list[int], index: int) -> None:
    """That the episode's environment turn ``recorded`` is what the replayed ``step`` gives, or the same with some of
    its time-limited calls stopped at their limit. A replay whose own call ran out of time where the episode's did not
    proves nothing either way: :class:`EnvironmentFailed`, so the reward worker tries again."""
    if recorded_as_given(step, lambda observation: observation_ids(tools, Step(observation=observation)) == recorded):
        return
    if step.timed_out:
        raise EnvironmentFailed(f"episode {index}: a tool call ran out of time in the replay, not in the episode")
    raise EpisodeMismatch(f"episode {index}: an environment turn differs from the environment's observation")


def replay_time_limit(section: EnvironmentSection) -> float:
    """The longest a group's replay may take when every step takes its whole limit: opening the environment and
    ``max_turns`` steps, ``(max_turns + 1) × step_timeout_s`` (the K episodes are replayed at once). The reward
    worker gives the ``environment`` function at least this, whatever ``reward.timeout_s`` says."""
    return (section.max_turns + 1) * section.step_timeout_s


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
