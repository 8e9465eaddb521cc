"""Faults planted in a live run's environment host on its reward worker (``environment.isolation = "workers"``): the
process that runs the environments the worker serves to every actor is hung (SIGSTOP) for longer than
``environment.step_timeout_s``, then killed -9, with a training step between the two and after each.

The host is found from the root PID namespace, where its fence (``actors/environments/fence.py``: its own PID
namespace, behind ``setpriv`` and ``unshare``) does not hide it: the worker's descendant whose command is
``python -m asyncrl.actors.environments.host``. The fence's launchers name the module in their arguments too, so only
the interpreter itself matches.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
from pathlib import Path

import psutil

from tests.helpers.runs import step_rows
from tests.helpers.waits import wait_for

HOST_MODULE = "asyncrl.actors.environments.host"


@dataclasses.dataclass(frozen=True)
class HostFaults:
    """What was done to the environment host, and when (wall-clock seconds, the clock of metrics.jsonl's ``time``)."""

    hung_pid: int
    hung_at: float
    released_at: float
    """When the hang ended: the host had replaced the hung process (it kills one with too many stuck steps), or this
    test sent it SIGCONT after the hold."""
    replaced_while_hung: bool
    killed_pid: int
    killed_at: float
    replacement_pid: int
    """The host process running after the kill (neither the hung nor the killed one)."""


def environment_hosts(worker_pid: int) -> list[psutil.Process]:
    """The live processes that run environments under the process ``worker_pid`` (module docstring)."""
    found = []
    for proc in psutil.Process(worker_pid).children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.cmdline()[1:] == ["-m", HOST_MODULE]:
                found.append(proc)
        except psutil.Error:  # it ended meanwhile
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def the_host(worker_pid: int, launcher: subprocess.Popen, other_than: frozenset[int] = frozenset()) -> psutil.Process:
    """The one host process of the worker, once there is one that is none of ``other_than``."""

    def found() -> psutil.Process | None:
        hosts = [p for p in environment_hosts(worker_pid) if p.pid not in other_than]
        assert len(hosts) <= 1, [p.cmdline() for p in hosts]
        return hosts[0] if hosts else None

    return wait_for(found, "the reward worker's environment host", proc=launcher, timeout_s=120, poll_s=0.1)


def a_step_after(run_dir: Path, moment: float, launcher: subprocess.Popen, what: str) -> float:
    """Wait for a training step whose row was written after ``moment``; its time."""

    def stepped() -> float | None:
        return next((row["time"] for row in step_rows(run_dir) if row["time"] > moment), None)

    return wait_for(stepped, f"a training step after {what}", proc=launcher, timeout_s=300, poll_s=0.2)


def hang_then_kill(run_dir: Path, worker_pid: int, step_timeout_s: float, launcher: subprocess.Popen) -> HostFaults:
    """SIGSTOP the worker's environment host for ``step_timeout_s`` and 5 s more, then (once a step went by) SIGKILL
    the host process running then, and wait for a step after that. A host process this stopped is continued in the
    end if nothing killed it."""
    hung = the_host(worker_pid, launcher)
    hung_at = time.time()
    hung.suspend()
    died_at = None
    try:
        # a hold of fixed length is the fault itself, not a wait for an event: the host may replace the process
        # meanwhile (too many stuck steps), which is noted, and the hold goes on
        while time.time() < hung_at + step_timeout_s + 5.0:
            if died_at is None and not alive(hung.pid):
                died_at = time.time()
            time.sleep(0.1)
        if died_at is None:
            hung.resume()
        released_at = died_at or time.time()
    finally:
        if alive(hung.pid):
            hung.resume()
    a_step_after(run_dir, released_at, launcher, "the hang")

    victim = the_host(worker_pid, launcher)
    killed_at = time.time()
    victim.send_signal(signal.SIGKILL)
    a_step_after(run_dir, killed_at, launcher, "the kill")
    replacement = the_host(worker_pid, launcher, other_than=frozenset({hung.pid, victim.pid}))
    return HostFaults(hung.pid, hung_at, released_at, died_at is not None, victim.pid, killed_at, replacement.pid)
