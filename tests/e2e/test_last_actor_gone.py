"""A run whose last rollout actor is gone stops by itself: `rl-launch run` with one actor, killed with -9 mid-run.

The learner sees no live actor for ``learner.no_actors_s``, saves a checkpoint of the step it reached and exits 3;
the launcher says once which child failed, with the line of its log that says why, then why the learner stopped and
what to do, and exits 3 after stopping every process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from learner.checkpoint import complete_checkpoints
from tests.helpers.runs import step_rows
from tests.helpers.stack import actor_pid, finish, launch
from tests.helpers.waits import wait_for

pytestmark = pytest.mark.e2e
NO_ACTORS_S = 5


def test_a_run_whose_last_actor_is_killed_saves_a_checkpoint_and_exits_3(tmp_path: Path, model_dir: Path) -> None:
    run_dir, stderr = tmp_path / "alone", tmp_path / "launcher.err"
    settings = ("learner.steps=1000", f"learner.no_actors_s={NO_ACTORS_S}", "checkpoint.every=0")
    proc = launch(tmp_path, model_dir, "alone", *settings, actors=1, stderr=stderr)
    try:
        wait_for(lambda: len(step_rows(run_dir)) >= 2, "two steps", proc=proc, timeout_s=600, poll_s=0.5)
        os.kill(actor_pid(run_dir / "logs" / "actor-0.log"), signal.SIGKILL)
        assert finish(proc, timeout_s=300) == 3, stderr.read_text()[-3000:]
    finally:
        finish(proc, 1)
    said = stderr.read_text()
    assert said.count("actor-0 exited with an error:") == 1, said[-3000:]
    assert "learner stopped: no rollout actor left" in said and "--resume latest" in said, said[-3000:]
    reached = [int(row["step"]) for row in step_rows(run_dir)]
    assert reached == list(range(1, len(reached) + 1)) and len(reached) < 1000
    assert complete_checkpoints(run_dir / "checkpoints")[-1][0] == reached[-1]  # the resume starts where it stopped
