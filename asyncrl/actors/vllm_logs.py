"""vLLM's routine lines, kept out of a rollout actor's log at INFO.

Each weight version makes vLLM's engine core log "setting pause state to PAUSED_ALL" and "… UNPAUSED" and each worker
"Reloading and processing weights took 0.01 seconds": three lines a step, hundreds per run, that bury the lines that
matter. They come from vLLM's own processes, so the filter is installed there, by vLLM itself: it runs every
``vllm.general_plugins`` entry point early in each of its processes (``pyproject.toml``). The lines are still logged
when vLLM's logging is at DEBUG (``VLLM_LOGGING_LEVEL=DEBUG``). Processes that are not a rollout actor's are left as
they are.
"""

from __future__ import annotations

import logging

from asyncrl.actors.lifeline import ACTOR_PID_ENV

ROUTINE = ("setting pause state to ", "Reloading and processing weights took ")
"""How the routine lines begin (their format strings, before their arguments)."""


class RoutineLines(logging.Filter):
    """Drops the :data:`ROUTINE` lines vLLM logs at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        routine = record.levelno == logging.INFO and isinstance(record.msg, str) and record.msg.startswith(ROUTINE)
        return not routine


def quiet_routine_lines() -> None:
    """The plugin: put :class:`RoutineLines` on the handlers of vLLM's logger (once), in an actor's vLLM process."""
    import os

    if not os.environ.get(ACTOR_PID_ENV):
        return
    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, RoutineLines) for f in handler.filters):
            handler.addFilter(RoutineLines())
