"""Planted non-finite steps in a real run: the steps are skipped, the run rolls back to its last healthy checkpoint
with a lower learning rate, the alerts fire, and the run goes on to its last step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e.test_system import ROOT, finish, launch, metrics

pytestmark = pytest.mark.e2e


def test_non_finite_steps_are_skipped_then_rolled_back_and_the_run_continues(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lr = 3e-4  # the demo's
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the learner imports the planted loss from tests/
    proc = launch(
        tmp_path,
        model_dir,
        "nonfinite",
        "learner.steps=10",
        "checkpoint.every=2",
        "health.max_skipped_steps=2",
        "health.rollback_lr_factor=0.5",
        "algorithm.loss=tests.helpers.nan_loss:ppo_clip_with_nans",
        "algorithm.loss_options={nan_calls=[5, 6]}",  # one micro-batch per step: steps 5 and 6
        actors=1,
    )
    assert finish(proc) == 0
    rows = metrics(tmp_path, "nonfinite")
    assert [int(r["step"]) for r in rows] == list(range(1, 11))  # the rolled-back steps were cut and redone
    discarded_file = tmp_path / "nonfinite" / "metrics.discarded.jsonl"
    discarded = [json.loads(line) for line in discarded_file.read_text().splitlines()]
    # Step 5 began from the weights saved at step 4, so those are suspect too: the rollback goes to step 2.
    assert [int(r["step"]) for r in discarded] == [3, 4, 5, 6]
    assert [r["train/applied"] for r in discarded] == [1.0, 1.0, 0.0, 0.0]
    assert not any(math.isfinite(r["train/loss"]) for r in discarded[2:])
    assert all(r["train/applied"] == 1.0 for r in rows)
    assert [r["train/lr"] for r in rows[2:]] == pytest.approx([lr * 0.5] * 8)  # after the rollback: lr halved
    log = (tmp_path / "nonfinite" / "logs" / "learner.log").read_text()
    assert "alert firing alert=non_finite" in log
    assert "rolled back to the checkpoint of step 2" in log
