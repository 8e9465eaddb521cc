"""Environments on the run's reward workers (``environment.isolation = "workers"``): two ``rl-actor reward`` processes
serve the episodes' environments, and the test drives episodes as an actor does (the episode loop with a scripted
engine, and :class:`~asyncrl.actors.environments.remote.RemoteEnvironments` pointed at the workers their heartbeats
advertise). An episode whose worker is killed with -9 moves to the other, its steps replayed there; with no worker
left, the next one fails within its time limit and says what to do. The worker makes the environment its own config
names, never one a request names, and answers nobody without the run's credential
(refused at the CURVE handshake: nothing such a peer sends is read).

An environment that cannot be replayed (``tests/helpers/unreplayable.py``: every answer from the operating system's
random source) runs on a worker of a run of its own, which signs each answer; the same worker scores its episodes
from those signatures: an honest episode with exactly the rewards it signed, while one with an observation token
changed, one signed by a key no reward worker advertised, or one carrying another episode's signatures is
dead-lettered with the reason; such an episode never moves when its worker dies."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from asyncrl.actors.environments.host import HostedEnvironment
from asyncrl.actors.environments.remote import RemoteEnvironments
from asyncrl.actors.episodes import open_environment
from asyncrl.common.config import load_config
from asyncrl.common.environments.protocol import EnvironmentFailed, EpisodeRow
from asyncrl.common.environments.turns import turn_text
from asyncrl.common.observability.procs import descendants
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.tiny_models.chat import build_bpe_tokenizer
from asyncrl.common.transport.channel import PushChannel
from asyncrl.common.transport.rpc import RequestSocket
from asyncrl.common.wire.attestation import EpisodeAttestation, EpisodeIdentity, Signer, score_message, step_message
from asyncrl.common.wire.messages import Heartbeat, RolloutGroup, segments
from tests.helpers.costs import command_line
from tests.helpers.flood import flood
from tests.helpers.reward_stack import heartbeat, publish, read_replay, start, wait_for, wait_ready
from tests.helpers.rollouts import issue
from tests.helpers.scrape import metric
from tests.helpers.scripted_episodes import CALL, episode, replay, tools_for
from tests.helpers.unreplayable import ENOUGH
from tests.helpers.waits import wait_for as wait_until

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


def environment_processes(pid: int) -> list[int]:
    """The environment processes below ``pid`` (one that ended while looked at is not one)."""
    found = []
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            if "asyncrl.actors.environments.host" in command_line(child):
                found.append(child)
    return found


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
            ready[w] = wait_ready(redis_client, RUN, w, proc, tmp_path / f"{w}.log")
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
    try:
        yield client
    finally:
        client.close()


def test_an_episode_steps_its_environment_on_a_worker_and_is_scored(remote, redis_client, workers) -> None:
    for proc in workers["procs"].values():  # each worker started its environment process before it said it was ready
        assert environment_processes(proc.pid), proc.pid
    rollout, engine, turn = episode(TOOLS, [CALL, "42"], *SETTINGS, remote=remote)
    assert len(engine.prompts) == 2  # the call, then the answer after the worker's observation
    assert [t for _, _, t in segments(rollout.trained(0))] == [True, False, True]
    observation = TOOLS.tokenizer.decode(rollout.response(0)[0][~rollout.trained(0)])
    assert "42" in observation
    assert replay(TOOLS, rollout, turn) == 1.0
    steps = served(redis_client, "rw-1", "step") + served(redis_client, "rw-2", "step")
    makes = served(redis_client, "rw-1", "make") + served(redis_client, "rw-2", "make")
    assert (steps, makes) == (2, 1)  # the episode's two turns; its replay ran in this process's own host, as a worker's


def test_an_episode_moves_when_its_worker_dies_and_fails_when_none_is_left(remote, workers) -> None:
    """kill -9 of the worker holding the environment: the connection drops, the environment is made again on the
    other worker and its first step replayed there, and the second step is answered as if nothing happened."""
    section = load_config(None, list(SETTINGS)).environment
    moved_before = moves()

    async def scenario() -> tuple:
        row = EpisodeRow(prompt="What is 6*7?", answer="42", extra={}, seed=7)
        env = await open_environment(section, row, None, remote)
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
            await open_environment(section, EpisodeRow(prompt="", answer="1", extra={}, seed=8), None, remote)
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


# --------------------------------------------------------------------------- an environment that cannot be replayed

SEALED = "sealed"
UNREPLAYABLE = (
    "rollout.workflow=multi_turn",
    "environment.name=tests.helpers.unreplayable:Dice",
    "environment.isolation=workers",
    "environment.step_timeout_s=5",
    'reward.functions=[{name = "environment"}]',
)
ROLLS = ["roll", "roll", ENOUGH]
"""Two rolls, each answered with a random die, then the end: three signed steps and a signed score."""


@pytest.fixture
def sealed(redis_server, redis_client, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Heartbeat, Path]]:
    """One reward worker of a run whose environment cannot be replayed, ready: its process, heartbeat and log."""
    model = tmp_path / "tokenizer"
    build_bpe_tokenizer("qwen2").save_pretrained(model)
    publish(redis_client, SEALED, *UNREPLAYABLE, f"model.path={model}", "task.name=file")  # the episodes' task
    log = tmp_path / "sealed.log"
    proc = start(redis_server.url, SEALED, "rw-s", log)
    try:
        beat = wait_ready(redis_client, SEALED, "rw-s", proc, log)
        yield proc, beat, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_an_environment_that_cannot_be_replayed_is_scored_from_what_its_worker_signed(redis_client, sealed) -> None:
    proc, beat, log = sealed
    section = load_config(None, list(UNREPLAYABLE)).environment
    plane = ControlPlane(redis_client, SEALED)
    client = RemoteEnvironments(section, run_seal(plane.client, plane.keys, "environments"))
    client.set_servers({beat.environment_endpoint: None})
    try:
        honest, forged, foreign, moved = (
            episode(TOOLS, ROLLS, *UNREPLAYABLE, group_id=f"{SEALED}-{name}", remote=client)[0]
            for name in ("honest", "forged", "foreign", "moved")
        )
        signed = EpisodeAttestation.from_json(honest.attestations[0])
        assert signed.signer == beat.environment_signing_key and len(signed.steps) == 3 and signed.score is not None
        observations = TOOLS.tokenizer.decode(honest.response(0)[0][~honest.trained(0)])
        assert observations.count("The die shows") == 2  # what the worker's environment said, in the episode
        (_, _, _), (start_, _, _), *_ = segments(forged.trained(0))
        changed = forged.token_ids.copy()
        changed[start_ + 2] += 1  # one token of the first observation
        forged = dataclasses.replace(forged, token_ids=changed)
        foreign = resigned(foreign, Signer())  # every signature good, by a key no reward worker advertised
        moved = dataclasses.replace(moved, attestations=honest.attestations)  # the worker's, for another episode
        entries, dead = score_on_worker(redis_client, beat, proc, log, honest, forged, foreign, moved)
        lost = asyncio.run(lose_the_worker(section, proc, client))
    finally:
        client.close()
    [scored] = [entry.group for entry in entries]
    expected = [step.reward for step in signed.steps]
    expected[-1] += signed.score  # the score is the last turn's, as a replay's would be
    assert scored.rollout.group_id == f"{SEALED}-honest" and scored.rollout.attestations == []  # checked, dropped
    assert np.allclose(scored.turn_rewards, np.array(expected, np.float32))
    assert np.isclose(scored.rewards[0], sum(expected))
    assert len(dead) == 3 and {fields[b"source"] for _, fields in dead} == {b"reward"}  # refused: dead-lettered at once
    refused = " | ".join(fields[b"reason"].decode() for _, fields in dead)
    assert "refused: episode 0: an environment turn differs from the environment's observation" in refused, refused
    assert "refused: episode 0 is signed by a key that no reward worker of this run advertised" in refused, refused
    assert "refused: episode 0: the signature of turn 1 does not verify for this run, episode" in refused, refused
    assert "cannot be replayed, so its episode cannot move" in lost[0] and lost[1] < section.step_timeout_s, lost
    assert lost[2] == 0  # never moved: no other worker could vouch for the steps it took


def resigned(group: RolloutGroup, signer: Signer) -> RolloutGroup:
    """``group`` with its one episode's attestation signed again, well, by ``signer``."""
    record = EpisodeAttestation.from_json(group.attestations[0])
    identity = EpisodeIdentity(SEALED, group.group_id, 0, record.episode)
    ids, trained = group.response(0)[0], group.trained(0)
    actions = [turn_text(TOOLS.tokenizer, ids[start:end].tolist()) for start, end, model in segments(trained) if model]
    steps = tuple(
        dataclasses.replace(
            step, signature=signer.sign(step_message(identity, turn, action, step.observation, step.reward, step.done))
        )
        for turn, (action, step) in enumerate(zip(actions, record.steps, strict=True), 1)
    )
    assert record.score is not None
    score_signature = signer.sign(score_message(identity, len(steps), record.score))
    forged = dataclasses.replace(record, signer=signer.public_hex, steps=steps, score_signature=score_signature)
    return dataclasses.replace(group, attestations=[forged.to_json()])


def score_on_worker(redis_client, beat: Heartbeat, proc, log: Path, *groups: RolloutGroup) -> tuple[list, list]:
    """Issue ``groups`` as the learner would, push them to the worker as an actor does; what it wrote to the replay
    stream (the first group's) and its dead letters (the others'), once every group is in one or the other."""
    issue(ControlPlane(redis_client, SEALED), *groups)
    push = PushChannel("rollouts", send_timeout_s=10, seal=run_seal(redis_client, RunKeys(SEALED), "rollouts"))
    push.connect(beat.endpoint)
    try:
        for group in groups:
            push.send(group)
        entries = read_replay(redis_client, SEALED, 1, timeout_s=120)

        def refused() -> list | None:
            letters = redis_client.xrange(RunKeys(SEALED).dead)
            return letters if len(letters) >= len(groups) - 1 else None

        dead = wait_for(refused, proc, log, "a dead letter for each forged group", timeout_s=120)
        assert dead is not None
    finally:
        push.close()
    return entries, dead


async def lose_the_worker(section, proc: subprocess.Popen, remote: RemoteEnvironments) -> tuple[str, float, float]:
    """An episode stepped once, then its worker killed -9: (why the next step failed, how long it took, the moves)."""
    moved_before = moves()
    identity = {"group_id": "lost", "index": 0}
    env = await open_environment(section, EpisodeRow(prompt="", answer="", seed=1), identity, remote)
    assert isinstance(env, HostedEnvironment)  # on the worker
    await env.step("roll")
    os.kill(proc.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EnvironmentFailed) as failed:
        await env.step("roll")
    return str(failed.value), time.monotonic() - started, moves() - moved_before
