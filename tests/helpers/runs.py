"""Reading a run's metrics.jsonl as a person does: one row per training step, and the eval rounds beside them."""

from __future__ import annotations

import json
from pathlib import Path


def rows(run_dir: Path) -> list[dict]:
    """Every complete line of metrics.jsonl (a line being written is left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def step_rows(run_dir: Path) -> list[dict]:
    """The training steps' rows, in file order (an eval round's row has ``eval/step``: ``learner/evaluation.py``)."""
    return [row for row in rows(run_dir) if "eval/step" not in row]


def eval_rows(run_dir: Path) -> list[dict]:
    return [row for row in rows(run_dir) if "eval/step" in row]
