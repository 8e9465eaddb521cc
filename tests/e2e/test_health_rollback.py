"""Planted non-finite steps in a real run: the steps are skipped, the run rolls back to its last healthy checkpoint
with a lower learning rate, the alerts fire, and the run goes on to its last step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e import test_system
from tests.e2e.test_system import ROOT, finish, launch, metrics

model_dir = test_system.model_dir  # the demo's warm-started model (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_non_finite_steps_are_skipped_then_rolled_back_and_the_run_continues(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lr = 3e-4  # the demo's
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the learner imports the planted loss from tests/
    proc = launch(
        tmp_path,
        model_dir,
        "nan",
        "learner.steps=10",
        "checkpoint.every=2",
        "health.max_skipped_steps=2",
        "health.rollback_lr_factor=0.5",
        "algorithm.loss=tests.helpers.nan_loss:ppo_clip_with_nans",
        "algorithm.loss_options={nan_calls=[5, 6]}",  # one micro-batch per step: steps 5 and 6
        actors=1,
    )
    assert finish(proc) == 0
    rows = metrics(tmp_path, "nan")
    assert [int(r["step"]) for r in rows] == list(range(1, 11))  # the rolled-back steps were cut and redone
    discarded = [json.loads(line) for line in (tmp_path / "nan" / "metrics.discarded.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in discarded] == [5, 6]
    assert all(r["train/applied"] == 0.0 and not math.isfinite(r["train/loss"]) for r in discarded)
    assert all(r["train/applied"] == 1.0 for r in rows)
    assert [r["train/lr"] for r in rows[4:]] == pytest.approx([lr * 0.5] * 6)  # after the rollback: lr halved
    log = (tmp_path / "nan" / "logs" / "learner.log").read_text()
    assert "alert firing alert=non_finite" in log
    assert "rolled back to the checkpoint of step 4" in log
