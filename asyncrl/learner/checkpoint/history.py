"""A run's checkpoints over time: which are complete and which one a resume names (:func:`find_checkpoint`: ``latest``
or a folder), which are kept (:func:`prune`: the last ``checkpoint.keep``, and the best by mean reward with
``checkpoint.keep_best``), and what a resume from an earlier step discards: the checkpoints after it move to
``discarded/`` so that ``latest`` never picks one of them (:func:`set_aside_after`), and the lines of the per-step
JSONL files after it move aside (:func:`truncate_metrics`).

Only a ``step-<N>`` folder with a manifest counts as a checkpoint (:mod:`asyncrl.learner.checkpoint.format`): a
``.tmp-step-<N>`` of a save in progress, or of one that died, is never found, kept or picked.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.private import open_private
from asyncrl.learner.checkpoint.format import MANIFEST, STATE, CheckpointError

log = get_logger("checkpoint")

_STEP_DIR = re.compile(r"step-(\d+)")


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root`` (a ``step-<N>`` folder with a manifest), by step."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and child.is_dir() and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def checkpoint_step(folder: Path) -> int | None:
    """The step of a ``step-<N>`` checkpoint folder (None for a folder named otherwise)."""
    match = _STEP_DIR.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def find_checkpoint(spec: str, root: Path) -> Path:
    """The folder ``spec`` names: ``latest`` (the complete checkpoint of the highest step under ``root``), or a path."""
    if spec != "latest":
        path = Path(spec)
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint folder (pass --resume latest or a step-<N> folder)")
        return path
    saved = complete_checkpoints(root)
    if not saved:
        raise CheckpointError(
            f"no complete checkpoint in {root} to resume from; set checkpoint.every to save periodically "
            "(a run also saves at its end and on SIGTERM)"
        )
    return saved[-1][1]


def reward_of(path: Path) -> float | None:
    """The mean reward a checkpoint recorded, or None (none recorded, or unreadable)."""
    try:
        value = json.loads((path / STATE).read_text()).get("reward_mean")
    except (OSError, ValueError):
        return None
    return float(value) if value is not None else None


def prune(root: Path, keep: int, keep_best: bool) -> list[Path]:
    """Remove complete checkpoints beyond the last ``keep`` (and the best by mean reward when ``keep_best``)."""
    saved = complete_checkpoints(root)
    kept = {path for _, path in saved[-keep:]}
    if keep_best:
        rewarded = [(reward, step, path) for step, path in saved if (reward := reward_of(path)) is not None]
        if rewarded:
            kept.add(max(rewarded)[2])  # ties: the later step
    removed = [path for _, path in saved if path not in kept]
    for path in removed:
        shutil.rmtree(path)
        log.info("removed an old checkpoint", path=path, keep=keep, keep_best=keep_best)
    return removed


def set_aside_after(root: Path, step: int) -> list[Path]:
    """Move the checkpoints after ``step`` (of the steps a resume from ``step`` discards) to ``discarded/``, so that
    ``--resume latest`` never picks one of them. Returns their new paths."""
    later = [path for saved_step, path in complete_checkpoints(root) if saved_step > step]
    if not later:
        return []
    target = root / "discarded" / time.strftime("%Y%m%d-%H%M%S")
    target.mkdir(parents=True, exist_ok=True)
    moved = [Path(shutil.move(str(path), str(target / path.name))) for path in later]
    log.warning(
        "set aside checkpoints of steps this resume discards",
        count=len(moved),
        folder=target,
        action="none; delete the folder when it is no longer needed",
    )
    return moved


def truncate_metrics(path: Path, step: int) -> tuple[int, int]:
    """Keep the lines of a per-step JSONL file (metrics.jsonl, samples.jsonl) up to ``step``; move later ones (steps a
    resume discards, or a half-written line) to ``<name>.discarded.jsonl`` beside it. Returns (kept, moved)."""
    if not path.is_file():
        return 0, 0
    kept, moved = [], []
    for line in path.read_text().splitlines():
        try:
            (kept if int(json.loads(line)["step"]) <= step else moved).append(line)
        except (ValueError, KeyError, TypeError):
            moved.append(line)
    if moved:
        with open_private(path.with_name(f"{path.stem}.discarded.jsonl"), "a") as f:
            f.writelines(line + "\n" for line in moved)
        tmp = path.with_suffix(".jsonl.tmp")
        with open_private(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return len(kept), len(moved)


def count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0
