"""Multi-turn episodes: the actor's ``multi_turn`` workflow, and the reward worker's replay that scores them.

The actor runs the K episodes of a group at once. Each alternates a model turn (one vLLM request on the whole episode so
far: the prompt's and the earlier turns' KV cache is reused through prefix caching where it is on) and an environment
step on that turn's text (:mod:`asyncrl.common.environments.protocol`), whose observation is appended as the chat
template writes it (:class:`asyncrl.common.environments.turns.TurnEncoder`). The episode travels as one response: its
tokens, μ and versions on the model's tokens (0 and the last sampled version on the environment's), and a loss mask that
is 1 on the model's tokens only, so the learner trains those and nothing the environment wrote. With a chat template
that drops past reasoning (a thinking model's), each turn is instead generated on the context the template serves for
the conversation so far, and the response is kept as rows, each a served context and the turns written on it
(:class:`ServedContext`, ``common/environments/turns.py``).

After a model turn the environment steps only when the turn ended with the template's end of turn; a turn cut by
its token budget, or one the model ended with EOS, ends the episode. An episode also ends when the environment says
done, at ``environment.max_turns``, at ``environment.max_episode_tokens`` (or the context left by the prompt), past
``environment.episode_timeout_s`` (checked before each model turn), and when
a step fails, hangs past ``environment.step_timeout_s`` or returns something unusable — then it ends with the tokens
it has, and the failure is counted (``asyncrl_actor_episode_endings_total{ending="environment_error"}``).
Environments run in a process of their own (``actors/environments/host.py``), on the run's reward workers with
``environment.isolation = "workers"`` (``actors/environments/remote.py``), or in the actor with ``"thread"``.

The reward worker does not take the actor's word for any of it: it replays each episode, or checks the signed answers
of an environment that cannot be replayed (``actors/episode_scoring.py``). An environment that cannot be replayed
(``replayable = False``) runs on the run's reward workers, which sign each of its answers; the actor takes its score at
the episode's end and carries the signed answers with the episode (``RolloutGroup.attestations``).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import json
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from asyncrl.actors.environments.host import EnvironmentHost, HostedEnvironment
from asyncrl.actors.environments.remote import RemoteEnvironments
from asyncrl.actors.generation import Generator, Response, Sampling, WorkflowContext, rollout_group, sampling_for
from asyncrl.common.config import EnvironmentSection
from asyncrl.common.environments.protocol import (
    Environment,
    EnvironmentFailed,
    EpisodeRow,
    Step,
    checked_score,
    checked_step,
    make_environment,
)
from asyncrl.common.environments.turns import EpisodeTools, Message, episode_tools, next_context, turn_text
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.metrics import (
    ACTOR_ENVIRONMENT_STEP_SECONDS,
    ACTOR_EPISODE_ENDINGS,
    ACTOR_EPISODE_TURNS,
)
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup

log = get_logger("episodes")

EpisodeEnvironment = Environment | HostedEnvironment
"""An episode's environment: one in this process, or a hosted one (:func:`open_environment`), whose every call,
``score`` too, is awaited."""


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


async def open_environment(
    section: EnvironmentSection,
    row: EpisodeRow,
    identity: dict[str, Any] | None = None,
    remote: RemoteEnvironments | None = None,
) -> EpisodeEnvironment:
    """The environment of ``row``: on the run's reward workers (``environment.isolation = "workers"``, through
    ``remote``, an actor's client of them), in the environments' own process (``"process"``, and ``"workers"``
    without a client: a reward worker's replay, an offline eval), or in this one (``"thread"``). ``identity``
    (``group_id``, ``index``) names the episode it is for: what a worker signs an environment that cannot be replayed
    for."""
    if section.isolation == "thread":
        return make_environment(section.name, section.options, row)
    host = remote if section.isolation == "workers" and remote is not None else environment_host(section)
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


class ServedContext:
    """What an episode's next model turn is generated on, after the prompt: the row it is in. Appended
    (``tools.per_turn`` false), the row is the whole episode and an environment turn adds the template's tokens for its
    observation; per turn, the template renders the whole conversation again and the row goes on or starts anew
    (``common/environments/turns.py: next_context``)."""

    def __init__(self, tools: EpisodeTools) -> None:
        self.tools = tools
        self.history: list[Message] = []

    @staticmethod
    def row(episode: Response) -> list[int]:
        """The tokens of ``episode``'s current row (after its last row start)."""
        return episode.token_ids[episode.row_starts[-1] :] if episode.row_starts else episode.token_ids

    def after(self, episode: Response, action: str, step: Step) -> tuple[list[int], bool]:
        """The tokens that follow the model's turn ``action`` (the last of ``episode``) and ``step``, the
        environment's answer to it, and whether they start a new row."""
        ids, new_row, self.history = self.following(self.row(episode), action, step.observation)
        return ids, new_row

    def following(
        self, row: list[int], action: str, observation: list[Message]
    ) -> tuple[list[int], bool, list[Message]]:
        """:meth:`after` for the current ``row`` and an ``observation``, with the conversation it makes, without
        taking it. A template that refuses the observation (one that enforces the order of roles, say) fails the
        step, not the group."""
        if not self.tools.per_turn:
            return observation_ids(self.tools, Step(observation=observation)), False, self.history
        history = [*self.history, {"role": "assistant", "content": action}, *observation]
        try:
            return (*next_context(self.tools, row, history), history)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise EnvironmentFailed(f"the chat template cannot render the conversation: {why}") from exc


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
    episode, served = Response(), ServedContext(tools)
    ending, turns, env = "max_turns", 0, None
    try:
        identity = {"group_id": group.group_id, "index": index}
        env = await open_environment(section, episode_row(group, index), identity, turn.environments)
        deadline = time.monotonic() + (section.episode_timeout_s or float("inf"))
        for turns in range(1, section.max_turns + 1):
            if turns > 1 and time.monotonic() >= deadline:
                ending, turns = "deadline", turns - 1
                break
            context = served.row(episode)
            room = min(sampling.max_tokens, budget - len(context))
            if room <= 0:
                ending = "max_tokens"
                break
            request = replace(sampling, n=1, max_tokens=room)
            [said] = await engine.generate(prompt + context, request, f"{turn.request_id}-{index}-{turns}")
            _append(episode, said.token_ids, said.logprobs, said.versions, trained=1)
            if not said.token_ids or said.token_ids[-1] != tools.end_id:
                ending = "max_tokens" if said.finish_reason == "length" else "stopped"
                break
            action = turn_text(tools.tokenizer, said.token_ids)
            step = await take_step(env, action, section.step_timeout_s, ACTOR_ENVIRONMENT_STEP_SECONDS.observe)
            if step.done:
                ending = "done"
                break
            ids, new_row = served.after(episode, action, step)
            if turns == section.max_turns:
                break
            if (0 if new_row else len(served.row(episode))) + len(ids) >= budget:
                ending = "max_tokens"
                break
            if new_row:
                episode.row_starts.append(len(episode.token_ids))
            last = episode.versions[-1]
            _append(episode, ids, [0.0] * len(ids), [last] * len(ids), trained=0)
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
