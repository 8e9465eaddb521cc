"""Redis killed under a live run (``kill -9`` of its redis-server), with real processes started as a person would
(`rl-launch redis`, `rl-actor reward`, `rl-actor`, `rl-learner train`).

Back within the limit: `rl-launch redis` says its server died, and started again on the run folder ~8 s later it
takes the same port, password and AOF; the learner, the actor and the reward worker wait, reconnect and carry on,
and the run completes with every group trained exactly once. Down longer than ``transport.redis_outage_s``: each of
them stops with status 75 and says what to do; with Redis started again, ``--resume latest`` completes the run.
The figures of both runs are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.control import ControlPlane
from common.keys import connect
from common.outage import OUTAGE_EXIT_CODE
from tests.e2e.test_resume import Processes, _steps, _wait
from tests.e2e.test_system import BIN, ROOT
from tests.helpers.accounting import account_groups

pytestmark = pytest.mark.e2e
GROUPS = 16  # configs/demo.toml: learner.groups_per_step
ACTOR_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "1"}
CONFIG = ROOT / "configs/demo.toml"


class Run:
    """One run's processes, started as in the module docstring; ``procs.stop_all()`` ends them."""

    def __init__(self, tmp_path: Path, model: Path, name: str, *overrides: str) -> None:
        self.dir = tmp_path / name
        # no eval rounds: this is about Redis, and their rows in metrics.jsonl would stand between the steps
        settings = [f"run.root={tmp_path}", f"run.name={name}", f"model.path={model}", "eval.every=0", *overrides]
        self.sets = [arg for override in settings for arg in ("--set", override)]
        self.procs = Processes(tmp_path / "logs")
        self.run_args: list[str] = []
        self.url = ""

    def start(self) -> None:
        """`rl-launch redis`, a reward worker (``reward``) and ``actor-0``."""
        self.run_args = self.procs.start_run(CONFIG, self.sets, self.dir)
        self.url = (self.dir / "redis" / "url").read_text().strip()
        self.procs.start("actor-0", [BIN / "rl-actor", *self.run_args, "--id", "actor-0"], ACTOR_ENV)

    def learner(self, name: str, *extra: str) -> subprocess.Popen:
        return self.procs.start(name, [BIN / "rl-learner", "train", CONFIG, *self.sets, *self.run_args[:2], *extra])

    def plane(self) -> ControlPlane:
        return ControlPlane(connect(self.url), self.dir.name)


def kill_redis(run: Run) -> float:
    """``kill -9`` the run's redis-server (its PID is in the folder's lock); `rl-launch redis` says so and exits 1.
    Returns when it was killed (monotonic)."""
    os.kill(int((run.dir / "redis" / "server.lock").read_text()), signal.SIGKILL)
    killed = time.monotonic()
    assert run.procs.procs["redis"].wait(30) == 1
    assert "start it again with the same command" in run.procs.log("redis")
    return killed


def start_redis_again(run: Run) -> float:
    """`rl-launch redis` on the same folder again (its place in ``procs`` is kept: stopped last); when it answers on
    the URL of the server that was killed."""
    redis = run.procs.start("redis", [BIN / "rl-launch", "redis", CONFIG, *run.sets])
    client = connect(run.url, outage_s=60)
    _wait(lambda: client.ping(), "redis on the same port and password", redis)
    return time.monotonic()


def test_a_run_lives_through_a_redis_kill_and_restart(tmp_path: Path, model_dir: Path) -> None:
    steps = 10
    run = Run(tmp_path, model_dir, "redisback", f"learner.steps={steps}")
    try:
        run.start()
        learner = run.learner("learner")
        _wait(lambda: len(_steps(run.dir)) >= 3, "step 3", learner)

        killed = kill_redis(run)
        killed_at_step = _steps(run.dir)[-1]
        time.sleep(max(0.0, killed + 8.0 - time.monotonic()))
        down_s = start_redis_again(run) - killed

        assert learner.wait(900) == 0, run.procs.log("learner")[-3000:]
        for name in ("actor-0", "reward"):
            assert run.procs.procs[name].poll() is None, run.procs.log(name)[-3000:]  # lived through it
        for name in ("learner", "actor-0", "reward"):
            text = run.procs.log(name)
            assert "Redis reachable again" in text and "Traceback" not in text, text[-3000:]
        assert _steps(run.dir) == list(range(1, steps + 1))  # every step exactly once
        assert killed_at_step < steps
        figures = account_groups(run.plane(), steps, GROUPS)
        assert figures["lost"] == 0  # nothing lost to the restart
        report = {"down_s": round(down_s, 1), "killed_after_step": killed_at_step, "steps": steps, **figures}
        print(json.dumps({"test": "within the limit", **report}))
    finally:
        run.procs.stop_all()


def test_redis_down_past_the_limit_stops_every_process_and_a_resume_completes(tmp_path: Path, model_dir: Path) -> None:
    steps, every, limit_s = 9, 3, 15
    overrides = [f"learner.steps={steps}", f"checkpoint.every={every}", f"transport.redis_outage_s={limit_s}"]
    run = Run(tmp_path, model_dir, "redisgone", *overrides, "learner.group_deadline_s=60")
    try:
        run.start()
        first = run.learner("learner-1")
        _wait(lambda: len(_steps(run.dir)) > every, "a step after the first checkpoint", first)

        killed = kill_redis(run)
        stopped = {}
        for name in ("learner-1", "actor-0", "reward"):
            assert run.procs.procs[name].wait(180) == OUTAGE_EXIT_CODE, run.procs.log(name)[-3000:]
            stopped[name] = round(time.monotonic() - killed, 1)
            text = run.procs.log(name)
            assert "Redis unreachable for longer than transport.redis_outage_s; stopping" in text, text[-3000:]
            assert "--resume latest" in text
        assert min(stopped.values()) >= limit_s, stopped
        stopped_at_step = _steps(run.dir)[-1]

        start_redis_again(run)  # as the message says: Redis first, then everything else
        run.procs.start("reward", [BIN / "rl-actor", "reward", *run.run_args, "--id", "reward-0"])
        run.procs.start("actor-1", [BIN / "rl-actor", *run.run_args, "--id", "actor-1"], ACTOR_ENV)
        resumed = run.learner("learner-2", "--resume", "latest")
        assert resumed.wait(900) == 0, run.procs.log("learner-2")[-3000:]

        assert _steps(run.dir) == list(range(1, steps + 1))  # every step exactly once, after the cut back
        figures = account_groups(run.plane(), steps, GROUPS)
        report = {"limit_s": limit_s, "stopped_s": stopped, "stopped_after_step": stopped_at_step, **figures}
        print(json.dumps({"test": "past the limit", "steps": steps, **report}))
    finally:
        run.procs.stop_all()
