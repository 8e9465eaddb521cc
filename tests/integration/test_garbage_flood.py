"""Garbage at ≥ 10k messages per second on every socket and stream a peer can reach — 0 crashes, bounded
memory, every bad message counted, bounded logs and dead-letter stream.

Two receivers, each a real process: a reward worker (``rl-actor reward``: the one ZeroMQ socket that receives, its
PULL) and the learner's replay consumer (:class:`asyncrl.common.plane.replay.ReplayReader`, driven alone by
``tests/helpers/replay_consumer.py`` against a real redis-server). Each is flooded for ``ASYNCRL_FLOOD_S`` seconds
(default 5) with every kind in ``tests/helpers/garbage.py``, then must still take a real group. Counts are exact:
PUSH blocks at the high-water mark rather than drop, and the flood writes the replay stream without trimming, so every
message sent reaches the receiver. The one exception is a frame above the size limit, which libzmq refuses before the
process sees it (it drops the connection): those go on a separate socket and are expected uncounted. Rates are
printed, never asserted (``pytest -s`` shows them): this machine's two cores are shared.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import zmq

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.dead_letters import DEAD_LETTER_MAXLEN
from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.tiny_models import synthetic
from asyncrl.common.transport.channel import PushChannel
from asyncrl.common.wire.messages import encode, encode_blob
from tests.helpers.flood import resident_kib
from tests.helpers.garbage import bad_blob, bad_messages
from tests.helpers.reward_stack import heartbeat, publish, read_replay, reward_worker, wait_for
from tests.helpers.rollouts import issue, make_group

ROOT = Path(__file__).resolve().parents[2]
FLOOD_S = float(os.environ.get("ASYNCRL_FLOOD_S", "5"))
MAX_BYTES = 2**18  # transport.max_message_mb = 0.25: oversized messages stay cheap to send
MAX_GROWTH = 200 * 2**20
"""Resident memory a receiver may gain over a flood."""
# Oversized messages are a quarter of a megabyte: rarer than the others, or they alone would set the rate.
WEIGHTS = {"oversized": 1} | {kind: 20 for kind in ("random_bytes", "truncated_msgpack")}


def samples(port: int, name: str) -> dict[str, float]:
    """Every sample of metric ``name`` on ``127.0.0.1:port/metrics``, by its label set."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith((f"{name} ", f"{name}{{")):
            labels, value = line.rsplit(" ", 1)
            found[labels[len(name) :]] = float(value)
    return found


def log_lines(log: Path, text: str) -> int:
    return sum(text in line for line in log.read_text(errors="replace").splitlines())


@dataclass
class Flood:
    """What one flood did to its receiver; :meth:`check` prints the figures, then asserts the bounds."""

    target: str
    sent: int
    seconds: float
    drained_s: float
    """From the end of the flood until the valid message sent after it came out."""
    counted: int
    rss_before: int
    rss_after: int
    dead_letters: int
    field_labels: int
    log_lines: int

    def check(self) -> None:
        figures = {k: round(v, 1) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}
        figures["rate_per_s"] = round(self.sent / self.seconds)
        figures |= {"rss_before": f"{self.rss_before / 2**20:.1f}MB", "rss_after": f"{self.rss_after / 2**20:.1f}MB"}
        print(f"\nflood {self.target}: " + " ".join(f"{k}={v}" for k, v in figures.items() if k != "target"))
        assert self.counted == self.sent
        assert self.rss_after - self.rss_before < MAX_GROWTH
        assert self.dead_letters <= DEAD_LETTER_MAXLEN * 1.1  # MAXLEN ~ trims whole nodes: a little above the cap
        assert self.field_labels < 40  # one label per schema path, however many keys and positions were chosen
        assert 0 < self.log_lines < 10 * self.field_labels  # the 1st, 10th, 100th, ... of each field


def test_reward_worker_survives_a_garbage_flood_on_its_pull_socket(redis_server, redis_client, tmp_path) -> None:
    run = "flood"
    publish(redis_client, run, f"transport.max_message_mb={MAX_BYTES / 2**20}")
    plane = ControlPlane(redis_client, run)
    first, last = make_group(["19"], group_id="before"), make_group(["19", "20"], group_id="after")
    issue(plane, first, last)
    # Sealed with the run secret, as a member's buggy process would send it: a stranger's garbage is refused before
    # decoding (test_reward_worker.py), this is the decoder's own flood.
    seal = run_seal(redis_client, RunKeys(run), "rollouts")
    bad = itertools.islice(bad_messages(first, MAX_BYTES, seed=1, weights=WEIGHTS), 4000)
    pool = [(kind, seal.seal(frames)) for kind, frames in bad]
    with reward_worker(redis_server, redis_client, tmp_path, run) as (proc, endpoint):
        log = tmp_path / f"{run}.log"
        port = int(heartbeat(redis_client, run, "rw-1").metrics_url.rsplit(":", 1)[1].split("/")[0])
        # Members' sockets (the run's CURVE keys), written to raw: the frames are sealed already. A receiver that
        # stopped taking messages fails the test (60 s send timeout) instead of hanging it.
        member = PushChannel("rollouts", hwm=1000, send_timeout_s=60, seal=seal)
        member.connect(endpoint)
        oversize = PushChannel("rollouts", seal=seal)  # frames above the limit: refused inside libzmq
        oversize.connect(endpoint)
        push, big = member.socket, oversize.socket
        try:
            push.send_multipart(seal.seal(encode(first)), copy=False)
            assert [e.group.rollout.group_id for e in read_replay(redis_client, run, 1)] == ["before"]
            rss_before = resident_kib(proc.pid) * 1024
            sent, seconds = flood(push, pool)
            for _ in range(3):
                big.send(bytes(MAX_BYTES + 1))
            push.send_multipart(seal.seal(encode(last)), copy=False)  # after every bad one on the same connection
            drained = time.perf_counter()
            scored = read_replay(redis_client, run, 1, timeout_s=300)
            drained = time.perf_counter() - drained
            rss_after = resident_kib(proc.pid) * 1024
        finally:
            member.close()
            oversize.close()
        assert proc.poll() is None, log.read_text()[-5000:]
        assert [e.group.rollout.group_id for e in scored] == ["after"]
        counted = wait_for(lambda: malformed(port, sent), proc, log, f"{sent} malformed messages counted")
        fields = samples(port, "asyncrl_wire_malformed_messages_total")
        dead = redis_client.xlen(RunKeys(run).dead)
    warnings = log_lines(log, "dropped a malformed message")
    # Not in the count: the 3 frames above the limit that libzmq refused.
    Flood(
        "reward worker PULL", sent, seconds, drained, counted, rss_before, rss_after, dead, len(fields), warnings
    ).check()


def malformed(port: int, expected: int) -> int | None:
    counted = int(sum(samples(port, "asyncrl_wire_malformed_messages_total").values()))
    return counted if counted >= expected else None


def flood(push: zmq.Socket, pool: list[tuple[str, list[bytes]]]) -> tuple[int, float]:
    """Send the pool round and round for :data:`FLOOD_S`; returns (messages sent, seconds)."""
    sent, started, messages = 0, time.perf_counter(), itertools.cycle(pool)
    while (elapsed := time.perf_counter() - started) < FLOOD_S:
        for _ in range(256):
            push.send_multipart(next(messages)[1], copy=False)
        sent += 256
    return sent, elapsed


def test_replay_consumer_survives_a_garbage_flood_in_the_replay_stream(redis_server, redis_client, tmp_path) -> None:
    run, keys = "flood", RunKeys("flood")
    log = tmp_path / "consumer.log"
    valid = synthetic.scored_group(2, 4, vocab_size=64)
    rng = random.Random(2)
    blobs = [bad_blob(frames, rng) for _, frames in itertools.islice(bad_messages(valid, MAX_BYTES, 2, WEIGHTS), 4000)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "tests.helpers.replay_consumer", redis_server.url, run, str(MAX_BYTES), "64"]
    with log.open("w") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
    try:
        port = int(proc.stdout.readline().split()[1])
        redis_client.xadd(keys.replay, {b"m": encode_blob(valid)})
        wait_for(lambda: samples(port, "asyncrl_replay_entries_read_total").get("") == 1, proc, log, "the first group")
        rss_before = resident_kib(proc.pid) * 1024
        sent, seconds = flood_stream(redis_client, keys.replay, blobs)
        drained = time.perf_counter()
        redis_client.xadd(keys.replay, {b"m": encode_blob(valid)})
        wait_for(
            lambda: samples(port, "asyncrl_replay_entries_read_total").get("") == 2,
            proc,
            log,
            "the group after the flood",
            timeout_s=300,
        )
        drained = time.perf_counter() - drained
        rss_after = resident_kib(proc.pid) * 1024
        fields = samples(port, "asyncrl_replay_dead_letters_total")
        counted = int(sum(fields.values()))
        pending = redis_client.xpending(keys.replay, "learner")["pending"]
        dead = redis_client.xlen(keys.dead)
        assert proc.poll() is None, log.read_text()[-5000:]
    finally:
        proc.terminate()
        proc.wait(20)
    warnings = log_lines(log, "dead-lettered an undecodable replay entry")
    assert pending == 0
    Flood("replay stream", sent, seconds, drained, counted, rss_before, rss_after, dead, len(fields), warnings).check()


def flood_stream(client, stream: str, blobs: list[bytes]) -> tuple[int, float]:
    """XADD the blobs round and round for :data:`FLOOD_S`, 500 a round trip (1 in 50 under a field that is not the
    replay's); no trimming, so every entry reaches the consumer. Returns (entries sent, seconds)."""
    sent, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < FLOOD_S:
        pipe = client.pipeline(transaction=False)
        for i in range(500):
            pipe.xadd(stream, {b"junk" if i % 50 == 0 else b"m": blobs[(sent + i) % len(blobs)]})
        pipe.execute()
        sent += 500
    return sent, elapsed


def test_a_fresh_curve_key_per_handshake_is_remembered_and_logged_within_bounds(tmp_path, monkeypatch) -> None:
    """A flood of handshakes, each with a new key: the refused-key set stops at MAX_LOGGED_KEYS, and past it a
    refusal is logged at the 1st, 10th, 100th, … (not once per key, which would be a line per handshake)."""
    from asyncrl.common.transport import curve

    lines: list[dict] = []
    monkeypatch.setattr(curve.log, "warning", lambda message, **fields: lines.append(fields))
    (tmp_path / "authorized").mkdir()
    check = curve.AuthorizedKeys("rollouts", tmp_path / "authorized")
    for n in range(10_000):
        assert not check.callback("*", f"{n:040d}".encode())
    assert not check.callback("*", f"{0:040d}".encode())  # a key seen before is not logged again
    assert len(check.refused) == curve.MAX_LOGGED_KEYS and check.refusals == 10_001
    assert len(lines) == curve.MAX_LOGGED_KEYS + 1  # each of the first 1000 keys, then the 10000th refusal
    assert lines[-1]["refused"] == 10_000
