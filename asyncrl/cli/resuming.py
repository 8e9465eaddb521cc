"""What ``rl-learner train`` finds in the run folder before anything starts: with ``--resume``, the checkpoint it
names, verified (:func:`verified_checkpoint`), or a run already finished there (:func:`says_finished`), which it then
says and marks in the run's Redis instead of resuming; without, a run already started there (:func:`started_refusal`),
which it refuses to train over."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from asyncrl.common.config import RunConfig


def says_finished(resolved: RunConfig, spec: str, url: str | None) -> bool:
    """Whether the checkpoint ``spec`` names is at ``learner.steps``: then say so, mark the run finished in its Redis
    (at ``url``, when given) and return True; the learner has nothing to do."""
    finished = finished_at(resolved, spec)
    if finished is None:
        return False
    print(finished_line(resolved, finished), file=sys.stderr)
    mark_finished(url, resolved, finished)
    return True


def finished_line(resolved: RunConfig, step: int) -> str:
    return (
        f"run {resolved.run.name!r} finished at step {step} (learner.steps = {resolved.learner.steps}): "
        "nothing to resume; raise learner.steps to train it further"
    )


def started_refusal(resolved: RunConfig) -> str | None:
    """Why a learner started without ``--resume`` must not train in this run folder: it holds a complete checkpoint
    (and the run's Redis its versions), and starting again from ``model.path`` under them would mix two runs. None
    for a run folder with no checkpoint."""
    from asyncrl.learner.checkpoint.history import complete_checkpoints

    saved = complete_checkpoints(resolved.run_dir / "checkpoints")
    if not saved:
        return None
    step, steps, name = saved[-1][0], resolved.learner.steps, resolved.run.name
    start_over = f"to start over, give the run a new name (--set run.name={name}-2) or remove {resolved.run_dir}"
    if step >= steps:
        return (
            f"run {name!r} already finished at step {step} (learner.steps = {steps}) in {resolved.run_dir}: "
            f"nothing to train; to train it further, raise learner.steps and pass --resume latest; {start_over}"
        )
    return (
        f"run {name!r} has a checkpoint at step {step} of {steps} in {resolved.run_dir}: pass --resume latest to go "
        f"on from it; {start_over}"
    )


def mark_finished(url: str | None, resolved: RunConfig, step: int) -> None:
    """Say in the run's Redis that the run finished at ``step``, and wants no actor: a learner killed after its last
    checkpoint but before it said so would otherwise leave actors and reward workers waiting, and an autoscaler
    keeping them."""
    if not url:
        return
    import redis.exceptions as redis_errors

    from asyncrl.common.plane.control import ControlPlane
    from asyncrl.common.plane.keys import connect

    try:
        ControlPlane(connect(url), resolved.run.name).run.mark_finished(step)
    except redis_errors.RedisError as exc:
        print(f"could not mark the run finished in Redis ({exc}); its actors stop when they find it", file=sys.stderr)


def finished_at(resolved: RunConfig, spec: str) -> int | None:
    """The step of the checkpoint ``--resume`` names when the run is done there (at ``learner.steps`` or past it), else
    None (a missing or bad checkpoint is :func:`verified_checkpoint`'s to report)."""
    from asyncrl.learner.checkpoint.format import CheckpointError
    from asyncrl.learner.checkpoint.history import checkpoint_step, find_checkpoint

    try:
        step = checkpoint_step(find_checkpoint(spec, resolved.run_dir / "checkpoints"))
    except CheckpointError:
        return None
    return step if step is not None and step >= resolved.learner.steps else None


def verified_checkpoint(resolved: RunConfig, spec: str):
    """The checkpoint ``--resume`` names, every file checked against its manifest; a bad one exits 2 naming the file."""
    from asyncrl.cli.util import fail
    from asyncrl.learner.checkpoint.format import CheckpointError, open_checkpoint
    from asyncrl.learner.checkpoint.history import find_checkpoint
    from asyncrl.learner.checkpoint.settings import check_world_size

    try:
        checkpoint = open_checkpoint(find_checkpoint(spec, resolved.run_dir / "checkpoints"))
        check_world_size(checkpoint, int(os.environ.get("WORLD_SIZE", "1")))  # before DeepSpeed starts
    except CheckpointError as exc:
        fail(f"cannot resume: {exc}")
    return checkpoint


def how_to_go_on(resolved: RunConfig, config: Path | None, overrides: list[str] | None) -> str:
    """The line after a run stopped early: where it stopped and the command that goes on from there."""
    from asyncrl.learner.checkpoint.history import complete_checkpoints

    saved = complete_checkpoints(resolved.run_dir / "checkpoints")
    where = f"its checkpoint of step {saved[-1][0]}" if saved else "its first checkpoint (none was saved)"
    again = " ".join(["rl-launch run", *([str(config)] if config else []), *(f"--set {o}" for o in overrides or [])])
    return f"run {resolved.run.name!r} stopped; to go on from {where}: {again} --resume latest"
