"""A learner started again on a run whose last checkpoint is at ``learner.steps`` (one killed after its last save,
before it marked the run finished) marks it finished in the run's Redis and wants no actor: the run's actors and
reward workers then stop, and an autoscaler scales them to zero."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from asyncrl.cli.learner import app
from asyncrl.common.plane.control import ControlPlane
from tests.helpers.runs import saved


def test_the_finished_run_is_marked_in_redis(tmp_path: Path, redis_server, redis_client) -> None:
    saved(tmp_path, 8)
    run = ControlPlane(redis_client, "finished").run
    run.set_actors_wanted(2)  # what the killed learner last said
    settings = [f"run.root={tmp_path}", "run.name=finished", "learner.steps=8"]
    args = ["train", "--resume", "latest", "--redis", redis_server.url, *(a for s in settings for a in ("--set", s))]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0 and "finished at step 8" in done.output, done.output
    assert run.finished() == 8 and run.actors_wanted() == 0
