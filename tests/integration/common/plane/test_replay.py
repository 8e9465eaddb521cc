"""The replay stream on a real redis-server: at-least-once delivery across crashes and restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.redis_server import EmbeddedRedis
from asyncrl.common.plane.replay import ReplayReader, ReplayWriter
from asyncrl.common.tiny_models import synthetic
from tests.helpers.replay import KEYS, fill

READ_AND_HANG = textwrap.dedent(
    """
    import sys, time
    from asyncrl.common.plane.keys import RunKeys, connect
    from asyncrl.common.plane.replay import ReplayReader
    reader = ReplayReader(connect(sys.argv[1]), RunKeys("test"), consumer="doomed")
    entries = reader.read(count=int(sys.argv[2]), block_ms=5000)
    print(" ".join(e.entry_id for e in entries), flush=True)
    time.sleep(600)  # never acknowledges: killed by the test
    """
)


def test_entries_of_a_killed_consumer_are_reclaimed(redis_server, redis_client) -> None:
    ids = fill(redis_client, 5)
    ReplayReader(redis_client, KEYS)  # creates the consumer group before the reader process starts
    proc = subprocess.Popen(
        [sys.executable, "-c", READ_AND_HANG, redis_server.url, "3"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[4],
    )
    try:
        taken = proc.stdout.readline().split()
        assert taken == ids[:3]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    survivor = ReplayReader(redis_client, KEYS, consumer="survivor", claim_idle_s=0.0)
    reclaimed = survivor.recover()
    assert [e.entry_id for e in reclaimed] == ids[:3]
    fresh = survivor.read(count=10, block_ms=100)
    assert [e.entry_id for e in fresh] == ids[3:]
    assert survivor.ack(ids) == 5
    assert survivor.depth() == {"length": 5, "pending": 0}


def test_a_restarted_consumer_gets_its_own_pending_entries_first(redis_client) -> None:
    ids = fill(redis_client, 4)
    first = ReplayReader(redis_client, KEYS, consumer="learner-0")
    assert len(first.read(count=2)) == 2
    restarted = ReplayReader(redis_client, KEYS, consumer="learner-0", claim_idle_s=3600)
    assert [e.entry_id for e in restarted.recover()] == ids[:2]
    assert [e.entry_id for e in restarted.read(count=10, block_ms=100)] == ids[2:]


@pytest.mark.parametrize("how", ["shutdown", "sigkill"])
def test_redis_restart_loses_no_entry_and_no_pending_list(tmp_path: Path, how: str) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        client = connect(server.url)
        ids = fill(client, 6)
        reader = ReplayReader(client, KEYS)
        assert len(reader.read(count=2)) == 2  # two entries pending (read, unacknowledged)
        reader.ack([ids[0]])
        if how == "sigkill":
            os.kill(server.process.pid, signal.SIGKILL)  # no final flush: only what the AOF already has
            server.process.wait()
        server.stop()
        client.close()
        server = EmbeddedRedis(tmp_path / "redis", port=server.port, password=server.password).start()
        client = connect(server.url)
        reader = ReplayReader(client, KEYS)
        assert [e.entry_id for e in reader.recover()] == [ids[1]]
        assert [e.entry_id for e in reader.read(count=10, block_ms=100)] == ids[2:]
        client.close()
    finally:
        server.stop()


def test_undecodable_entries_go_to_the_dead_letter_stream(redis_client) -> None:
    good = fill(redis_client, 1)
    bad = redis_client.xadd(KEYS.replay, {b"m": b"not a message"}).decode()
    missing = redis_client.xadd(KEYS.replay, {b"other": b"field"}).decode()
    after = fill(redis_client, 1)
    reader = ReplayReader(redis_client, KEYS)
    assert [e.entry_id for e in reader.read(count=10)] == good + after
    dead = redis_client.xrange(KEYS.dead)
    assert [d[1][b"source"].decode() for d in dead] == [f"replay:{bad}", f"replay:{missing}"]
    assert b"asyncrl frame header" in dead[0][1][b"reason"]
    assert dead[0][1][b"payload"] == b"not a message"
    assert reader.depth()["pending"] == 2  # the dead ones were acknowledged, the good ones wait


def test_maxlen_trims_the_oldest_entries(redis_client) -> None:
    writer = ReplayWriter(redis_client, KEYS, maxlen=10)
    ids = []
    for i in range(30):
        ids += writer.add([synthetic.scored_group(2, 4, seed=i)])
    length = redis_client.xlen(KEYS.replay)
    assert 10 <= length < 30  # "~" trims whole macro-nodes: about maxlen, never fewer
    oldest = redis_client.xrange(KEYS.replay, count=1)[0][0].decode()
    assert oldest != ids[0] and ids[-1] == redis_client.xrevrange(KEYS.replay, count=1)[0][0].decode()
