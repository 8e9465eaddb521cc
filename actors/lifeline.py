"""Tie the lives of a rollout actor's vLLM processes to the actor: when the actor dies, even by ``kill -9``, so do they.

vLLM starts an ``EngineCore`` process under the actor and, with its multiprocessing executor, worker processes under
that. A worker follows its EngineCore (vLLM's death pipe), but nothing follows the actor: killed with -9, it left
EngineCore and its workers running, holding 2.8 GB here (a GPU's memory on a GPU machine).

The actor exports its PID as :data:`ACTOR_PID_ENV` before it builds the engine; vLLM's worker imports our weight
receiver extension (``actors/weight_receiver.py``), which calls :func:`follow_actor`. That starts a daemon thread
that waits on a pidfd of the actor (``pidfd_open(2)``: woken by the kernel the moment the actor exits; polling
``kill(pid, 0)`` every half second where pidfds are missing) and then SIGKILLs the EngineCore and the worker
itself. The other workers of a tensor-parallel engine do the same, and any that does not follows its dead
EngineCore through vLLM's death pipe. Nothing runs in the actor, so nothing depends on the actor getting to run
a handler: that is the point.

A PID can be reused once its process is gone. The watch is only started while the actor is still this process's
parent (one-process executor) or grandparent (workers under EngineCore); otherwise the actor is already gone and
the processes end at once.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

from common.logs import get_logger
from common.procs import alive, parent_of

log = get_logger("lifeline")
ACTOR_PID_ENV = "ASYNCRL_ACTOR_PID"
_POLL_S = 0.5


def export_actor_pid() -> None:
    """Called by the actor before it starts vLLM: its engine processes inherit the variable."""
    os.environ[ACTOR_PID_ENV] = str(os.getpid())


def follow_actor() -> threading.Thread | None:
    """In a vLLM process of an actor: end this process (and its EngineCore) when the actor exits.

    Returns the watching thread, or None where there is nothing to follow (no actor PID exported, or this is the
    actor itself).
    """
    actor = int(os.environ.get(ACTOR_PID_ENV, "0") or 0)
    if actor <= 0 or actor == os.getpid():
        return None
    parent = os.getppid()
    engine_core = parent if parent != actor else None  # a worker under EngineCore: take it down too
    if actor not in (parent, parent_of(parent)):
        _end(actor, engine_core)  # the actor died before we looked (or its PID was reused)
    thread = threading.Thread(target=_watch, args=(actor, engine_core), name="asyncrl-lifeline", daemon=True)
    thread.start()
    return thread


def _watch(actor: int, engine_core: int | None) -> None:
    try:
        fd = os.pidfd_open(actor)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has exited
    else:
        while alive(actor):
            time.sleep(_POLL_S)
    _end(actor, engine_core)


def _end(actor: int, engine_core: int | None) -> None:
    log.error("the rollout actor is gone; ending its vLLM processes", actor_pid=actor, pid=os.getpid())
    if engine_core is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine_core, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
