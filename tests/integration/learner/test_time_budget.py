"""``learner.max_minutes``: the learner stops by itself when its wall-clock budget is spent — here while it waits for
a batch no actor will send — saying so, and exits 0 like after SIGTERM; the run is recorded as stopped. A budget is the
user's own end, so it exits 0 even with ``--sigterm-exit-code``, which only a SIGTERM before the end turns into its
status (a Kubernetes Job then restarts the learner, and it resumes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from asyncrl.common.plane.audit_file import entry_line
from asyncrl.common.plane.keys import RunKeys
from tests.helpers.waits import wait_for

BIN = Path(sys.executable).parent


def test_the_learner_stops_when_its_time_budget_is_spent(tmp_path: Path, tiny_model_dir, redis_server, redis_client):
    settings = [f"run.root={tmp_path}", "run.name=budget", f"model.path={json.dumps(str(tiny_model_dir))}"]
    settings += ["learner.max_minutes=0.05", "learner.wait_for_batch_s=600"]  # 3 s; the wait alone would be 10 min
    args = [str(BIN / "rl-learner"), "train", "--redis", redis_server.url, "--sigterm-exit-code", "143"]
    args += [arg for setting in settings for arg in ("--set", setting)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "learner.max_minutes reached: stopping after the step in progress" in result.stderr
    events = [entry_line(i.decode(), f) for i, f in redis_client.xrange(RunKeys("budget").audit)]
    [finished] = [e for e in events if e["event"] == "run.finished"]
    assert finished["outcome"] == "stopped" and finished["version"] == 0


def test_sigterm_before_the_end_exits_with_the_code_a_job_restarts_on(tmp_path: Path, tiny_model_dir, redis_server):
    settings = [f"run.root={tmp_path}", "run.name=drained", f"model.path={json.dumps(str(tiny_model_dir))}"]
    args = [str(BIN / "rl-learner"), "train", "--redis", redis_server.url, "--sigterm-exit-code", "143"]
    args += [arg for setting in settings for arg in ("--set", setting)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    log = tmp_path / "learner.log"
    with log.open("w") as sink:
        learner = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_for(lambda: "learner started" in log.read_text(), "the learner's start", proc=learner, timeout_s=300)
        learner.send_signal(signal.SIGTERM)  # a drain: it waits for a batch no actor will send
        assert learner.wait(120) == 143, log.read_text()[-3000:]
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()
    assert "learner stopped by SIGTERM before the run finished: exit 143" in log.read_text()
