"""The exit statuses of asyncrl's commands, in one place: what ``rl-launch``, Slurm's requeue, a Kubernetes Job's
``podFailurePolicy`` and a person's shell read (docs/troubleshooting.md lists them with what to do)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    """Done: the run finished, or a process of a finished run left by itself."""
    FAILED = 1
    """An error the process could not handle (its last error line says which); also a submission Slurm refused."""
    REFUSED = 2
    """A setting refused before any work started: ``cli.util.fail``'s, an actor's whose engine cannot generate with
    the run's settings, a Slurm job whose actor nodes cannot read the run folder. No restart changes it: ``rl-launch``
    stops a run every actor refused, and a Kubernetes Job fails at once."""
    NO_WORKERS = 3
    """The learner saw no rollout actor or no reward worker for ``learner.no_actors_s`` (or every actor
    ``rl-launch run`` started has exited); a checkpoint was saved."""
    REDIS_OUTAGE = 75
    """Redis stayed unreachable past ``transport.redis_outage_s`` (``EX_TEMPFAIL`` of sysexits.h: try again later)."""
    INTERRUPTED = 130
    """``rl-launch run`` after Ctrl-C or SIGTERM, as a shell reports an interrupted command (128 + SIGINT)."""
    STOPPED_EARLY = 143
    """The learner stopped by a signal before the run finished, when asked for it (``--sigterm-exit-code``, 128 +
    SIGTERM): Slurm's job requeues only such a learner, never a finished run."""
