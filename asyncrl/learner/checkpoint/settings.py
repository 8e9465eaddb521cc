"""The settings a resume must match. Those that change what is trained are hashed into a checkpoint's run state
(:func:`config_hash`); a resume with other ones is named in a warning, field by field (:func:`config_changes`). The
learner's world size must be the one that saved the checkpoint (DeepSpeed's ZeRO state is partitioned by rank): a
resume with another is refused (:func:`check_world_size`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from asyncrl.common.config import RunConfig
from asyncrl.learner.checkpoint.format import Checkpoint, CheckpointError

RESUMABLE_CHANGES = (
    "learner.steps",
    "learner.wait_for_batch_s",
    "learner.no_actors_s",
    "learner.group_deadline_s",
    "run.root",
)
RESUMABLE_SECTIONS = ("checkpoint.", "transport.", "monitoring.")
"""Settings a resume may change without a warning: they do not change what is trained."""


def flat_config(config: RunConfig) -> dict[str, Any]:
    """``{"section.field": value}`` of every field, as JSON values."""
    return {
        f"{section}.{name}": value
        for section, values in config.model_dump(mode="json").items()
        for name, value in values.items()
    }


def _trains_the_same(name: str) -> bool:
    return name not in RESUMABLE_CHANGES and not name.startswith(RESUMABLE_SECTIONS)


def config_hash(config: RunConfig) -> str:
    """sha256 of the settings that change what is trained (not steps, checkpoints, transport or monitoring)."""
    relevant = {k: v for k, v in flat_config(config).items() if _trains_the_same(k)}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def config_changes(saved: dict[str, Any], config: RunConfig) -> list[str]:
    """The training settings that differ between a checkpoint's config and ``config``: ``name: old -> new``."""
    now = flat_config(config)
    names = sorted(k for k in saved.keys() | now.keys() if _trains_the_same(k) and saved.get(k) != now.get(k))
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in names]


def check_world_size(checkpoint: Checkpoint, world_size: int) -> None:
    """A resume needs the ranks that saved the checkpoint (DeepSpeed's ZeRO state is partitioned by rank): another
    number is refused, naming the one to use."""
    saved = checkpoint.state.world_size
    if saved != world_size:
        raise CheckpointError(
            f"{checkpoint.path} was saved by {saved} learner rank(s) and this learner has {world_size}; DeepSpeed's "
            f"ZeRO state is partitioned by rank, so resume with {saved} (torchrun --nproc-per-node {saved} …), or "
            "start a new run with its exported model (checkpoint.export_hf) as model.path"
        )
