"""The audit trail (``common/plane/audit.py``) against a real Redis: what an entry holds, that no secret gets
in, that a Redis that is down stops nothing, that the mirror copies each entry exactly once across a restart, that
refusal floods stay small, and that real processes (a reward worker, the registry) record what they should."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import redis
from redis.backoff import ConstantBackoff
from redis.retry import Retry

from asyncrl.common.observability.metrics import AUDIT_FAILURES
from asyncrl.common.plane import audit as audit_module
from asyncrl.common.plane.audit import AUDIT_MAXLEN, MAX_REASONS, REDACTED, Audit, scrub
from asyncrl.common.plane.audit_file import AuditMirror, entry_line
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.dead_letters import dead_letter
from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.transport.channel import ChannelBlocked, PushChannel
from asyncrl.common.transport.curve import CurveClient, create_keypair, create_run_keys
from asyncrl.common.wire.messages import Heartbeat
from tests.helpers.audit_trail import entries
from tests.helpers.reward_stack import publish, start, stop, wait_ready
from tests.helpers.rollouts import issue, make_group
from tests.helpers.waits import wait_for


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_entry_says_what_happened_when_and_who_recorded_it(redis_client) -> None:
    before = time.time()
    Audit(redis_client, "fields", "actor-3", "actor").record("weights.loaded", version=7, digest="ab" * 32)
    assert audit_module.flush(30, redis_client)
    [(entry_id, raw)] = redis_client.xrange(RunKeys("fields").audit)
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    assert fields["event"] == "weights.loaded"
    assert (fields["process"], fields["kind"]) == ("actor-3", "actor")
    assert (fields["host"], fields["pid"]) == (socket.gethostname(), str(os.getpid()))
    assert before - 1 <= float(fields["unix"]) <= time.time() + 1
    assert fields["time"].endswith("Z") and fields["time"][:4].isdigit()  # ISO 8601, UTC
    assert json.loads(fields["data"]) == {"version": 7, "digest": "ab" * 32}
    line = entry_line(entry_id.decode(), raw)
    assert line["who"] == {"process": "actor-3", "kind": "actor", "host": socket.gethostname(), "pid": os.getpid()}
    assert (line["id"], line["event"], line["version"]) == (entry_id.decode(), "weights.loaded", 7)


def test_no_secret_reaches_the_stream(redis_server, redis_client) -> None:
    password = redis_server.password
    Audit(redis_client, "secrets", "learner", "learner").record(
        "run.started",
        url=redis_server.url,  # redis://:<password>@127.0.0.1:port
        other="see https://alice:hunter2-long@example.org/x?token=abc123&x=1",
        secret="s3cr3t-value",
        key_secret="Z85secretkey",
        auth_token="tok-123456",
        nested={"redis_password": "pw-654321", "note": f"the password is {password}"},
        tokens=1234,  # a count, not a secret
        event="not the event",  # a reserved name keeps its value under event_
    )
    assert audit_module.flush(30, redis_client)
    raw = json.dumps(
        [
            [i.decode(), {k.decode(): v.decode() for k, v in f.items()}]
            for i, f in redis_client.xrange(RunKeys("secrets").audit)
        ]
    )
    for secret in (password, "hunter2-long", "abc123", "s3cr3t-value", "Z85secretkey", "tok-123456", "pw-654321"):
        assert secret not in raw
    [line] = entries(redis_client, "secrets")
    assert line["url"].startswith("redis://:***@127.0.0.1:")
    assert line["other"] == "see https://alice:***@example.org/x?token=***&x=1"
    assert line["secret"] == line["key_secret"] == line["auth_token"] == REDACTED
    assert line["nested"] == {"redis_password": REDACTED, "note": "the password is ***"}
    assert line["tokens"] == 1234 and line["event"] == "run.started" and line["event_"] == "not the event"


def test_scrub_cuts_long_text_and_keeps_plain_values() -> None:
    assert scrub({"n": 3, "x": 0.5, "ok": True, "none": None, "p": Path("/a")}) == {
        "n": 3,
        "x": 0.5,
        "ok": True,
        "none": None,
        "p": "/a",
    }
    assert len(scrub("y" * 10_000)) == audit_module.MAX_TEXT + 1


class Gated(redis.Redis):
    """A client whose every ``XADD`` first waits until :attr:`gate` is set: whoever calls one is stuck till then."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.gate, self.entered = threading.Event(), threading.Event()

    def xadd(self, *args: object, **kwargs: object) -> object:
        self.entered.set()
        self.gate.wait(120)
        return super().xadd(*args, **kwargs)


def test_a_redis_that_is_down_does_not_stop_the_recording_process(own_redis_server) -> None:
    """Both calls return while the writer's ``XADD`` is held (a caller that waited for it would have counted a failure
    when it returned); once let through, each fails after the client's retries, and is counted."""
    redis_server = own_redis_server
    port = redis_server.port
    # a client that retries a little, as every process's client waits out an outage (for longer)
    down = Gated.from_url(f"redis://:{redis_server.password}@127.0.0.1:{port}/0", retry=Retry(ConstantBackoff(0.1), 3))
    redis_server.stop()
    failed = AUDIT_FAILURES.labels("record")._value.get()
    audit = Audit(down, "down", "actor-0", "actor")
    try:
        audit.record("process.joined", version=0)  # returns at once, does not raise
        assert audit.refused("message.refused", "replay", source="replay:1-0") is True
        assert down.entered.wait(30)  # the writer thread waits for Redis, not the caller
        assert AUDIT_FAILURES.labels("record")._value.get() == failed and not down.gate.is_set()
    finally:
        down.gate.set()
    assert audit_module.flush(30, down)  # given up on once the client's outage limit passed
    assert AUDIT_FAILURES.labels("record")._value.get() == failed + 2


def test_entries_for_a_server_that_is_away_do_not_hold_up_those_for_a_live_one(redis_client) -> None:
    """The entry for the server that is away is held in its ``XADD`` until the live one's is written: one queue for
    both would never write the live one; then it is given up on, after the client's retries."""
    with socket.socket() as s:  # a port nothing listens on: a server that is away
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    away = Gated(host="127.0.0.1", port=port, retry=Retry(ConstantBackoff(0.1), 3))
    failed = AUDIT_FAILURES.labels("record")._value.get()
    try:
        Audit(away, "away", "actor-0", "actor").record("process.joined", version=0)
        assert away.entered.wait(30)  # its writer is busy with it
        Audit(redis_client, "live", "actor-1", "actor").record("process.joined", version=0)
        assert audit_module.flush(10, redis_client)  # written while the other entry is still in hand: not behind it
        assert redis_client.xlen(RunKeys("live").audit) == 1 and not away.gate.is_set()
    finally:
        away.gate.set()
    assert audit_module.flush(60, away)  # and the other one is given up on in the end
    assert AUDIT_FAILURES.labels("record")._value.get() == failed + 1


def test_the_mirror_copies_each_entry_once_across_a_restart(redis_client, tmp_path: Path) -> None:
    path, audit = tmp_path / "run" / "audit.jsonl", Audit(redis_client, "mirror", "learner", "learner")
    for n in range(5):
        audit.record("process.joined", n=n)
    assert audit_module.flush(30, redis_client)
    first = AuditMirror(redis_client, "mirror", path)
    assert first.pump() == 5 and first.pump() == 0
    for n in range(5, 8):
        audit.record("process.joined", n=n)  # recorded while no mirror runs (the learner was killed)
    with path.open("a") as f:
        f.write('{"id": "9999999999999-0", "ev')  # the killed learner's half-written line
    second = AuditMirror(redis_client, "mirror", path, period_s=0.05).start()
    audit.record("process.joined", n=8)
    second.close()  # copies what remains
    lines = jsonl(path)
    assert [line["n"] for line in lines] == list(range(9))  # no duplicate, no gap, the partial line gone
    assert [line["id"] for line in lines] == [i.decode() for i, _ in redis_client.xrange(RunKeys("mirror").audit)]
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)  # it reveals the run: its user's only
    third = AuditMirror(redis_client, "mirror", path)
    assert third.last_id == lines[-1]["id"] and third.pump() == 0


def test_a_mirror_copies_big_batches_and_the_stream_is_trimmed(redis_client, tmp_path: Path) -> None:
    audit = Audit(redis_client, "batches", "learner", "learner")
    pipe_count = AuditMirror.BATCH * 2 + 7
    for n in range(pipe_count):
        audit.record("process.joined", n=n)
    path = tmp_path / "audit.jsonl"
    assert audit_module.flush(30, redis_client)
    assert AuditMirror(redis_client, "batches", path).pump() == pipe_count
    assert [line["n"] for line in jsonl(path)] == list(range(pipe_count))
    info = redis_client.xinfo_stream(RunKeys("batches").audit)
    assert info["length"] <= AUDIT_MAXLEN


def test_refusal_floods_add_a_handful_of_entries(redis_client) -> None:
    audit = Audit(redis_client, "flood", "reward-0", "reward")
    recorded = [audit.refused("key.refused", "KEY-A", client_key="KEY-A") for _ in range(1000)]
    assert sum(recorded) == 4  # the 1st, 10th, 100th and 1000th
    counts = [line["count"] for line in entries(redis_client, "flood")]
    assert counts == [1, 10, 100, 1000]
    for n in range(MAX_REASONS + 50):  # a fresh key per handshake: at most MAX_REASONS of them apart
        audit.refused("key.refused", f"fresh-{n}")
    reasons = [line["reason"] for line in entries(redis_client, "flood")[4:]]
    assert len(reasons) == MAX_REASONS - 1 + 2  # one entry per fresh key, then (other) at its 1st and 10th
    assert reasons[-2:] == ["(other)", "(other)"]


def test_dead_letters_are_refusals_without_their_payload(redis_client) -> None:
    keys = RunKeys("dead")
    for n in range(250):
        dead_letter(redis_client, keys, f"replay:{n}-0", f"bad field {n}", b"PAYLOAD-MARKER" * 10)
    dead_letter(redis_client, keys, "reward:refused", "task 'os:system' is not this run's task", b"x")
    lines = entries(redis_client, "dead")
    assert [(line["reason"], line["count"]) for line in lines] == [
        ("replay", 1),
        ("replay", 10),
        ("replay", 100),
        ("reward:refused", 1),
    ]
    assert lines[1]["source"] == "replay:9-0" and lines[1]["detail"] == "bad field 9" and lines[1]["bytes"] == 140
    assert all(line["event"] == "message.refused" for line in lines)
    assert "PAYLOAD-MARKER" not in json.dumps(lines)
    assert redis_client.xlen(keys.dead) == 251  # every message is still dead-lettered


def test_the_registry_records_joining_leaving_and_rejoining(redis_client) -> None:
    registry = ControlPlane(redis_client, "registry").registry
    beat = Heartbeat(process_id="actor-1", kind="actor", state="ready", version=4, host="h", pid=1)
    registry.beat(beat, ttl_s=30)
    registry.beat(beat, ttl_s=0.1)  # a later beat is no event; the last before the process froze (or Redis went)
    wait_for(lambda: not redis_client.exists(registry.keys.heartbeat("actor-1")), "the heartbeat to expire")
    registry.beat(beat, ttl_s=5)
    registry.beat(dataclasses.replace(beat, pid=2), ttl_s=5)  # restarted under its id before the heartbeat expired
    registry.leave("actor-1")
    lines = entries(redis_client, "registry")
    assert [(line["event"], line.get("rejoined"), line.get("replaced_pid")) for line in lines] == [
        ("process.joined", False, None),
        ("process.joined", True, None),
        ("process.joined", True, 1),
        ("process.left", None, None),
    ]
    assert all(line["who"]["process"] == "actor-1" and line["who"]["kind"] == "actor" for line in lines)
    assert lines[0]["version"] == 4


def test_a_reward_worker_records_its_life_and_what_it_refused(redis_server, redis_client, tmp_path: Path) -> None:
    """A real worker with CURVE keys: it joins, refuses a stranger's key and a forged group, and leaves."""
    run = "worker-audit"
    settings = create_run_keys(tmp_path / "keys")
    _, stranger_secret = create_keypair(tmp_path / "strangers", "stranger")
    publish(redis_client, run, *(f"{name}={json.dumps(value)}" for name, value in settings.items()))
    log = tmp_path / "worker.log"
    proc = start(redis_server.url, run, "rw-1", log)
    senders: list[PushChannel] = []
    try:
        beat = wait_ready(redis_client, run, "rw-1", proc, log)
        server_key = beat.curve_public_key.encode()
        stranger = PushChannel("rollouts", send_timeout_s=1)
        stranger.connect(beat.endpoint, CurveClient(stranger_secret, server_key))
        senders.append(stranger)
        with contextlib.suppress(ChannelBlocked):
            stranger.send(make_group(["1"], group_id="never"))
        friend = PushChannel("rollouts", send_timeout_s=10, seal=run_seal(redis_client, RunKeys(run), "rollouts"))
        friend.connect(beat.endpoint, CurveClient(Path(settings["transport.curve_client_key"]), server_key))
        senders.append(friend)
        group = make_group(["19"], group_id=f"{run}-1")
        issue(ControlPlane(redis_client, run), group)
        friend.send(make_group(["19"], group_id=f"{run}-1", task="os:system"))  # forged: another task
        wait_for(
            lambda: {"key.refused", "message.refused"} <= {e["event"] for e in entries(redis_client, run)},
            "both refusals in the audit trail",
            proc=proc,
            log=log,
        )
        stop(proc, log)
    finally:
        for push in senders:
            push.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = entries(redis_client, run)
    by_event = {line["event"]: line for line in lines}
    assert by_event["process.joined"]["who"] == {
        "process": "rw-1",
        "kind": "reward",
        "host": socket.gethostname(),
        "pid": proc.pid,
    }
    refused_key = by_event["key.refused"]
    public = (tmp_path / "strangers" / "stranger.key").read_text()
    assert refused_key["client_key"] in public and refused_key["count"] == 1 and refused_key["channel"] == "rollouts"
    refused = by_event["message.refused"]
    assert refused["who"]["process"] == "rw-1" and refused["source"] == "reward:refused" and refused["bytes"] > 0
    assert lines[-1]["event"] == "process.left"
    assert redis_server.password not in json.dumps(lines)


def test_the_learner_records_the_run_and_mirrors_the_trail_into_its_folder(redis_client, tmp_path: Path) -> None:
    """The learner's recorder, without DeepSpeed: run.started with the config's hashes, a lost actor once — noticed
    while the learner waits for a batch, as when the last actor dies and no step comes — and at the end run.finished
    and the learner's own leaving, all in runs/<name>/audit.jsonl."""
    from asyncrl.common.config import RunConfig, write_resolved
    from asyncrl.learner.checkpoint.settings import config_hash
    from asyncrl.learner.record.recorder import Recorder

    config = RunConfig.model_validate({"run": {"name": "recorded", "root": str(tmp_path)}})
    write_resolved(config)
    plane = ControlPlane(redis_client, "recorded")
    recorder = Recorder(config, plane)
    try:
        recorder.started()
        plane.registry.beat(Heartbeat(process_id="actor-7", kind="actor", state="ready", host="h", pid=7), ttl_s=0.2)
        wait_for(lambda: not redis_client.exists(plane.keys.heartbeat("actor-7")), "its heartbeat to expire (killed)")
        recorder.note_lost_processes()  # the learner waits for a batch: its first look finds it
        recorder.note_lost_processes()  # a second look within the second reads nothing
        time.sleep(1.1)
        recorder.note_lost_processes()  # nor does a later look record it again
    finally:
        recorder.close(version=3, outcome="completed")
    lines = jsonl(config.run_dir / "audit.jsonl")
    assert [(line["event"], line["who"]["process"]) for line in lines] == [
        ("process.joined", "learner"),
        ("run.started", "learner"),
        ("process.joined", "actor-7"),
        ("process.lost", "learner"),
        ("run.finished", "learner"),
        ("process.left", "learner"),
    ]
    started = lines[1]
    assert started["config_hash"] == config_hash(config)
    assert started["config_json_sha256"] == hashlib.sha256((config.run_dir / "config.json").read_bytes()).hexdigest()
    assert (lines[3]["process"], lines[3]["kind"]) == ("actor-7", "actor")
    assert (lines[4]["outcome"], lines[4]["version"]) == ("completed", 3)


def test_a_learner_started_again_records_only_the_losses_nobody_recorded(redis_client, tmp_path: Path) -> None:
    """Three actors lost while the run goes on: one recorded by the first learner and still lost, one recorded, then
    back under its id and lost again, one whose loss no learner saw (it died after the first stopped). The learner
    started after them records the last two, once each, and not the first again."""
    from asyncrl.common.config import RunConfig, write_resolved
    from asyncrl.learner.record.recorder import Recorder

    config = RunConfig.model_validate({"run": {"name": "again", "root": str(tmp_path)}})
    write_resolved(config)
    plane = ControlPlane(redis_client, "again")

    def die(process_id: str) -> None:
        plane.registry.beat(Heartbeat(process_id=process_id, kind="actor", state="ready", host="h", pid=7), ttl_s=0.2)
        wait_for(lambda: not redis_client.exists(plane.keys.heartbeat(process_id)), f"{process_id}'s heartbeat gone")

    first = Recorder(config, plane)
    try:
        first.started()
        die("gone")
        die("back")
        first.note_lost_processes()
    finally:
        first.close(version=1, outcome="stopped")
    die("back")  # under its id again, and lost again, while no learner ran
    die("unseen")
    second = Recorder(config, plane)
    try:
        second.started()
        second.note_lost_processes()
    finally:
        second.close(version=2, outcome="completed")
    losses = [line["process"] for line in entries(redis_client, "again") if line["event"] == "process.lost"]
    assert losses == ["back", "gone", "back", "unseen"]


def test_a_forked_child_records_through_a_writer_of_its_own(redis_client) -> None:
    audit = Audit(redis_client, "fork", "actor-0", "actor")
    audit.record("process.joined")
    assert audit_module.flush(30, redis_client)  # else the child, whose queue starts empty, may write first
    pid = os.fork()
    if pid == 0:  # the child: the parent's writer thread did not come along
        ok = False
        try:
            audit.record("process.left")
            ok = audit_module.flush(10)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [(line["event"], line["who"]["pid"]) for line in entries(redis_client, "fork")] == [
        ("process.joined", os.getpid()),
        ("process.left", pid),
    ]


def test_a_dead_letter_sent_through_a_pipeline_is_recorded_on_a_connection_of_its_own(redis_client) -> None:
    keys = RunKeys("piped")
    pipe = redis_client.pipeline(transaction=False)
    dead_letter(pipe, keys, "reward:malformed", "texts: not a list", b"\x00" * 8)
    assert audit_module.flush(30, redis_client) and redis_client.xlen(keys.dead) == 0  # the letter waits for execute()
    pipe.execute()
    [line] = entries(redis_client, "piped")
    assert (line["event"], line["source"], line["bytes"]) == ("message.refused", "reward:malformed", 8)
