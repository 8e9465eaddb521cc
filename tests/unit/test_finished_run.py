"""A learner started on a run that is done says so and exits 0 at once: no Redis, no DeepSpeed, no resume."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from asyncrl.learner.checkpoint_format import MANIFEST
from asyncrl.learner.cli import app


def saved(root: Path, step: int) -> None:
    folder = root / "finished" / "checkpoints" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text("{}")


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
