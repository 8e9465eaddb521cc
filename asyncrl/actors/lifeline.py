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
itself and, in a worker, its EngineCore. vLLM loads the plugin in EngineCore only once EngineCore has shaken hands
with the actor, so a kill -9 of the actor while its engine starts can come before it (see the sweeper below). Workers
that miss the plugin follow their dead EngineCore through vLLM's death pipe, and one that EngineCore was spawning at
that very moment (which has loaded nothing yet) is killed by EngineCore on its way out. Nothing runs in the actor,
so nothing depends on the actor getting to run a handler: that is the point.

An engine core that the actor forks (a CPU engine whose worker runs inside it:
``actors/engine_processes.py: start_engine``) follows the actor from the fork on (:func:`follow_forked_engine`). A
process of the engine that has not reached the plugin yet when the actor dies (a spawned EngineCore importing vLLM or
in its handshake with the actor, a worker half-spawned) is ended by the actor's sweeper instead
(:func:`start_sweeper`): a small process of its own, started with the engine, that waits for the actor to exit and
then SIGKILLs every process whose environment carries the actor's :data:`ACTOR_PID_ENV` (each vLLM process is
started with it), for as long as new ones keep appearing.

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
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.procs import alive, child_pids, parent_of

log = get_logger("lifeline")
ACTOR_PID_ENV = "ASYNCRL_ACTOR_PID"
_POLL_S = 0.5
_following: threading.Thread | None = None
_sweeper: subprocess.Popen | None = None
SWEEP_QUIET_S = 2.0
"""The sweeper stops once it has found no process of the actor's for this long (a process being spawned shows the
variable once it has exec'd, a moment after its fork)."""
SWEEP_MAX_S = 60.0
"""And in any case after this long."""


def export_actor_pid() -> None:
    """Called by the actor before it starts vLLM: its engine processes inherit the variable.

    The sweeper finds them by it in ``/proc/PID/environ``, which holds the environment a process was exec'd with. So
    vLLM starts its processes by spawning (a fresh exec; the CPU platform does anyway, a GPU one forks unless told),
    and ``setproctitle`` — vLLM names its processes ``VLLM::…`` — leaves that block alone (``SPT_NOENV``; it would
    otherwise write the title over it). A setting the user gave is kept."""
    os.environ[ACTOR_PID_ENV] = str(os.getpid())
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("SPT_NOENV", "1")


def follow_forked_engine(*also: Callable[[], object]) -> None:
    """In the actor, before vLLM forks its engine core (``actors/engine_processes.py: start_engine``): a process
    forked from the actor follows it at once, from the fork itself (``os.register_at_fork``), before vLLM has loaded
    anything in it. A forked process carries the actor's PID in its copy of ``os.environ`` but not in
    ``/proc/PID/environ`` (the environment it was exec'd with), so the sweeper cannot find it: this takes the sweeper's
    place. ``also``: what else a forked process runs then — vLLM runs its general plugins once per process, and a
    forked one inherits them as run, whatever they did in the actor."""
    global _forks_followed
    if _forks_followed:
        return

    def in_the_fork() -> None:
        follow_actor()
        for setup in also:
            setup()

    os.register_at_fork(after_in_child=in_the_fork)
    _forks_followed = True


_forks_followed = False


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
        _own_process_group()
    elif parent_of(parent) == actor:
        engine_core = parent  # a worker under EngineCore: take it down too
    else:
        _end(actor, None)  # the actor died before we looked (or its PID was reused)
        return None
    _following = threading.Thread(target=_watch, args=(actor, engine_core), name="asyncrl-lifeline", daemon=True)
    _following.start()
    return _following


def _own_process_group() -> None:
    """Move EngineCore (and the workers it starts after this) out of the actor's process group: a signal sent to the
    group — Ctrl-C in the actor's terminal, a Slurm ``scancel`` of the actor's job step — then reaches the actor alone,
    which drains (aborts its requests, gives its groups back, leaves the registry) and shuts its engine down. Reached
    by the same signal, EngineCore shut itself down under the draining actor (``EngineDeadError``) and the actor never
    left cleanly. The actor's death still ends the engine (the watch below)."""
    with contextlib.suppress(OSError):  # a session leader cannot move; it is then alone anyway
        os.setpgid(0, 0)


def _watch(actor: int, engine_core: int | None) -> None:
    _wait_for_exit(actor)
    _end(actor, engine_core)


def _wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` has exited: woken by the kernel through a pidfd, or polling where there is none."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has exited
        os.close(fd)
    else:
        while alive(pid):
            time.sleep(_POLL_S)


def _end(actor: int, engine_core: int | None) -> None:
    """SIGKILL this process's own children, its EngineCore (in a worker), then itself. The children first: a worker
    EngineCore was spawning at that moment has loaded nothing yet, not even this plugin, and with its parent gone
    it can wait forever on the start-up data its parent never sent (beside the resource tracker that waits for it)."""
    log.error("the rollout actor is gone; ending its vLLM processes", actor_pid=actor, pid=os.getpid())
    for pid in [*child_pids(os.getpid()), *([engine_core] if engine_core is not None else [])]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def start_sweeper() -> subprocess.Popen | None:
    """In the actor, once :func:`export_actor_pid` has run: start the sweeper (module docstring), once per actor."""
    global _sweeper
    if _sweeper is not None and _sweeper.poll() is None:
        return _sweeper
    env = {key: value for key, value in os.environ.items() if key != ACTOR_PID_ENV}  # it must not sweep itself
    command = [sys.executable, "-m", "asyncrl.actors.lifeline", str(os.getpid())]
    _sweeper = subprocess.Popen(command, env=env, stdin=subprocess.PIPE)  # stdin: :func:`engine_shut_down`
    return _sweeper


def engine_shut_down() -> None:
    """In the actor, after its engine's orderly shutdown: tell the sweeper, which then ends what is still exiting of
    the engine without calling it an error (it is one only when the actor dies with its engine running)."""
    if _sweeper is not None and _sweeper.stdin is not None:
        with contextlib.suppress(OSError):
            _sweeper.stdin.write(CLEAN)
            _sweeper.stdin.flush()


CLEAN = b"engine shut down\n"


def sweep(actor: int) -> int:
    """SIGKILL the processes that carry ``actor``'s PID in their environment until none has appeared for
    :data:`SWEEP_QUIET_S`; returns how many were killed."""
    marker = f"{ACTOR_PID_ENV}={actor}".encode()
    killed: set[int] = set()
    started = quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < SWEEP_QUIET_S and time.monotonic() - started < SWEEP_MAX_S:
        found = [pid for pid in _marked(marker) if pid != os.getpid()]
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if found:
            killed |= set(found)
            quiet_since = time.monotonic()
        time.sleep(0.05)
    return len(killed)


def _marked(marker: bytes) -> list[int]:
    """The processes whose environment holds the entry ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environment = (entry / "environ").read_bytes()
            except OSError:  # gone, or not ours to read
                continue
            if marker in environment.split(b"\0"):
                found.append(int(entry.name))
    return found


def _sweep_after(actor: int) -> None:
    """The sweeper: wait for the actor to exit, then :func:`sweep`. Interrupts meant for the actor's terminal or
    process group do not end it before its work is done."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    _wait_for_exit(actor)
    clean = _told_clean()
    if (killed := sweep(actor)) and not clean:
        log.error("the rollout actor is gone; ended the vLLM processes it left", actor_pid=actor, processes=killed)


def _told_clean() -> bool:
    """Whether the actor said its engine shut down in order (:func:`engine_shut_down`), read without waiting: a
    vLLM process forked from the actor may hold the pipe open."""
    os.set_blocking(0, False)
    try:
        return CLEAN in (os.read(0, 4096) or b"")
    except OSError:  # nothing written (EAGAIN), or no pipe
        return False


if __name__ == "__main__":
    _sweep_after(int(sys.argv[1]))
