"""The control plane on a real redis-server: config, registry with TTL, prompt queue, ledger, embedded server."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import numpy as np
import pytest

from asyncrl.common.config import load_config
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.redis_server import EmbeddedRedis, EmbeddedRedisError
from asyncrl.common.plane.run_record import RunNotFoundError
from asyncrl.common.wire.messages import Heartbeat, PromptGroup
from tests.helpers.waits import wait_for


def prompt(i: int) -> PromptGroup:
    return PromptGroup(
        group_id=f"g{i}", task="arithmetic", prompt=f"{i}+1=", prompt_ids=np.array([i, 1], np.int32), num_samples=4
    )


def test_resolved_config_round_trips_through_redis(redis_client) -> None:
    config = load_config(None, ["run.name=exp", "learner.lr=0.25", "rollout.num_samples=3"])
    ControlPlane(redis_client, "exp").run.publish_config(config)
    assert ControlPlane(redis_client, "exp").run.read_config() == config
    with pytest.raises(RunNotFoundError, match="no run 'other'"):
        ControlPlane(redis_client, "other").run.read_config()


def test_every_key_lives_under_the_run_namespace(redis_client) -> None:
    plane = ControlPlane(redis_client, "ns")
    plane.run.publish_config(load_config())
    plane.run.set_version(3)
    plane.registry.beat(Heartbeat(process_id="a1", kind="actor", state="ready"), ttl_s=5)
    plane.prompts.record_issued([prompt(0)])
    plane.prompts.push_prompts([prompt(0)])
    keys = sorted(k.decode() for k in redis_client.keys("*"))
    assert keys and all(k.startswith("asyncrl:ns:") for k in keys), keys


def test_heartbeat_expiry_marks_a_process_lost(redis_client) -> None:
    plane = ControlPlane(redis_client, "r")
    plane.registry.beat(Heartbeat(process_id="alive", kind="actor", state="ready", tokens_per_s=9.0), ttl_s=30)
    plane.registry.beat(Heartbeat(process_id="doomed", kind="reward", state="ready"), ttl_s=0.2)
    plane.registry.beat(Heartbeat(process_id="polite", kind="actor", state="ready"), ttl_s=30)
    plane.registry.leave("polite")
    wait_for(lambda: not redis_client.exists(plane.keys.heartbeat("doomed")), "doomed's heartbeat to expire")
    live, lost = plane.registry.processes()
    assert [h.process_id for h in live] == ["alive"] and live[0].tokens_per_s == 9.0
    assert lost == {"doomed": "reward"}  # the kind of what was lost is kept
    plane.registry.forget(lost)
    assert plane.registry.processes()[1] == {}


def test_prompt_queue_is_fifo_and_returned_groups_go_first(redis_client) -> None:
    plane = ControlPlane(redis_client, "r")
    groups = [prompt(i) for i in range(3)]
    plane.prompts.record_issued(groups)
    plane.prompts.push_prompts(groups)
    first = plane.prompts.take_prompt("actor-a", timeout_s=1)
    assert first.group_id == "g0" and plane.prompts.ledger()["g0"].actor == "actor-a"
    plane.prompts.return_prompts([first])
    assert plane.prompts.ledger()["g0"].actor == ""
    assert [plane.prompts.take_prompt("actor-b").group_id for _ in range(3)] == ["g0", "g1", "g2"]
    assert plane.prompts.take_prompt("actor-b", timeout_s=0.1) is None
    plane.prompts.complete(["g0", "g1"])
    assert list(plane.prompts.ledger()) == ["g2"]


def test_an_actor_takes_every_free_slots_worth_at_once_eval_groups_first(redis_client) -> None:
    """``take_prompts``: up to the limit in one call, oldest first, eval groups before training groups, each held by
    the taker; a malformed one is dead-lettered and skipped, and an empty queue gives nothing after the wait."""
    plane = ControlPlane(redis_client, "r")
    groups = [prompt(i) for i in range(5)]
    plane.prompts.record_issued(groups)
    plane.prompts.push_prompts(groups[:2])
    redis_client.lpush(plane.keys.prompts, b"garbage")
    plane.prompts.push_prompts(groups[2:])
    plane.prompts.issue_eval([dataclasses.replace(prompt(9), purpose="eval")])
    taken = plane.prompts.take_prompts("actor-a", 4, timeout_s=1)
    assert [g.group_id for g in taken] == ["g9", "g0", "g1"]  # the garbage in g2's place: one short of the limit
    assert {plane.prompts.ledger()[g].actor for g in ("g0", "g1")} == {"actor-a"}
    assert redis_client.xlen(plane.keys.dead) == 1
    assert [g.group_id for g in plane.prompts.take_prompts("actor-b", 8, timeout_s=1)] == ["g2", "g3", "g4"]
    assert plane.prompts.take_prompts("actor-b", 8, timeout_s=0.1) == []


def test_a_malformed_prompt_is_dead_lettered_not_fatal(redis_client) -> None:
    plane = ControlPlane(redis_client, "r")
    redis_client.lpush(plane.keys.prompts, b"garbage")
    plane.prompts.push_prompts([prompt(1)])
    assert plane.prompts.take_prompt("a", timeout_s=1) is None  # the garbage, moved aside
    assert plane.prompts.take_prompt("a", timeout_s=1).group_id == "g1"
    assert redis_client.xlen(plane.keys.dead) == 1


def test_embedded_server_refuses_a_second_one_on_the_same_folder(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        url_file = tmp_path / "url"
        assert url_file.read_text().strip() == server.url
        assert stat.S_IMODE(url_file.stat().st_mode) == 0o600  # it holds the password
        with pytest.raises(EmbeddedRedisError, match="already runs"):
            EmbeddedRedis(tmp_path).start()
        assert connect(server.url).ping()
    assert server.process is None
    with EmbeddedRedis(tmp_path):  # free again once stopped
        pass


def test_a_start_interrupted_while_the_server_comes_up_leaves_no_server(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C while ``start`` waits for its redis-server (as ``rl-launch redis`` does): the server it spawned, in a
    session of its own, ends too, and the folder is free for the next start."""
    server = EmbeddedRedis(tmp_path)
    spawned = []

    def interrupted(*_args) -> None:
        spawned.append(server.process)
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "_wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.start()
    [proc] = spawned
    assert proc.poll() is not None and server.process is None  # stopped and reaped, not left running
    assert not (tmp_path / "server.lock").read_text().strip()  # the lock names no server
    monkeypatch.undo()
    with EmbeddedRedis(tmp_path) as again:
        assert connect(again.url).ping()


def test_embedded_server_requires_its_password(redis_server) -> None:
    import redis

    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=redis_server.port).ping()
