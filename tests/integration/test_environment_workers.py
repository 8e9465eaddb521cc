"""Environments on the run's reward workers (``environment.isolation = "workers"``): two ``rl-actor reward`` processes
serve the episodes' environments, and the test drives episodes as an actor does (the episode loop with a scripted
engine, and :class:`~asyncrl.actors.remote_environments.RemoteEnvironments` pointed at the workers their heartbeats
advertise). An episode whose worker is killed with -9 moves to the other, its steps replayed there; with no worker
left, the next one fails within its time limit and says what to do. The worker makes the environment its own config
names, never one a request names, and answers nobody without the run's credential
(refused at the CURVE handshake: nothing such a peer sends is read)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from asyncrl.actors.episodes import open_environment, use_remote_environments
from asyncrl.actors.remote_environments import RemoteEnvironments
from asyncrl.common.config import load_config
from asyncrl.common.environments.protocol import EnvironmentFailed, EpisodeRow
from asyncrl.common.environments.turns import segments
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.tiny_models.chat import build_bpe_tokenizer
from asyncrl.common.transport.rpc import RequestSocket
from asyncrl.common.wire.seal import run_seal
from tests.helpers.flood import flood
from tests.helpers.reward_stack import heartbeat, publish, start, wait_for
from tests.helpers.scrape import metric
from tests.helpers.scripted_episodes import CALL, episode, replay, tools_for
from tests.helpers.waits import wait_for as wait_until

pytestmark = pytest.mark.integration
RUN = "envs"
TOOLS = tools_for("qwen2")
SETTINGS = (
    "rollout.workflow=multi_turn",
    "environment.name=calculator",
    "environment.isolation=workers",
    "environment.step_timeout_s=5",
    'reward.functions=[{name = "environment"}]',
)


def served(redis_client, worker: str, op: str, outcome: str = "ok") -> float:
    """``asyncrl_reward_environment_requests_total{op, outcome}`` of ``worker`` (its /metrics)."""
    beat = heartbeat(redis_client, RUN, worker)
    return metric(beat, "asyncrl_reward_environment_requests_total", {"op": op, "outcome": outcome})


def moves() -> float:
    return REGISTRY.get_sample_value("asyncrl_actor_environment_moves_total") or 0.0


@pytest.fixture
def workers(redis_server, redis_client, tmp_path: Path) -> Iterator[dict]:
    """Two reward workers serving environments, ready; each worker's process and heartbeat by id. Always ended."""
    model = tmp_path / "tokenizer"
    build_bpe_tokenizer("qwen2").save_pretrained(model)
    publish(redis_client, RUN, *SETTINGS, f"model.path={model}")
    procs = {w: start(redis_server.url, RUN, w, tmp_path / f"{w}.log") for w in ("rw-1", "rw-2")}
    try:
        ready = {}
        for w, proc in procs.items():
            probe = lambda w=w: heartbeat(redis_client, RUN, w, state="ready")  # noqa: E731
            ready[w] = wait_for(probe, proc, tmp_path / f"{w}.log", "a ready heartbeat")
            assert ready[w].environment_endpoint.startswith("tcp://127.0.0.1:"), ready[w]
        yield {"procs": procs, "beats": ready}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def remote(redis_client, workers) -> Iterator[RemoteEnvironments]:
    """This process's episodes on the workers, as an actor's would be."""
    section = load_config(None, list(SETTINGS)).environment
    plane = ControlPlane(redis_client, RUN)
    client = RemoteEnvironments(section, run_seal(plane.client, plane.keys, "environments"))
    client.set_servers({beat.environment_endpoint: None for beat in workers["beats"].values()})
    use_remote_environments(client)
    try:
        yield client
    finally:
        use_remote_environments(None)
        client.close()


def test_an_episode_steps_its_environment_on_a_worker_and_is_scored(remote, redis_client) -> None:
    rollout, engine, turn = episode(TOOLS, [CALL, "42"], *SETTINGS)
    assert len(engine.prompts) == 2  # the call, then the answer after the worker's observation
    assert [t for _, _, t in segments(rollout.trained(0))] == [True, False, True]
    observation = TOOLS.tokenizer.decode(rollout.response(0)[0][~rollout.trained(0)])
    assert "42" in observation
    assert replay(TOOLS, rollout, turn) == 1.0
    steps = served(redis_client, "rw-1", "step") + served(redis_client, "rw-2", "step")
    makes = served(redis_client, "rw-1", "make") + served(redis_client, "rw-2", "make")
    assert steps >= 2 and makes >= 2  # the episode's, and its replay's


def test_an_episode_moves_when_its_worker_dies_and_fails_when_none_is_left(remote, workers) -> None:
    """kill -9 of the worker holding the environment: the connection drops, the environment is made again on the
    other worker and its first step replayed there, and the second step is answered as if nothing happened."""
    section = load_config(None, list(SETTINGS)).environment
    moved_before = moves()

    async def scenario() -> tuple:
        env = await open_environment(section, EpisodeRow(prompt="What is 6*7?", answer="42", extra={}, seed=7))
        first = await env.step(CALL)
        holder = remote._where[env.key]
        [victim] = [w for w, beat in workers["beats"].items() if beat.environment_endpoint == holder]
        os.kill(workers["procs"][victim].pid, signal.SIGKILL)
        second = await env.step(CALL)
        score = await env.score()
        moved_to = remote._where[env.key]
        survivor = next(w for w in workers["procs"] if w != victim)
        os.kill(workers["procs"][survivor].pid, signal.SIGKILL)
        with pytest.raises(EnvironmentFailed) as none_left:
            await env.step(CALL)  # lost again, and nowhere to move
        with pytest.raises(EnvironmentFailed) as no_worker:
            await open_environment(section, EpisodeRow(prompt="", answer="1", extra={}, seed=8))
        return first, second, score, holder, moved_to, str(none_left.value), str(no_worker.value)

    first, second, score, holder, moved_to, none_left, no_worker = asyncio.run(scenario())
    assert first.observation == second.observation and "42" in first.observation[0]["content"]
    assert moved_to != holder and score == 0.0  # no final answer yet: the calculator scores the last turn
    assert moves() == moved_before + 1
    for message in (none_left, no_worker):  # within environment.step_timeout_s, saying what to do
        assert "no reward worker serves environments" in message and "rl-actor reward" in message, message


def test_a_worker_makes_its_own_environment_and_serves_only_the_run(remote, redis_client, workers) -> None:
    """Requests naming another environment or an unknown op are refused; a peer without the run's credential (one
    request, and a flood of 128 frames × 4 MB from four connections) fails the handshake and costs no memory."""
    endpoint = workers["beats"]["rw-1"].environment_endpoint
    plane = ControlPlane(redis_client, RUN)
    sealed = RequestSocket("environments", run_seal(plane.client, plane.keys, "environments"), endpoint)
    stranger = RequestSocket("environments", None, endpoint)
    pid = workers["procs"]["rw-1"].pid
    try:
        grown = flood(endpoint, pid, 4 * 1024, connections=4, frames=128, frame_mb=4, hold_s=3, kind="DEALER")
        row = {"prompt": "", "answer": "42", "extra": {}, "seed": 1}
        named = {"name": "tests.helpers.episodes:Misbehaving", "options": {"how": "crash"}}
        stranger.send({"id": 1, "op": "make", "episode": "e1", "row": row})
        sealed.send({"id": 2, "op": "make", "episode": "e1", "row": row, **named})  # the name is not the wire's
        sealed.send({"id": 3, "op": "step", "episode": "e1", "action": CALL})
        sealed.send({"id": 4, "op": "jump", "episode": "e1"})
        replies = wait_for_replies(sealed, 3)
    finally:
        sealed.close()
        stranger.close()
    assert [r["id"] for r in replies] == [2, 3, 4]
    assert "error" not in replies[0] and replies[1]["observation"][0]["content"].startswith("42"), replies
    assert replies[2]["error"].startswith("refused: op must be one of make, step, score, close"), replies[2]
    beat = heartbeat(redis_client, RUN, "rw-1")
    refused = {"channel": "environments"}  # at the handshake: nothing the stranger sent was read
    wait_until(lambda: metric(beat, "asyncrl_channel_refused_handshakes_total", refused) >= 1, "the stranger refused")
    assert served(redis_client, "rw-1", "unsealed", "refused") == 0
    assert served(redis_client, "rw-1", "invalid", "refused") == 1
    assert grown < 4 * 1024, f"the worker's resident memory grew by {grown} KiB"


def wait_for_replies(socket: RequestSocket, count: int, timeout_s: float = 20) -> list[dict]:
    replies: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(replies) < count:
        assert time.monotonic() < deadline, f"only {replies} answered"
        replies += socket.recv_ready()
        time.sleep(0.01)
    return sorted(replies, key=lambda r: r["id"])
