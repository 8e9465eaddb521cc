"""A learner started on a run that is done says so and exits 0 at once: no Redis, no DeepSpeed, no resume."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from asyncrl.cli.learner import app
from tests.helpers.runs import saved


def train(root: Path, steps: int, resume: str = "latest"):
    settings = [f"run.root={root}", "run.name=finished", f"learner.steps={steps}"]
    return CliRunner().invoke(app, ["train", "--resume", resume, *(a for s in settings for a in ("--set", s))])


def test_a_run_resumed_at_its_last_step_says_it_finished_and_exits_0(tmp_path: Path) -> None:
    saved(tmp_path, 3)
    saved(tmp_path, 8)
    done = train(tmp_path, 8)
    assert done.exit_code == 0, done.output
    assert "run 'finished' finished at step 8 (learner.steps = 8): nothing to resume" in done.output
    named = train(tmp_path, 8, resume=str(tmp_path / "finished" / "checkpoints" / "step-8"))
    assert named.exit_code == 0 and "finished at step 8" in named.output


def test_a_run_with_steps_left_is_not_called_finished(tmp_path: Path) -> None:
    saved(tmp_path, 8)
    more = train(tmp_path, 10)  # goes on to verify the checkpoint, which this fake folder fails: exit 2, not 0
    assert more.exit_code == 2 and "finished at step" not in more.output, more.output


def test_a_started_run_is_refused_without_resume_naming_what_to_pass(tmp_path: Path) -> None:
    saved(tmp_path, 4)
    settings = [f"run.root={tmp_path}", "run.name=finished", "learner.steps=8"]
    done = CliRunner().invoke(app, ["train", *(a for s in settings for a in ("--set", s))])
    assert done.exit_code == 2, done.output
    assert "run 'finished' has a checkpoint at step 4 of 8" in done.output
    assert "pass --resume latest to go on from it" in done.output and "--set run.name=finished-2" in done.output


def test_a_finished_run_launched_again_starts_nothing(tmp_path: Path) -> None:
    """``rl-launch run`` on a finished run: without --resume refused, with it said finished; in both cases before
    Redis or any process starts (no redis folder in the run)."""
    from asyncrl.cli.launch import app as launch

    saved(tmp_path, 8)
    settings = [a for s in (f"run.root={tmp_path}", "run.name=finished", "learner.steps=8") for a in ("--set", s)]
    again = CliRunner().invoke(launch, ["run", "demo", *settings])
    assert again.exit_code == 2 and "already finished at step 8 (learner.steps = 8)" in again.output, again.output
    resumed = CliRunner().invoke(launch, ["run", "demo", *settings, "--resume", "latest"])
    assert resumed.exit_code == 0 and "finished at step 8" in resumed.output, resumed.output
    assert not (tmp_path / "finished" / "redis").exists()


def test_the_line_after_a_stop_names_the_step_and_the_command(tmp_path: Path) -> None:
    from asyncrl.cli.resuming import how_to_go_on
    from asyncrl.common.config import load_config

    resolved = load_config(None, [f"run.root={tmp_path}", "run.name=finished"])
    assert "to go on from its first checkpoint (none was saved)" in how_to_go_on(resolved, None, None)
    saved(tmp_path, 3)
    line = how_to_go_on(resolved, Path("run.toml"), ["learner.steps=9"])
    assert line == (
        "run 'finished' stopped; to go on from its checkpoint of step 3: "
        "rl-launch run run.toml --set learner.steps=9 --resume latest"
    )
