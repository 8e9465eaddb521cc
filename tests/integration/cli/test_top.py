"""``rl-top`` against a real redis-server: the frame it renders, ``--once``, ``--targets`` and the live refresh."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from asyncrl.cli.top import render, snapshot
from asyncrl.common.config import load_config
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.replay import ReplayReader, ReplayWriter
from asyncrl.common.wire.messages import Heartbeat, PromptGroup, ScoredGroup
from tests.helpers.rollouts import make_group
from tests.helpers.waits import wait_for

BIN = Path(sys.executable).parent


def rl_top(url: str, run: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BIN / "rl-top", "--redis", url, "--run", run, *args], capture_output=True, text=True, timeout=60
    )


def populate(redis_client, run: str) -> ControlPlane:
    """A run as rl-top finds it mid-flight: config, two processes, queued prompts, replay entries (one pending)."""
    plane = ControlPlane(redis_client, run)
    plane.run.publish_config(load_config(None, [f"run.name={run}"]))
    plane.run.set_version(5)
    actor = Heartbeat(
        process_id="actor-0",
        kind="actor",
        state="generating",
        version=5,
        tokens_per_s=2100,
        pid=4242,
        metrics_url="http://h:9101/metrics",
    )
    plane.registry.beat(actor, 30)
    plane.registry.beat(Heartbeat(process_id="reward-0", kind="reward", state="ready"), 30)
    prompts = [
        PromptGroup(group_id=f"g{i}", task="t", prompt="1+1=", prompt_ids=np.zeros(4, np.int32)) for i in range(4)
    ]
    plane.prompts.push_prompts(prompts)
    reader = ReplayReader(redis_client, plane.keys)
    scored = [ScoredGroup(rollout=make_group(["2"]), rewards=np.ones(1, np.float32), scorer_id="r") for _ in range(3)]
    ReplayWriter(redis_client, plane.keys).add(scored)
    assert len(reader.read(1, block_ms=100)) == 1  # read, not acknowledged: pending
    return plane


def test_frame_before_the_learner_published_anything(redis_server, redis_client) -> None:
    populate(redis_client, "early")
    done = rl_top(redis_server.url, "early", "--once")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "asyncrl run 'early'   policy version 5" in text
    assert re.search(r"prompts\s+4\s+in flight\s+0\s+replay\s+3 \(pending 1\)", text), text
    assert "learner  no step published yet" in text and "alerts   none active" in text
    assert re.search(r"actor-0\s+actor\s+generating\s+5\s+2100\s+[\d.]+\s+4242\s+h:9101", text), text
    assert re.search(r"reward-0\s+reward\s+ready\s+0\s+0\s+[\d.]+\s+-\s+-", text), text


def test_frame_with_the_learner_summary_and_alerts(redis_client) -> None:
    plane = populate(redis_client, "mid")
    plane.run.publish_summary(
        {
            "step": 9.0,
            "version": 9.0,
            "time": time.time(),
            "learner/steps": 30,
            "rollout/reward_mean": 0.625,
            "rollout/reward_std": 0.48,
            "train/offpolicy/mismatch_kl": 3e-6,
            "rollout/staleness_max": 1.0,
            "step/seconds": 1.5,
            "learner/metrics_url": "http://h:9000/metrics",
        }
    )
    learner = Heartbeat(process_id="learner", kind="learner", state="training", metrics_url="http://h:9000/metrics")
    plane.registry.beat(learner, 30)
    plane.run.set_alerts([{"name": "replay_starving", "message": "idle 80% of each step", "since": time.time() - 5}])
    text = render(snapshot(plane))
    assert "learner  step 9/30   version 9   reward 0.625 ± 0.480   mismatch 3.00e-06" in text
    assert "staleness max 1" in text and "metrics h:9000" in text
    assert re.search(r"WARNING\s+replay_starving\s+idle 80% of each step \(for [56]s\)", text), text


def test_unknown_run_and_targets(redis_server, redis_client) -> None:
    done = rl_top(redis_server.url, "nothing", "--once")
    assert done.returncode == 0, done.stderr
    assert "no config published for run 'nothing'" in done.stdout
    populate(redis_client, "sd")
    done = rl_top(redis_server.url, "sd", "--targets")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [
        {"targets": ["h:9101"], "labels": {"run": "sd", "process": "actor-0", "kind": "actor"}}
    ]


def test_once_after_the_run_ended_says_so_in_one_line(tmp_path: Path) -> None:
    """A finished run's Redis is gone: ``--once`` (and ``--targets``) say that in one line, no traceback."""
    from asyncrl.common.plane.redis_server import EmbeddedRedis

    EmbeddedRedis(tmp_path / "ended" / "redis").start().stop()  # as the run left it: its URL file, no server
    for args in (("--once",), ("--targets",)):
        command = [BIN / "rl-top", "--run", "ended", "--root", str(tmp_path), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: run 'ended': its Redis does not answer"), lines
        assert f"{tmp_path}/ended/metrics.jsonl" in lines[0] and "rl-launch redis CONFIG" in lines[0]


def test_live_view_redraws_in_place_until_ctrl_c(redis_server, redis_client, tmp_path: Path) -> None:
    populate(redis_client, "live")
    errors = tmp_path / "stderr"
    with errors.open("w") as err:
        proc = subprocess.Popen(
            [BIN / "rl-top", "--redis", redis_server.url, "--run", "live", "--interval", "0.2"],
            stdout=subprocess.PIPE,
            stderr=err,
        )
    chunks: list[bytes] = []

    def read_along() -> None:  # the output as it arrives, until rl-top closes it
        while chunk := proc.stdout.read1():
            chunks.append(chunk)

    reader = threading.Thread(target=read_along, daemon=True)
    reader.start()
    try:  # several frames drawn (the first once started), then Ctrl-C
        wait_for(lambda: b"".join(chunks).count(b"\x1b[H") >= 2, "two frames", proc=proc, log=errors)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
        reader.join(20)
    assert proc.returncode == 0, errors.read_text()
    out = b"".join(chunks).decode()
    assert out.count("\x1b[H") >= 2, "expected several frames drawn from the top-left corner"
    assert "\x1b[K" in out and out.endswith("\x1b[?25h")  # lines cleared in place; cursor shown again
    assert out.count("actor-0") >= 2
