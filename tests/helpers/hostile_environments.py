"""An environment that attacks the process it serves, for the environment host's fence
(``tests/integration/actors/environments/test_environment_host.py``). Named by import path in the run config.

Its row's answer says what it does: ``attack`` runs the attack ``options["how"]`` names against the actor (the host's
parent, and ``options["victim"]``, the actor's pid, as a hub's code could learn it), then ends its own process, the
worst it should be able to do; anything else behaves as :class:`~tests.helpers.episodes.Prodding`. An attack that
gets through either kills the actor or fails the step with ``ESCAPED`` in its error.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Any

from asyncrl.common.environments.protocol import EpisodeRow, Step
from tests.helpers.episodes import Prodding

PTRACE_SEIZE, PTRACE_DETACH = 0x4206, 17
EFAULT = 14


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class Hostile(Prodding):
    """``how``: ``kill_parent`` (``kill(getppid(), 9)``, then the actor's pid), ``kill_all`` (``kill(-1, 9)``), or
    ``trace`` (``ptrace``, ``process_vm_writev`` and ``/proc/<pid>/mem`` on the actor, and a write to the actor's
    0600 file ``options["file"]``)."""

    def __init__(self, row: EpisodeRow, options: dict[str, Any]) -> None:
        super().__init__(row, options)
        self.attack = row.answer == "attack"
        self.options = options

    def step(self, action: str) -> Step:
        if not self.attack:
            return super().step(action)
        getattr(self, self.options["how"])(self.options["victim"])
        os._exit(9)  # it got nowhere: all it can do is end its own process

    def kill_parent(self, victim: int) -> None:
        for target in (os.getppid(), victim):
            with contextlib.suppress(OSError):
                os.kill(target, 9)

    def kill_all(self, victim: int) -> None:
        if os.readlink("/proc/self/ns/pid") == self.options["victim_pidns"]:
            # Not in a PID namespace of its own: kill(-1, 9) would reach every process the uid may signal on this
            # machine, the test's neighbours too. Play only the actor's part of it.
            os.kill(victim, 9)
            return
        with contextlib.suppress(OSError):
            os.kill(-1, 9)

    def trace(self, victim: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        for target in {os.getppid(), victim} - {0}:
            if libc.ptrace(PTRACE_SEIZE, target, 0, 0) == 0:
                libc.ptrace(PTRACE_DETACH, target, 0, 0)
                raise RuntimeError(f"ESCAPED: ptrace attached to {target}")
            byte = ctypes.create_string_buffer(1)
            local, remote = _Iovec(ctypes.addressof(byte), 1), _Iovec(8, 1)  # never mapped: EFAULT if allowed
            libc.process_vm_writev(target, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if ctypes.get_errno() == EFAULT:
                raise RuntimeError(f"ESCAPED: process_vm_writev reached {target}")
            with contextlib.suppress(OSError), open(f"/proc/{target}/mem", "r+b"):
                raise RuntimeError(f"ESCAPED: opened /proc/{target}/mem for writing")
        with contextlib.suppress(OSError), open(self.options["file"], "a") as file:
            file.write("written by the environment")
            raise RuntimeError(f"ESCAPED: wrote {self.options['file']}")
