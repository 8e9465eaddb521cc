"""Redis killed and restarted under a run: real redis-server processes, ``kill -9``, and clients from ``connect()``.

A lock left by a killed server does not block a new one on its folder (a live one still does); the new one takes
the old port and password, so a client waits through the outage and carries on — plain commands, a blocking
``XREADGROUP``, a pub/sub subscription — with everything written before the kill still there; past
``outage_s`` it raises a clear error instead. A restart does not make the dispatcher re-issue what live actors hold,
nor count anything twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncrl.common.exit_codes import ExitCode
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import RunKeys, connect
from asyncrl.common.plane.outage import OutageClock, RedisUnavailable, exit_for_outage, outage_clock, settling
from asyncrl.common.plane.prompt_ledger import add_counts
from asyncrl.common.plane.redis_server import EmbeddedRedis, EmbeddedRedisError, is_redis_server
from asyncrl.common.plane.replay import ReplayReader
from tests.helpers.dispatch import actor, make_config, make_dispatcher
from tests.helpers.replay import KEYS, fill
from tests.helpers.waits import wait_for

BIN = Path(sys.executable).parent


def kill(server: EmbeddedRedis) -> None:
    """``kill -9`` the server and leave it unreaped, as a crash would leave it to its parent: a zombie (once the
    signal has done its work: the kernel takes a moment)."""
    os.kill(server.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while is_redis_server(server.process.pid):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def blocked_in_xreadgroup(url: str) -> bool:
    """Whether a client of the server at ``url`` is blocked in ``XREADGROUP`` (``CLIENT LIST``: cmd and flag b)."""
    admin = connect(url)
    try:
        return any(c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in admin.client_list())
    finally:
        admin.close()


def count_failures(clock: OutageClock) -> list[float]:
    """The outage length (s) that each failed attempt of the clock's client saw, in order, from now on."""
    seen: list[float] = []
    failed = clock.failed

    def counted() -> float:
        seen.append(failed())
        return seen[-1]

    clock.failed = counted  # type: ignore[method-assign]
    return seen


def later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


def test_a_killed_servers_lock_does_not_block_a_new_one_and_a_live_one_is_refused(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path / "redis").start()
    try:
        assert first.lock_path.read_text().strip() == str(first.process.pid)  # the lock names its server
        with pytest.raises(EmbeddedRedisError, match=rf"\(pid {first.process.pid}\) already runs"):
            EmbeddedRedis(tmp_path / "redis").start()
        connect(first.url).set("before", "kill")
        kill(first)
        second = EmbeddedRedis(tmp_path / "redis").start()  # the lock is stale: its process is gone
        try:
            assert second.url == first.url  # same port and password, from the folder's url file
            assert connect(second.url).get("before") == b"kill"  # on the same AOF
            with pytest.raises(EmbeddedRedisError, match="already runs"):
                EmbeddedRedis(tmp_path / "redis").start()
        finally:
            second.stop()
        assert second.lock_path.read_text() == ""  # a clean stop leaves no stale lock
    finally:
        first.stop()


def test_keep_up_starts_a_dead_server_again_on_its_aof(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        url, dead = server.url, server.process
        connect(url).xadd("s", {"n": 1})
        assert server.keep_up() is None  # alive: nothing to do
        kill(server)
        dead.wait()
        restarted = server.keep_up()
        assert restarted == server.process.pid != dead.pid and server.url == url
        assert connect(url).xlen("s") == 1
    finally:
        server.stop()


def test_a_client_lives_through_a_kill_and_restart_within_the_limit(tmp_path: Path) -> None:
    """8 s down, as in the report; every kind of call a process makes resumes, nothing written before is lost.

    The client's calls end only after the restart began, its clock's outage spans the kill to the restart, and its
    pauses between attempts never exceed 1 s: it carries on within a pause of the restart, long before the limit.
    """
    server = EmbeddedRedis(tmp_path / "redis").start()
    client = connect(server.url, outage_s=30)
    client.set("config", "c")
    client.hincrby("dispatch", "created", 16)
    ids = [client.xadd("replay", {"n": i}).decode() for i in range(3)]
    client.xgroup_create("replay", "learner", id="0")
    client.xreadgroup("learner", "learner-0", {"replay": ">"}, count=10)  # all three pending: the next read blocks
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("announce")
    heard: list[bytes] = []
    listening = threading.Event()
    listening.set()

    def listen() -> None:  # as an actor's manifest listener does
        while listening.is_set():
            if (message := pubsub.get_message(timeout=0.5)) is not None:
                heard.append(message["data"])

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    blocked: dict[str, object] = {}
    reader = threading.Thread(
        target=lambda: blocked.update(
            reply=client.xreadgroup("learner", "learner-0", {"replay": ">"}, count=10, block=30_000)
        )
    )
    reader.start()
    wait_for(lambda: blocked_in_xreadgroup(server.url), "the reader blocked in XREADGROUP")
    killed = time.time()
    kill(server)
    began: list[float] = []  # when the restart began: before the new server can answer anything
    restarted: dict[str, EmbeddedRedis] = {}

    def restart() -> None:
        began.append(time.time())
        restarted.update(server=EmbeddedRedis(tmp_path / "redis").start())

    later(8.0, restart)
    try:
        assert client.get("config") == b"c"  # waits for the restart, then answers
        answered = time.time()
        assert began  # no answer before the restart began: it waited through the whole outage
        later_id = client.xadd("replay", {"n": 3}).decode()  # what the blocked reader waits for
        reader.join(30)
        assert not reader.is_alive()
        assert [e.decode() for e, _ in blocked["reply"][0][1]] == [later_id]  # resumed its block, got the new entry
        assert client.xpending("replay", "learner")["pending"] == 4  # what was pending before the kill stays pending
        assert [e.decode() for e, _ in client.xrange("replay")][:3] == ids
        assert int(client.hget("dispatch", "created")) == 16
        publisher = connect(restarted["server"].url)

        def heard_after_publishing() -> list[bytes]:
            publisher.publish("announce", "7")
            return heard

        # the subscription comes back by itself (a message sent before is lost)
        wait_for(heard_after_publishing, "a message on the subscription", timeout_s=10, poll_s=0.2)
        assert heard[0] == b"7"
        clock = outage_clock(client)
        [(down, up)] = clock.outages  # one outage, from the first failure after the kill to the first success after
        assert clock.generation == 1 and killed <= down < began[0] <= up <= answered
        assert clock.down_between(0, time.time()) == pytest.approx(up - down)
        pauses = client.get_connection_kwargs()["retry"]._backoff  # how long it waits between attempts
        assert max(pauses.compute(n) for n in range(1, 200) for _ in range(5)) <= 1.0
    finally:
        listening.clear()
        listener.join(10)  # out of get_message before the subscription closes
        pubsub.close()
        if "server" in restarted:
            restarted["server"].stop()
        server.stop()


def test_past_the_limit_a_client_raises_a_clear_error_and_recovers_later(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        client = connect(server.url, outage_s=2)
        client.set("k", "v")
        seen = count_failures(outage_clock(client))
        kill(server)
        with pytest.raises(
            RedisUnavailable, match=r"unreachable for \d+\.\ds \(limit 2s, transport.redis_outage_s\)"
        ) as e:
            client.xreadgroup("g", "c", {"s": ">"}, block=1000)
        # it retried until the outage reached the limit, and gave up at the first attempt past it
        assert e.value.down_s >= 2 and len(seen) > 1 and seen[-1] == e.value.down_s
        assert sum(s >= 2 for s in seen) == 1
        assert server.password not in str(e.value)  # what is logged names the address only
        tried = len(seen)
        with pytest.raises(RedisUnavailable):  # already past the limit: at once, one attempt and no retry
            client.get("k")
        assert len(seen) == tried + 1
        outage = RedisUnavailable("127.0.0.1:1/0", 2.5, 2, "refused")
        assert exit_for_outage(outage, "test") == ExitCode.REDIS_OUTAGE == 75
        server.process.wait()
        server.restart()
        assert client.get("k") == b"v"  # the first success ends the outage
    finally:
        server.stop()


def test_a_replayed_transaction_adds_its_counts_once(redis_client) -> None:
    """redis-py sends a pipeline again after a connection error; when Redis had run it (the reply lost), the
    dispatcher's counters must not move twice."""
    keys = RunKeys("once")
    pipe = redis_client.pipeline(transaction=True)
    pipe.hset(keys.groups, "g1", "payload")
    add_counts(pipe, keys, {"created": 4, "released": 4})
    stack = list(pipe.command_stack)
    pipe.execute()
    replay = redis_client.pipeline(transaction=True)
    replay.command_stack = stack  # the same commands, as redis-py's retry sends them
    replay.execute()
    assert redis_client.hgetall(keys.dispatch) == {b"created": b"4", b"released": b"4"}
    ControlPlane(redis_client, "once").prompts.add_dispatch_counts({"created": 1})  # a new change does count
    assert redis_client.hget(keys.dispatch, "created") == b"5"


def test_a_delivery_cut_by_the_restart_is_read_again(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        client = connect(server.url, outage_s=30)
        ids = fill(client, 6)
        reader = ReplayReader(client, KEYS)
        assert [e.entry_id for e in reader.read(count=2)] == ids[:2]
        # Redis delivers two more to the learner and dies before the reply gets out: they sit in its pending list
        connect(server.url).xreadgroup(reader.group, reader.consumer, {KEYS.replay: ">"}, count=2)
        kill(server)
        server.process.wait()
        later(1.0, server.restart)
        assert [e.entry_id for e in reader.read(count=2)] == ids[4:] + ids[2:4]  # the cut delivery comes back
        assert reader.read(count=10, block_ms=100) == []  # once
    finally:
        server.stop()


def test_a_restart_re_issues_nothing_that_live_actors_hold(tmp_path: Path) -> None:
    """Down longer than the heartbeat TTL: every heartbeat expired meanwhile (Redis keeps absolute expiry times), and
    the groups are older than their deadline by the time it is back; neither counts until a TTL after Redis is back,
    and then only the holder that never came back loses its group."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        config = make_config(max_staleness=0, groups_per_step=2)
        config.transport.heartbeat_s, config.transport.heartbeat_ttl_s = 0.5, 2.0
        d = make_dispatcher(connect(server.url, outage_s=30), config)
        plane = d.plane
        actor(plane, "actor-a", ttl_s=2.0)
        actor(plane, "actor-gone", ttl_s=2.0)
        assert d.release(0) == 2
        kept, orphan = plane.prompts.take_prompt("actor-a"), plane.prompts.take_prompt("actor-gone")
        kill(server)
        server.process.wait()
        later(3.0, server.restart)
        actor(plane, "actor-a", ttl_s=2.0)  # waits for the restart, then beats again; actor-gone never does
        assert d.reissue_overdue(deadline_s=3.0) == (0, 0)  # > 3 s old, 3 s of it down; heartbeats not judged yet
        wait_for(lambda: not settling(plane.client, 2.0), "a heartbeat TTL after Redis came back")
        actor(plane, "actor-a", ttl_s=2.0)
        assert d.reissue_overdue(deadline_s=3.0) == (1, 0)  # only the group of the holder that is really gone
        ledger = plane.prompts.ledger()
        assert ledger[kept.group_id].actor == "actor-a" and ledger[orphan.group_id].attempts == 2
    finally:
        server.stop()


def test_rl_launch_redis_exits_when_its_server_dies_and_starts_again_on_the_same_folder(tmp_path: Path) -> None:
    args = [str(BIN / "rl-launch"), "redis", "--set", f"run.root={tmp_path}", "--set", "run.name=outage"]
    folder = tmp_path / "outage" / "redis"
    first = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    procs = [first]
    try:
        url = wait_for(lambda: (folder / "url").read_text().strip(), "the server's url file", proc=first, poll_s=0.1)
        plane = ControlPlane(connect(url), "outage")
        wait_for(lambda: plane.client.exists(plane.keys.config), "the published config", proc=first, poll_s=0.1)
        plane.client.set("asyncrl:outage:version", 4)
        refused = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "already runs" in refused.stderr  # a live server is never doubled
        os.kill(int((folder / "server.lock").read_text()), signal.SIGKILL)
        assert first.wait(30) == 1
        assert "start it again with the same command" in first.stderr.read()
        second = subprocess.Popen(args, stderr=subprocess.DEVNULL)
        procs.append(second)
        # same port and password: the old client reconnects
        wait_for(plane.client.ping, "the restarted server", proc=second, poll_s=0.1)
        assert plane.run.version() == 4 and (folder / "url").read_text().strip() == url
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(30)
