"""Redis down past ``transport.redis_outage_s`` under a live run (``kill -9`` of its redis-server), with real processes
started as a person would (`rl-launch redis`, `rl-actor reward`, `rl-actor`, `rl-learner train`).

Once the run has a checkpoint, its redis-server is killed and stays down: `rl-launch redis` says its server died; the
learner, the actor and the reward worker each stop with status 75 no sooner than the limit and say what to do. With
Redis started again on the run folder (same port, password and AOF), ``--resume latest`` completes the run with every
step and every group trained exactly once. An outage within the limit, which every process lives through, is
tests/e2e/test_system.py's (the demo's redis-server killed under `rl-launch run`, which starts it again) and
tests/integration/common/plane/test_redis_outage.py's (`rl-launch redis` started again by hand, a client carrying on).
The figures are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from asyncrl.actors.liveness import ALIVE_ENV
from asyncrl.common.exit_codes import ExitCode
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.learner.checkpoint.history import complete_checkpoints
from tests.helpers.accounting import account_groups
from tests.helpers.stack import BIN, ONE_PROCESS_ENGINE, ROOT, Processes, _steps, _wait

GROUPS = 16  # configs/demo.toml: learner.groups_per_step
CONFIG = ROOT / "configs/demo.toml"
STEPS, EVERY = 6, 3
LIMIT_S = 10
"""``transport.redis_outage_s``: how long each process waits for Redis before it stops."""
PROCESSES = ("learner-1", "actor-0", "reward")


class Run:
    """One run's processes, started as in the module docstring; ``procs.stop_all()`` ends them."""

    def __init__(self, tmp_path: Path, model: Path, name: str, *overrides: str) -> None:
        self.dir = tmp_path / name
        # no eval rounds: this is about Redis, and their rows in metrics.jsonl would stand between the steps
        settings = [f"run.root={tmp_path}", f"run.name={name}", f"model.path={model}", "eval.every=0", *overrides]
        settings.append(ONE_PROCESS_ENGINE)
        self.sets = [arg for override in settings for arg in ("--set", override)]
        self.procs = Processes(tmp_path / "logs")
        self.run_args: list[str] = []
        self.url = ""
        self.alive = tmp_path / "actor-0.alive"
        """The file actor-0 touches while its engine makes progress (actors/liveness.py)."""

    def start(self) -> None:
        """`rl-launch redis`, a reward worker (``reward``) and ``actor-0``."""
        self.run_args = self.procs.start_run(CONFIG, self.sets, self.dir)
        self.url = (self.dir / "redis" / "url").read_text().strip()
        self.procs.start_actor("actor-0", self.run_args, core=1, env={ALIVE_ENV: str(self.alive)})

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


def stop_past_the_limit(run: Run) -> dict:
    """Redis down past ``transport.redis_outage_s``: the learner, the actor and the reward worker each exit 75 no
    sooner than the limit and say what to do. Its figures."""
    killed = kill_redis(run)
    stopped = {}
    for name in PROCESSES:
        assert run.procs.procs[name].wait(180) == ExitCode.REDIS_OUTAGE, run.procs.log(name)[-3000:]
        stopped[name] = round(time.monotonic() - killed, 1)
        text = run.procs.log(name)
        assert "Redis unreachable for longer than transport.redis_outage_s; stopping" in text, text[-3000:]
        assert "--resume latest" in text
    assert min(stopped.values()) >= LIMIT_S, stopped
    return {"stopped_s": stopped, "stopped_after_step": _steps(run.dir)[-1]}


def test_a_run_whose_redis_stays_down_stops_past_the_limit_and_a_resume_completes(
    tmp_path: Path, model_dir: Path
) -> None:
    """Past the limit every process stops with 75; Redis started again and ``--resume latest`` complete the run with
    every step and every group trained once."""
    overrides = [f"learner.steps={STEPS}", f"checkpoint.every={EVERY}", f"transport.redis_outage_s={LIMIT_S}"]
    run = Run(tmp_path, model_dir, "redis", *overrides, "learner.group_deadline_s=60")
    try:
        run.start()
        first = run.learner("learner-1")
        _wait(lambda: complete_checkpoints(run.dir / "checkpoints"), "the first checkpoint", first)
        assert time.time() - run.alive.stat().st_mtime < 30  # the engine makes progress: a liveness check passes
        past = stop_past_the_limit(run)
        assert past["stopped_after_step"] < STEPS  # the resume has steps to train

        start_redis_again(run)  # as the message says: Redis first, then everything else
        run.procs.start("reward-2", [BIN / "rl-actor", "reward", *run.run_args, "--id", "reward-0"])
        run.procs.start_actor("actor-1", run.run_args, core=1)
        resumed = run.learner("learner-2", "--resume", "latest")
        assert resumed.wait(900) == 0, run.procs.log("learner-2")[-3000:]

        assert _steps(run.dir) == list(range(1, STEPS + 1))  # every step exactly once, after the cut back
        figures = account_groups(run.plane(), STEPS, GROUPS)
        print(json.dumps({"steps": STEPS, "limit_s": LIMIT_S, **past, **figures}))
    finally:
        run.procs.stop_all()
