"""Tie the lives of a rollout actor's vLLM processes to the actor: when the actor dies, even by ``kill -9``, so do they.

vLLM starts an ``EngineCore`` process under the actor and, with its multiprocessing executor, worker processes under
that. A worker follows its EngineCore (vLLM's death pipe), but nothing follows the actor: killed with -9, it left
EngineCore and its workers running, holding 2.8 GB here (a GPU's memory on a GPU machine).

The actor exports its PID as :data:`ACTOR_PID_ENV` before it builds the engine. :func:`follow_actor` runs in every
vLLM process of the engine, as early as vLLM lets a package in: it is a vLLM general plugin (``pyproject.toml``),
which vLLM loads in EngineCore before it starts any worker and in each worker at init; the weight receiver extension
(``actors/weight_receiver.py``) calls it too, for an environment where ``VLLM_PLUGINS`` leaves the plugin out. It
starts a daemon thread that waits on a pidfd of the actor (``pidfd_open(2)``: woken by the kernel the moment the
actor exits; polling ``kill(pid, 0)`` every half second where pidfds are missing) and then SIGKILLs the process
itself and, in a worker, its EngineCore. A kill -9 of the actor while its engine starts leaves EngineCore alive
only until vLLM has imported itself and reaches the plugin (seconds); no worker is started after that. Workers
that miss the plugin follow their dead EngineCore through vLLM's death pipe, and one that EngineCore was spawning at
that very moment (which has loaded nothing yet) is killed by EngineCore on its way out. Nothing runs in the actor,
so nothing depends on the actor getting to run a handler: that is the point.

A PID can be reused once its process is gone. The watch is only started while the actor is still this process's
parent (EngineCore, or a one-process executor's worker) or grandparent (a worker under EngineCore); otherwise the
actor is already gone and this process ends at once — alone: a parent that is not the actor's child is a reaper
(PID 1, tini), never EngineCore, and is left alone.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.procs import alive, child_pids, parent_of

log = get_logger("lifeline")
ACTOR_PID_ENV = "ASYNCRL_ACTOR_PID"
_POLL_S = 0.5
_following: threading.Thread | None = None


def export_actor_pid() -> None:
    """Called by the actor before it starts vLLM: its engine processes inherit the variable."""
    os.environ[ACTOR_PID_ENV] = str(os.getpid())


def follow_actor() -> threading.Thread | None:
    """In a vLLM process of an actor: end this process (and its EngineCore) when the actor exits.

    Returns the watching thread, or None where there is nothing to follow (no actor PID exported, or this is the
    actor itself).
    """
    global _following
    actor = int(os.environ.get(ACTOR_PID_ENV, "0") or 0)
    if actor <= 0 or actor == os.getpid():
        return None
    if _following is not None:  # the plugin and the receiver extension both ask: one watch per process
        return _following
    parent = os.getppid()
    if parent == actor:
        engine_core = None  # this is EngineCore (or a one-process executor's worker)
    elif parent_of(parent) == actor:
        engine_core = parent  # a worker under EngineCore: take it down too
    else:
        _end(actor, None)  # the actor died before we looked (or its PID was reused)
        return None
    _following = threading.Thread(target=_watch, args=(actor, engine_core), name="asyncrl-lifeline", daemon=True)
    _following.start()
    return _following


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
    """SIGKILL this process's own children, its EngineCore (in a worker), then itself. The children first: a worker
    EngineCore was spawning at that moment has loaded nothing yet, not even this plugin, and with its parent gone
    it can wait forever on the start-up data its parent never sent (beside the resource tracker that waits for it)."""
    log.error("the rollout actor is gone; ending its vLLM processes", actor_pid=actor, pid=os.getpid())
    for pid in [*child_pids(os.getpid()), *([engine_core] if engine_core is not None else [])]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
