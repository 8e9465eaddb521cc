"""What ``rl-learner train --resume`` finds before anything starts: the checkpoint it names, verified
(:func:`verified_checkpoint`), or a run already finished there (:func:`says_finished`), which it then says and marks
in the run's Redis instead of resuming."""

from __future__ import annotations

import os
import sys

from asyncrl.common.config import RunConfig


def says_finished(resolved: RunConfig, spec: str, url: str | None) -> bool:
    """Whether the checkpoint ``spec`` names is at ``learner.steps``: then say so, mark the run finished in its Redis
    (at ``url``, when given) and return True; the learner has nothing to do."""
    finished = finished_at(resolved, spec)
    if finished is None:
        return False
    print(
        f"run {resolved.run.name!r} finished at step {finished} (learner.steps = {resolved.learner.steps}): "
        "nothing to resume; raise learner.steps to train it further",
        file=sys.stderr,
    )
    mark_finished(url, resolved, finished)
    return True


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
    from asyncrl.learner.checkpoint_format import CheckpointError
    from asyncrl.learner.checkpoint_history import checkpoint_step, find_checkpoint

    try:
        step = checkpoint_step(find_checkpoint(spec, resolved.run_dir / "checkpoints"))
    except CheckpointError:
        return None
    return step if step is not None and step >= resolved.learner.steps else None


def verified_checkpoint(resolved: RunConfig, spec: str):
    """The checkpoint ``--resume`` names, every file checked against its manifest; a bad one exits 2 naming the file."""
    from asyncrl.common.cliutil import fail
    from asyncrl.learner.checkpoint_format import CheckpointError, open_checkpoint
    from asyncrl.learner.checkpoint_history import find_checkpoint
    from asyncrl.learner.checkpoint_settings import check_world_size

    try:
        checkpoint = open_checkpoint(find_checkpoint(spec, resolved.run_dir / "checkpoints"))
        check_world_size(checkpoint, int(os.environ.get("WORLD_SIZE", "1")))  # before DeepSpeed starts
    except CheckpointError as exc:
        fail(f"cannot resume: {exc}")
    return checkpoint
