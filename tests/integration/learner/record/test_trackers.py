"""The experiment trackers with their real packages, offline: what the learner hands them is what TensorBoard's event
files and W&B's offline run hold afterwards."""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.common.config import load_config
from asyncrl.learner.record.trackers import Trackers
from tests.helpers.waits import wait_for
from tests.helpers.wandb_log import finished, history

ROWS = [{"rollout/reward_mean": 0.25 * step, "train/loss": 1.0 / step, "step": float(step)} for step in (1, 2, 3)]
SAMPLES = [{"step": 2, "pick": "best", "prompt": "2+2=", "response": "4", "reward": 1.0, "advantage": 0.5}]


def fed(tmp_path: Path, tracker: str) -> Path:
    """A run folder whose tracker was given :data:`ROWS` and, at step 2, :data:`SAMPLES`, then closed."""
    config = load_config(None, [f"run.root={tmp_path}", "run.name=tracked", f'monitoring.trackers=["{tracker}"]'])
    trackers = Trackers(config)
    for row in ROWS:
        trackers.metrics(int(row["step"]), row)
        if row["step"] == 2:
            trackers.samples(2, SAMPLES)
    trackers.close(timeout_s=120)
    assert trackers.dropped == 0
    return config.run_dir


def test_tensorboard_holds_every_step_and_the_samples_table(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(fed(tmp_path, "tensorboard") / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")]
    assert rewards == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    [text] = events.Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 2 and "| 2+2= | 4 | 1 | 0.5 |" in table and table.startswith("| step | pick |")


def test_wandb_offline_holds_every_step_and_the_samples_table(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    [run] = (fed(tmp_path, "wandb") / "wandb").glob("offline-run-*")
    [log] = run.glob("run-*.wandb")
    wait_for(lambda: finished(log), "the W&B run's exit record in its log", timeout_s=60)
    rows = history(log)
    assert [(r["_step"], r["rollout/reward_mean"], r["train/loss"]) for r in rows] == [
        (1, 0.25, 1.0), (2, 0.5, 0.5), (3, 0.75, 1 / 3)
    ]
    assert rows[1]["samples/_type"] == "table-file" and rows[1]["samples/nrows"] == 1
    [table] = (run / "files" / "media" / "table").glob("samples_2_*.table.json")
    saved = json.loads(table.read_text())
    assert saved["columns"][:3] == ["step", "pick", "prompt"] and saved["data"][0][2:5] == ["2+2=", "4", 1.0]
