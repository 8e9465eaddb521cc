"""No wait for a process that is gone: a killed reward worker's groups are re-issued once its heartbeat expires, and
the weight broadcast stops waiting for a member whose heartbeat expired.

The deadlines that would end each wait anyway (``learner.group_deadline_s``, ``weight_sync.timeout_s``) are set to an
hour; each test's own bounded wait is far shorter, so reaching the outcome at all shows it came from the heartbeat.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from asyncrl.actors.reward_peers import RewardPeers
from asyncrl.common.config import RunConfig, load_config
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.replay import ReplayReader
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.wire.messages import Heartbeat
from asyncrl.learner.intake.dispatcher import Dispatcher
from asyncrl.learner.weights.broadcaster import Broadcaster
from tests.helpers.rollouts import encode, issue, make_group, tokenizer_dir
from tests.helpers.waits import wait_for

ROOT = Path(__file__).resolve().parents[4]
STALL = "tests.helpers.slow_rewards:stall"
HOUR = 3600


def test_a_killed_reward_workers_groups_are_reissued_when_its_heartbeat_expires(redis_server, redis_client, tmp_path):
    run, calls, log = "stall-rw", tmp_path / "calls.log", tmp_path / "worker.log"
    stall = f'{{name="{STALL}", options={{stall="held-", seconds={HOUR}, log="{calls}"}}}}'
    config = load_config(
        None,
        [
            f"run.name={run}",
            f"model.path={tokenizer_dir()}",
            "transport.heartbeat_s=0.2",
            "transport.heartbeat_ttl_s=2",
            f"learner.group_deadline_s={HOUR}",
            f"reward.functions=[{stall}]",
            f"reward.timeout_s={HOUR}",
        ],
    )
    plane = ControlPlane(redis_client, run)
    plane.run.publish_config(config)
    dispatcher = Dispatcher(config, plane, encode)
    groups = [make_group(["19", "18"], group_id=gid) for gid in ("ok-0", "held-0", "held-1", "held-2")]
    issue(plane, *groups)  # issue records and ledger entries, as the dispatcher makes them
    plane.prompts.push_prompts(plane.prompts.load_group(g.group_id) for g in groups)
    plane.registry.beat(Heartbeat(process_id="actor-1", kind="actor", state="generating"), ttl_s=HOUR)  # lives on
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the worker imports the stalling reward function by path
    command = [str(Path(sys.executable).parent / "rl-actor"), "reward", "--redis", redis_server.url, "--run", run]
    with log.open("w") as out:
        proc = subprocess.Popen([*command, "--id", "rw-1"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    peers = RewardPeers(hwm=64, send_timeout_s=10, seal=run_seal(redis_client, plane.keys, "rollouts"))
    try:
        [beat] = wait_for(
            lambda: [h for h in plane.registry.processes()[0] if h.process_id == "rw-1" and h.state == "ready"],
            "a ready heartbeat",
            proc=proc,
            log=log,
        )
        peers.connect(beat.endpoint, beat.process_id)
        reader = ReplayReader(redis_client, plane.keys, consumer="test")
        for group in groups:  # what the actor does with each finished group: take, push, record the scorer
            assert plane.prompts.take_prompt("actor-1", timeout_s=1).group_id == group.group_id
            worker = peers.send(group)
            plane.prompts.pushed(group.group_id, "actor-1", worker)  # unless the worker received it already
            if group.group_id == "ok-0":  # written before the next one stalls the worker (it writes when idle)
                [entry] = wait_for(lambda: reader.read(count=1, block_ms=200), "ok-0 written", proc=proc, log=log)
                assert entry.group.rollout.group_id == "ok-0"
        wait_for(lambda: calls.exists() and "held-0" in calls.read_text().split(), "held-0 in the worker's hands")
        holders = lambda gid: (plane.prompts.ledger()[gid].actor, plane.prompts.ledger()[gid].scorer)  # noqa: E731
        wait_for(lambda: holders("ok-0") == ("", ""), "ok-0 held by nobody once in the stream")
        wait_for(lambda: holders("held-0") == ("", "rw-1"), "held-0 held by the worker alone")
        assert dispatcher.reissue_overdue(config.learner.group_deadline_s) == (0, 0)  # everyone alive
        proc.kill()  # kill -9: held-0 in hand and held-1, held-2 queued in its socket die with it
        assert proc.wait(10) == -9
        reissued = []

        def all_reissued() -> bool:  # the learner's overdue check, as it runs while it waits for a batch
            reissued.append(dispatcher.reissue_overdue(config.learner.group_deadline_s)[0])
            return sum(reissued) >= 3

        wait_for(all_reissued, "the killed worker's groups re-issued")
    finally:
        peers.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    ledger = plane.prompts.ledger()
    held = {g.group_id for g in groups[1:]}
    assert sum(reissued) == 3 and all(ledger[g].attempts == 2 and not ledger[g].scorer for g in held)
    assert ledger["ok-0"].attempts == 1  # scored and in the stream before the kill: not re-issued
    taken = [plane.prompts.take_prompt("actor-1", timeout_s=1).group_id for _ in held]
    assert sorted(taken) == sorted(held) and plane.prompts.queue_depth() == 0


def broadcast_config(tmp_path: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run": {"name": "stall-bc", "root": str(tmp_path / "runs")},
            "staleness": {"max_staleness": 0},  # synchronous: publish returns once the transfer ended
            "weight_sync": {"timeout_s": HOUR},
        }
    )


def test_the_broadcast_stops_waiting_for_a_member_whose_heartbeat_expired(redis_client, tmp_path) -> None:
    plane = ControlPlane(redis_client, "stall-bc")
    # "ghost" is killed (-9) just after the learner read the registry: its heartbeat is still there, then expires
    plane.registry.beat(Heartbeat(process_id="ghost", kind="actor", state="idle"), ttl_s=1)
    broadcaster = Broadcaster(broadcast_config(tmp_path), plane)
    result: dict[str, float] = {}
    sync = threading.Thread(target=lambda: result.update(broadcaster.publish(1, lambda: {"w": torch.ones(3)})))
    try:
        sync.start()
        sync.join(120)  # a wait for the whole weight_sync.timeout_s would end the join first
        assert not sync.is_alive(), "the broadcast still waits for a member whose heartbeat expired"
        assert result["failed"] == 1.0 and "ghost" in broadcaster.evicted
        assert plane.run.read_manifest()[0].members == ["ghost"]  # that formation was for it; the next is not
        assert broadcaster.live_actors() == []
    finally:
        if not sync.is_alive():
            broadcaster.close()
