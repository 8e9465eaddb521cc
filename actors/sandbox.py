"""Run untrusted Python (a model's program plus its tests) in a limited subprocess.

Each call gets a fresh temporary directory and a fresh ``python -I`` (isolated mode: no
``PYTHON*`` variables, no user site-packages, the script's folder not on ``sys.path``) with:

- an empty environment except ``PATH`` and a ``HOME`` inside the temporary directory, so no
  secret of the parent (API keys, Redis passwords) can be read;
- ``setrlimit`` in the child before exec: CPU seconds (``RLIMIT_CPU``), address space
  (``RLIMIT_AS``), open files (``RLIMIT_NOFILE``) and written file size (``RLIMIT_FSIZE``, which
  also bounds stdout/stderr: they go to files, never into this process's memory);
- a session of its own, so at the wall-clock limit — and after every run, for strays it forked —
  the whole process group is killed.

This is a resource fence, not a security boundary: the code can still read world-readable files
and open sockets. Run reward workers without secrets in their filesystem, or in a container.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MAX_OPEN_FILES = 64
MAX_FILE_BYTES = 8 * 2**20
_TAIL_BYTES = 2000
_POLL_S = 0.01


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run.

    ``reason`` starts with one word — ``passed``, ``failed``, ``timeout``, ``memory`` or ``output`` —
    then a colon and details (for ``failed``, the last line of stderr, usually the assertion).
    """

    passed: bool
    reason: str
    seconds: float


def run_python_tests(
    code: str, tests: str, *, cpu_s: float = 2, memory_mb: int = 256, wall_s: float = 5
) -> SandboxResult:
    """Run ``code`` followed by ``tests`` as one script; it passes when the script exits with status 0.

    The script is killed when it uses ``cpu_s`` CPU seconds (rounded up to whole seconds), ``memory_mb``
    MiB of address space (an allocation beyond it fails with ``MemoryError``), or ``wall_s`` seconds of
    wall-clock time. Failing to start the interpreter raises (that is the worker's fault, not the code's).
    """
    limits = _Limits(cpu_s, memory_mb, wall_s)
    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as tmp:
        folder = Path(tmp)
        # errors="replace": a lone surrogate in model output must fail the test, not this process.
        (folder / "main.py").write_text(f"{code}\n\n{tests}\n", encoding="utf-8", errors="replace")
        start = time.monotonic()
        timed_out, returncode, cpu_used = _run(folder, limits)
        seconds = time.monotonic() - start
        stderr = _tail(folder / "stderr")
    return SandboxResult(*_verdict(returncode, timed_out, cpu_used, stderr, limits), seconds)


@dataclass(frozen=True)
class _Limits:
    cpu_s: float
    memory_mb: int
    wall_s: float

    def rlimits(self) -> list[tuple[int, int, int]]:
        """``(resource, soft, hard)`` triples, computed in the parent so the child only calls ``setrlimit``.

        CPU: the soft limit sends SIGXCPU (terminates unless handled), the hard one a second later SIGKILL.
        Every other soft limit equals its hard one, so the code cannot raise it back.
        """
        cpu = max(1, math.ceil(self.cpu_s))
        memory = int(self.memory_mb) * 2**20
        return [
            (resource.RLIMIT_CPU, cpu, cpu + 1),
            (resource.RLIMIT_AS, memory, memory),
            (resource.RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
            (resource.RLIMIT_FSIZE, MAX_FILE_BYTES, MAX_FILE_BYTES),
            (resource.RLIMIT_CORE, 0, 0),  # no core dumps from a crash or SIGXCPU
        ]


def _run(folder: Path, limits: _Limits) -> tuple[bool, int, float]:
    """Run ``folder/main.py`` under ``limits``; ``(timed out, return code, CPU seconds used)``.

    stdout and stderr go to files in ``folder`` (bounded by ``RLIMIT_FSIZE``), never through pipes
    into this process's memory.
    """
    rlimits = limits.rlimits()
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(folder)}
    with (folder / "stdout").open("wb") as out, (folder / "stderr").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-I", "main.py"],
            cwd=folder,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            preexec_fn=lambda: _apply_limits(rlimits),
        )
    try:
        timed_out = _wait(proc, limits.wall_s)
    finally:  # also on KeyboardInterrupt: never leave the group running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        returncode, cpu_used = _reap(proc)
    return timed_out, returncode, cpu_used


def _apply_limits(rlimits: list[tuple[int, int, int]]) -> None:
    """Runs in the child between fork and exec (``preexec_fn``).

    Keep it to ``setrlimit`` calls — no imports, no locks, no allocation-heavy work — because a child
    forked from a threaded worker may inherit locks held by other threads (the ``preexec_fn`` caveat).
    """
    for kind, soft, hard in rlimits:
        resource.setrlimit(kind, (soft, hard))


def _wait(proc: subprocess.Popen[bytes], wall_s: float) -> bool:
    """Wait up to ``wall_s`` for the child to exit, without reaping it; True when it timed out.

    Not reaping (``WNOWAIT``) keeps the exited child a zombie, so its pid — the process group id —
    cannot be reused before the caller's ``killpg`` ends any strays it forked.
    """
    deadline = time.monotonic() + wall_s
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return True
        time.sleep(_POLL_S)
    return False


def _reap(proc: subprocess.Popen[bytes]) -> tuple[int, float]:
    """Reap the child: its return code (negative signal number when killed) and the CPU seconds it used."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # tell Popen it is reaped
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _verdict(returncode: int, timed_out: bool, cpu_used: float, stderr: str, limits: _Limits) -> tuple[bool, str]:
    """``(passed, reason)`` from how the child ended."""
    if timed_out:
        return False, f"timeout: wall-clock limit of {limits.wall_s} s exceeded"
    if returncode == 0:
        return True, "passed"
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and cpu_used >= limits.cpu_s):
        return False, f"timeout: CPU-time limit of {limits.cpu_s} s exceeded ({cpu_used:.2f} s used)"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return False, f"memory: limit of {limits.memory_mb} MiB exceeded"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:  # Python ignores SIGXFSZ: EFBIG instead
        return False, f"output: file-size limit of {MAX_FILE_BYTES} bytes exceeded"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else "(no stderr)"
    return False, f"failed: exit status {returncode}: {last}"


def _tail(path: Path) -> str:
    """The last few KiB of a file as text (enough for a traceback's final line)."""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - _TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")
