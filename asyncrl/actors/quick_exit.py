"""End a rollout actor's vLLM processes without the interpreter's last garbage collection.

When a Python process exits, finalisation runs one more full cyclic collection over every object still alive. A
vLLM engine process holds millions (vLLM, torch and transformers imported, the model, the scheduler): on this
project's 2-core test machine that scan kept each EngineCore alive about 2 s after its engine had shut down, and the
actor waits for it (vLLM's process manager joins EngineCore). :func:`skip_final_collection` moves everything into
the permanent generation at exit (``gc.freeze``), which the final collection skips; the operating system reclaims the
memory as the process ends. vLLM does the same after a clean shutdown on ROCm (``EngineCoreProc.run_engine_core``).

Only cyclic garbage's finalisers are skipped: whatever must reach disk is closed explicitly before exit (logs by
``logging.shutdown``, asyncrl's own files by their ``close``), never left to the collector.

It is a vLLM general plugin (``pyproject.toml``), so it runs in each of vLLM's processes and in the actor, as early as
vLLM lets a package in; its exit hook is then among the first registered, hence the last to run. Processes that are not
a rollout actor's are left as they are.
"""

from __future__ import annotations

import atexit
import gc
import os

from asyncrl.actors.lifeline import ACTOR_PID_ENV

_registered = False


def skip_final_collection() -> None:
    """The plugin: in an actor's process, freeze every object at exit so finalisation does not scan them (once)."""
    global _registered
    if _registered or not os.environ.get(ACTOR_PID_ENV):
        return
    atexit.register(gc.freeze)
    _registered = True
