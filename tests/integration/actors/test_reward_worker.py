"""``rl-actor reward`` as a separate process: real Redis, real ZeroMQ sockets, real signals."""

from __future__ import annotations

import dataclasses
import subprocess
import time
import urllib.request

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.dead_letters import DEAD_LETTER_EXCERPT
from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.transport.channel import PushChannel
from asyncrl.common.wire.messages import Decoder, Heartbeat, RolloutGroup, decode_blob, encode_blob
from asyncrl.common.wire.seal import Seal
from tests.helpers.audit_trail import entries as audit_entries
from tests.helpers.flood import flood
from tests.helpers.reward_stack import heartbeat, publish, read_replay, reward_worker, stop, wait_for
from tests.helpers.rollouts import issue, make_group
from tests.helpers.stack import BIN

STALL = "tests.helpers.slow_rewards:stall"


def metric(heartbeat_: Heartbeat, name: str) -> float:
    """The sum of a metric's samples from the worker's /metrics (on loopback: it binds every interface)."""
    port = heartbeat_.metrics_url.rsplit(":", 1)[1].split("/")[0]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def sender(endpoint: str, redis_client=None, run: str = "") -> PushChannel:
    """A PUSH socket connected to ``endpoint``; with a run, its messages are sealed with the run's secret (as an
    actor's are), else they carry no seal (a stranger's)."""
    seal = run_seal(redis_client, RunKeys(run), "rollouts") if run else None
    push = PushChannel("rollouts", send_timeout_s=10, seal=seal)
    push.connect(endpoint)
    return push


def test_scores_right_and_wrong_answers_and_survives_malformed_messages(redis_server, redis_client, tmp_path) -> None:
    run = "scores"
    publish(redis_client, run, 'reward.functions=[{name="task"}, {name="format", weight=0.5}]')
    right_and_wrong = make_group(
        ["19", "20", "19\nbecause 12+7 is 19", ""], finish_reasons=["stop", "stop", "length", "stop"], group_id="g-1"
    )
    other = make_group(["7", "19"], finish_reasons=["stop", "length"], prompt="3+4=", answer="7", group_id="g-2")
    log = tmp_path / f"{run}.log"
    with reward_worker(redis_server, redis_client, tmp_path, run) as (proc, endpoint):
        push = sender(endpoint, redis_client, run)
        try:
            push.send_frames([b"\x93garbage"])  # a malformed header (sealed: a member's bug, not a stranger)
            push.send_frames([b"\x01", b"\x02"])  # not msgpack at all
            issue(ControlPlane(redis_client, run), right_and_wrong, other)
            push.send(right_and_wrong)
            push.send(other)
            entries = read_replay(redis_client, run, 2)
        finally:
            push.close()
        assert [e.group.rollout.group_id for e in entries] == ["g-1", "g-2"]
        first, second = entries[0].group, entries[1].group
        # task [1, 0, 1, 0] + 0.5 * format [1, 1, 0 (cut at the limit), 0 (empty)]
        assert first.rewards.tolist() == [1.5, 0.5, 1.0, 0.0] and first.scorer_id == "rw-1"
        assert first.details[2] == {"task": 1.0, "format": 0.0}
        # task [1, 0] + 0.5 * format [1, 0]
        assert second.rewards.tolist() == [1.5, 0.0]
        assert first.rollout.texts == right_and_wrong.texts
        dead = redis_client.xrange(RunKeys(run).dead)  # the two malformed messages, written before the groups
        assert [fields[b"source"] for _, fields in dead] == [b"reward:malformed"] * 2
        beat = heartbeat(redis_client, run, "rw-1")
        assert metric(beat, 'asyncrl_wire_malformed_messages_total{channel="rollouts"') == 2
        # Counted just after the write that the test saw: wait rather than race it.
        wait_for(lambda: metric(beat, "asyncrl_reward_scored_groups_total") == 2, proc, log, "the count")
        stop(proc, log)


def test_a_timing_out_function_is_retried_then_dead_lettered_while_others_are_scored(
    redis_server, redis_client, tmp_path
) -> None:
    run = "timeouts"
    calls = tmp_path / "calls.txt"
    stall = f'{{name="{STALL}", options={{stall="stall-", seconds=60.0, log="{calls}"}}}}'
    # The limit is far above what an answering call takes even on busy cores (the ok group's calls must not time out)
    publish(
        redis_client, run, f'reward.functions=[{{name="task"}}, {stall}]', "reward.timeout_s=1.5", "reward.retries=2"
    )
    log = tmp_path / f"{run}.log"
    with reward_worker(redis_server, redis_client, tmp_path, run) as (proc, endpoint):
        push = sender(endpoint, redis_client, run)
        try:
            group = make_group(["19", "18"], group_id="stall-1")
            issue(ControlPlane(redis_client, run), group)
            push.send(group)
            dead = wait_for(lambda: redis_client.xrange(RunKeys(run).dead), proc, log, "a dead letter")
            # Nothing else was called since: the last call of the stalling function failed.
            assert heartbeat(redis_client, run, "rw-1").state == "degraded"
            group = make_group(["19", "18"], group_id="ok-1")
            issue(ControlPlane(redis_client, run), group)
            push.send(group)
            entries = read_replay(redis_client, run, 1)
            group = make_group(["19", "18"], group_id="forged-1")  # refused by a replay: dead-lettered, not retried
            issue(ControlPlane(redis_client, run), group)
            push.send(group)
            wait_for(lambda: len(redis_client.xrange(RunKeys(run).dead)) == 2, proc, log, "a second dead letter")
        finally:
            push.close()
        # one call and two retries, then the next group; the refused one once
        assert calls.read_text().split() == ["stall-1"] * 3 + ["ok-1", "forged-1"]
        assert [e.group.rollout.group_id for e in entries] == ["ok-1"]
        assert entries[0].group.details == [{"task": 1.0, STALL: 1.0}, {"task": 0.0, STALL: 1.0}]
        [(_, fields)] = dead
        refused = redis_client.xrange(RunKeys(run).dead)[1][1][b"reason"].decode()
        assert "refused: an environment turn differs" in refused, refused
        assert fields[b"source"] == b"reward"
        reason = fields[b"reason"].decode()
        assert f"reward function '{STALL}'" in reason and "failed 3 attempt(s)" in reason
        assert "timed out after 1.5 s" in reason
        assert decode_blob(Decoder(RolloutGroup), fields[b"payload"]).group_id == "stall-1"
        # both final: the learner's dispatcher retires them at its next look instead of at their deadline
        assert ControlPlane(redis_client, run).prompts.take_refused() == ["stall-1", "forged-1"]
        beat = wait_for(lambda: heartbeat(redis_client, run, "rw-1", state="ready"), proc, log, "ready again")
        assert metric(beat, "asyncrl_reward_timed_out_calls_total") == 3
        assert metric(beat, "asyncrl_reward_dead_lettered_groups_total") == 2
        started = time.monotonic()
        stop(proc, log)  # abandoned calls still sleeping must not hold the exit
        assert time.monotonic() - started < 30  # the abandoned calls sleep 60 s: the exit did not wait for them


def test_sigterm_finishes_the_group_in_hand_and_leaves_the_registry(redis_server, redis_client, tmp_path) -> None:
    run = "shutdown"
    calls = tmp_path / "calls.txt"
    slow = f'{{name="{STALL}", options={{stall="slow-", seconds=1.5, log="{calls}"}}}}'
    publish(redis_client, run, f"reward.functions=[{slow}]")
    log = tmp_path / f"{run}.log"
    with reward_worker(redis_server, redis_client, tmp_path, run) as (proc, endpoint):
        push = sender(endpoint, redis_client, run)
        try:
            group = make_group(["19"], group_id="slow-1")
            issue(ControlPlane(redis_client, run), group)
            push.send(group)
            wait_for(lambda: calls.exists() and calls.read_text(), proc, log, "the call to begin")
            stop(proc, log)  # while the group is being scored
        finally:
            push.close()
    assert [e.group.rollout.group_id for e in read_replay(redis_client, run, 1)] == ["slow-1"]
    assert ControlPlane(redis_client, run).registry.processes() == ([], {})  # left, not merely expired
    assert "reward worker stopped" in log.read_text()


def test_a_finished_run_stops_its_worker_and_a_run_published_again_runs(redis_server, redis_client, tmp_path) -> None:
    """The learner marks the run finished after its last step: an idle worker sees it within a few seconds, leaves
    and exits 0, saying why; a worker or an actor started on the finished run exits 0 at once (an actor before its
    engine starts). Publishing the run's config again (a new start) clears the mark."""
    run = "finishing"
    publish(redis_client, run)
    log = tmp_path / f"{run}.log"
    plane = ControlPlane(redis_client, run)
    with reward_worker(redis_server, redis_client, tmp_path, run) as (proc, _):
        plane.run.mark_finished(12)
        assert proc.wait(30) == 0, log.read_text()[-2000:]
    assert "run finished; the reward worker stops" in log.read_text() and "step=12" in log.read_text()
    assert plane.registry.processes() == ([], {})  # left, not merely expired
    assert plane.run.finished() == 12
    for command, who in ((["reward"], "reward worker"), ([], "actor")):  # started again after the end: nothing to do
        again = subprocess.run(
            [str(BIN / "rl-actor"), *command, "--redis", redis_server.url, "--run", run],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 0 and f"finished at step 12: the {who} has nothing to do" in again.stderr, again
    publish(redis_client, run)
    assert plane.run.finished() is None


def test_a_worker_whose_calls_keep_hanging_dead_letters_the_group_and_exits_1(
    redis_server, redis_client, tmp_path
) -> None:
    run = "stalled"
    hang = f'{{name="{STALL}", options={{stall="hang-", seconds=60.0}}}}'
    publish(redis_client, run, f"reward.functions=[{hang}]", "reward.timeout_s=0.1", "reward.retries=20")
    log = tmp_path / f"{run}.log"
    with reward_worker(redis_server, redis_client, tmp_path, run) as (proc, endpoint):
        push = sender(endpoint, redis_client, run)
        try:
            group = make_group(["19"], group_id="hang-1")
            issue(ControlPlane(redis_client, run), group)
            push.send(group)
            # MAX_ABANDONED_CALLS (8) threads sleep on; the 9th attempt is refused instead of started.
            assert proc.wait(30) == 1, log.read_text()
        finally:
            push.close()
    [(_, fields)] = redis_client.xrange(RunKeys(run).dead)
    assert b"8 abandoned calls are still running" in fields[b"reason"]
    assert ControlPlane(redis_client, run).registry.processes() == ([], {})
    assert "reward worker stalled" in log.read_text()


def test_an_unknown_run_or_reward_function_exits_2_with_the_reason(redis_server, redis_client, tmp_path) -> None:
    result = subprocess.run(
        [str(BIN / "rl-actor"), "reward", "--redis", redis_server.url, "--run", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "start `rl-learner` for it first" in result.stderr
    publish(redis_client, "typo", 'reward.functions=[{name="tsak"}]')
    result = subprocess.run(
        [str(BIN / "rl-actor"), "reward", "--redis", redis_server.url, "--run", "typo"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "unknown reward function 'tsak'" in result.stderr
    assert "Traceback" not in result.stderr
    assert ControlPlane(redis_client, "typo").registry.processes() == ([], {})


def test_a_task_name_from_the_wire_never_selects_or_imports_anything(redis_server, redis_client, tmp_path) -> None:
    """``task`` used to be resolved as an import path, so one PUSH of ``task="os:system"`` ran a shell
    command in the worker. Now the verifier comes from the config; a group of another task is refused and counted."""
    run = "hostile-task"
    publish(redis_client, run)
    marker = tmp_path / "pwned"
    names = [
        "os:system",
        "subprocess:getoutput",
        "builtins:exec",
        "countdown",
        "asyncrl.common.rewards.verifiers:verify_arithmetic",
    ]
    hostile = [make_group([f"touch {marker}"], task=name, group_id=f"h-{i}") for i, name in enumerate(names)]
    log = tmp_path / f"{run}.log"
    with reward_worker(redis_server, redis_client, tmp_path, run) as (proc, endpoint):
        push = sender(endpoint, redis_client, run)
        try:
            real = make_group(["19"], group_id="g-real")
            issue(ControlPlane(redis_client, run), real, *hostile)  # even under ids in flight: the task decides
            for group in hostile:
                push.send(group)
            push.send(real)
            entries = read_replay(redis_client, run, 1)
        finally:
            push.close()
        assert [e.group.rollout.group_id for e in entries] == ["g-real"]  # refused ones were never written
        assert entries[0].group.rewards.tolist() == [1.0]  # the real group still scored by the config's verifier
        wait_for(lambda: redis_client.xlen(RunKeys(run).dead) == len(names), proc, log, "every refusal")
        for (_, fields), name, group in zip(redis_client.xrange(RunKeys(run).dead), names, hostile, strict=True):
            assert fields[b"source"] == b"reward:refused"
            assert f"task {name!r} is not this run's task 'arithmetic'" in fields[b"reason"].decode()
            blob = encode_blob(group)  # its start is kept, and the whole one's size and digest
            assert fields[b"payload"] == blob[:DEAD_LETTER_EXCERPT] and int(fields[b"size"]) == len(blob)
        assert metric(heartbeat(redis_client, run, "rw-1"), "asyncrl_reward_refused_groups_total") == len(names)
        assert not marker.exists()
        assert proc.poll() is None  # alive and serving
        stop(proc, log)
    assert log.read_text().count("refused a rollout group without scoring it") == 1  # the 1st of 5; next at the 10th


def test_only_groups_that_answer_an_issue_record_in_flight_are_scored(redis_server, redis_client, tmp_path) -> None:
    """A forged group never reaches a reward function (with code_tests: the sandbox), whatever its id's state: a
    group whose id was already trained is refused and counted too, a huge one included (it used to be scored)."""
    run = "issued-only"
    publish(redis_client, run, "rollout.max_new_tokens=8")
    plane = ControlPlane(redis_client, run)
    real, done = make_group(["19", "18"], group_id="g-real"), make_group(["19", "1"], group_id="g-done")
    issue(plane, real, done)
    plane.prompts.retire_groups(["g-done"], completed=True)  # trained already
    forged = {
        "never issued": make_group(["19", "19"], group_id="g-never"),
        "its prompt differs": make_group(["7", "7"], prompt="3+4=", answer="7", group_id="g-real"),
        "its answer differs": make_group(["18", "18"], answer="18", group_id="g-real"),
        "a response has 9 tokens": make_group(["19", "123456789"], group_id="g-real"),
        "it has 3 responses": make_group(["19", "19", "19"], group_id="g-real"),
        "its id was already trained": make_group(["19", "1"], group_id="g-done"),
        "its id was already trained ": make_group(["7"] * 2000, prompt="3+4=", answer="7", group_id="g-done"),
    }
    log = tmp_path / f"{run}.log"
    with reward_worker(redis_server, redis_client, tmp_path, run) as (proc, endpoint):
        push = sender(endpoint, redis_client, run)
        try:
            for group in forged.values():
                push.send(group)
            push.send(real)
            entries = read_replay(redis_client, run, 1)
        finally:
            push.close()
        assert [e.group.rollout.group_id for e in entries] == ["g-real"]
        assert entries[0].group.rewards.tolist() == [1.0, 0.0]
        wait_for(lambda: redis_client.xlen(RunKeys(run).dead) == len(forged), proc, log, "every refusal")
        reasons = [fields[b"reason"].decode() for _, fields in redis_client.xrange(RunKeys(run).dead)]
        for expected, reason in zip(forged, reasons, strict=True):
            assert expected.strip() in reason
        assert metric(heartbeat(redis_client, run, "rw-1"), "asyncrl_reward_refused_groups_total") == len(forged)
        assert plane.prompts.has_group("g-real")  # the real group behind the hijacked id is still in flight
        assert plane.prompts.take_refused() == []  # and nothing asks the learner to retire it
        stop(proc, log)


def test_what_is_scored_is_the_decode_of_the_token_ids(redis_server, redis_client, tmp_path) -> None:
    """Texts that say the right answer over token ids that say another are scored for the ids: the worker replaces
    every text with the decode of its ids before any reward function reads it, and counts what it replaced."""
    run = "decoded"
    publish(redis_client, run)
    plane = ControlPlane(redis_client, run)
    honest, lying = make_group(["19", "7"], group_id="g-honest"), make_group(["99", "19"], group_id="g-lying")
    lying = dataclasses.replace(lying, texts=["19", "19"])  # "19" is scored right; the ids under it say "99"
    issue(plane, honest, lying)
    log = tmp_path / f"{run}.log"
    with reward_worker(redis_server, redis_client, tmp_path, run) as (proc, endpoint):
        push = sender(endpoint, redis_client, run)
        try:
            push.send(honest)
            push.send(lying)
            entries = {e.group.rollout.group_id: e.group for e in read_replay(redis_client, run, 2)}
        finally:
            push.close()
        assert entries["g-honest"].rewards.tolist() == [1.0, 0.0]
        assert entries["g-lying"].rewards.tolist() == [0.0, 1.0]  # "99" scored wrong, "19" right
        assert entries["g-lying"].rollout.texts == ["99", "19"]  # what the learner and samples.jsonl see
        assert metric(heartbeat(redis_client, run, "rw-1"), "asyncrl_reward_replaced_texts_total") == 1
        stop(proc, log)


def test_a_peer_without_the_run_credential_costs_no_memory_and_nothing_it_sends_is_read(
    redis_server, redis_client, tmp_path
) -> None:
    """A local process that reaches the worker's loopback socket but not the run's Redis: the reproduction of a
    memory flood (one message of 64 frames × 60 MB, from four connections at once) and a sender with another secret
    fail the CURVE handshake, so libzmq queues nothing of theirs: the worker's memory stays within one frame limit of
    where it was, every refused connection is counted and audited, nothing is dead-lettered, and a member's group is
    scored."""
    run = "sealed"
    publish(redis_client, run, "transport.max_message_mb=64")
    plane = ControlPlane(redis_client, run)
    real = make_group(["19"], group_id="g-real")
    issue(plane, real)
    log = tmp_path / f"{run}.log"
    with reward_worker(redis_server, redis_client, tmp_path, run) as (proc, endpoint):
        member = sender(endpoint, redis_client, run)
        wrong_key = PushChannel("rollouts", send_timeout_s=10, seal=Seal(b"x" * 32, "rollouts"))
        wrong_key.connect(endpoint)
        try:
            grown = flood(endpoint, proc.pid, budget_kib=64 * 1024, connections=4, frames=64, frame_mb=60)
            wrong_key.send(dataclasses.replace(real, texts=["19"]))
            member.send(real)
            entries = read_replay(redis_client, run, 1)
        finally:
            for push in (wrong_key, member):
                push.close()
        assert grown < 64 * 1024, f"the worker's resident memory grew by {grown} KiB"
        assert [e.group.rollout.group_id for e in entries] == ["g-real"]
        beat = heartbeat(redis_client, run, "rw-1")
        wait_for(lambda: metric(beat, "asyncrl_channel_refused_handshakes_total") >= 5, proc, log, "5 refusals")
        refusals = int(metric(beat, "asyncrl_channel_refused_handshakes_total"))  # each retry of each connection
        assert metric(beat, "asyncrl_channel_unsealed_messages_total") == 0  # nothing of theirs was even read
        assert metric(beat, "asyncrl_wire_malformed_messages_total") == 0
        assert redis_client.xlen(RunKeys(run).dead) == 0
        stop(proc, log)
    logged = log.read_text().count("refused a connection that failed the CURVE handshake")
    assert logged == len(str(refusals)), (logged, refusals)  # the 1st, 10th, 100th, …
    refused = [e for e in audit_entries(redis_client, run) if e["event"] == "connection.refused"]
    assert refused and refused[0]["channel"] == "rollouts", refused
