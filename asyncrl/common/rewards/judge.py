"""The judge: a child process that runs the checks hostile text can make slow, with deadlines.

Used by the ``math`` verifier (math-verify on a response's final answer) and the ``regex`` verifier (a config's
pattern on a response): each names its check by import path (``common/rewards/verifiers.py``: ``MATH_JOB``,
``REGEX_JOB``), which the child imports on first use.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from asyncrl.common.observability.logs import get_logger, worth_logging

log = get_logger("verifiers")

JUDGE_GRACE_S = 0.5
"""How long past a call's ``timeout_s`` the judge waits for an answer before it kills the child."""
JUDGE_START_S = 60.0
"""How long a new child may take to import math-verify and say it is ready (not counted in any call's deadline)."""
JUDGE_MEMORY_BYTES = 2 * 2**30
"""The child's address space beyond what it holds once started (``RLIMIT_AS``): ``10^{10^{10}}`` fails fast."""


class _Overtime(BaseException):
    """The judge's timer went off: a ``BaseException``, so no ``except Exception`` in math-verify or sympy hides it."""


class Judge:
    """Runs checks that hostile text can make slow (math-verify, a config's regex) in a child process, with deadlines.

    Reward functions run on worker threads, where no signal can interrupt them, and a Python thread cannot be killed:
    a hung check in-process would hold a core (and the GIL) for ever. So one child process (``python -c``, started
    with ``subprocess``: safe from a threaded process, and unlike ``multiprocessing``'s spawn it never re-runs the
    parent's main script) runs every check, one at a time (a lock), over a socket pair carrying JSON. In the child
    each check runs in its main thread under an interval timer of ``timeout_s``, whose signal interrupts Python code
    and the ``re`` engine: the check answers False and the child lives on. A check stuck where no signal reaches it
    (a C loop) gets no answer by ``timeout_s + JUDGE_GRACE_S``: the parent kills the child, answers False, and starts
    another on the next call (its start-up, about a second for math-verify's import, is in no check's deadline, though
    it is in the reward call's ``reward.timeout_s``). The child also limits its own memory (:data:`JUDGE_MEMORY_BYTES`)
    and CPU time per check, so it ends by itself if the parent died while it was stuck, and ends at EOF otherwise. Any
    exception a check raises answers False (hostile text, not a bug to report).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self.restarts = 0
        """Children killed or lost so far (for tests and logs)."""

    def ask(self, job: str, args: tuple[str, ...], timeout_s: float) -> bool:
        """``job(*args)`` in the child, ``job`` being the import path ``package.module:function`` of a check, or False
        after ``timeout_s`` or any error. Raises ``RuntimeError`` only when a child cannot start (the worker's failure,
        to be retried; not a score)."""
        with self._lock:
            conn = self._ready()
            try:
                conn.send_bytes(json.dumps([job, list(args), timeout_s]).encode())
                if conn.poll(timeout_s + JUDGE_GRACE_S):
                    return conn.recv_bytes() == b"1"
            except (EOFError, OSError):  # the child died: memory, or its CPU limit
                pass
            self._stop()
            self.restarts += 1
            if worth_logging(self.restarts):
                log.warning("verifier judge killed: no answer in time", job=job, timeout_s=timeout_s, n=self.restarts)
            return False

    def close(self) -> None:
        """End the child, if any (a later call starts a new one)."""
        with self._lock:
            self._stop()

    def _ready(self) -> Connection:
        if self._conn is not None and self._process is not None and self._process.poll() is None:
            return self._conn
        self._stop()
        parent, child = multiprocessing.Pipe()
        boot = "from asyncrl.common.rewards.judge import _judge_main; _judge_main()"
        fd = child.fileno()
        process = subprocess.Popen(
            [sys.executable, "-c", boot], stdin=subprocess.DEVNULL, pass_fds=(fd,), env={**os.environ, _FD: str(fd)}
        )
        child.close()
        try:
            hello = parent.recv_bytes().decode() if parent.poll(JUDGE_START_S) else f"silent for {JUDGE_START_S:g} s"
        except (EOFError, OSError):
            hello = f"exited with status {process.wait(5)}"
        if hello != "ready":
            process.kill()
            process.wait(5)
            parent.close()
            raise RuntimeError(f"verifier judge process did not start: {hello}")
        self._process, self._conn = process, parent
        return parent

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None


_FD = "ASYNCRL_JUDGE_FD"
_JUDGE: Judge | None = None
_JUDGE_LOCK = threading.Lock()


def judge() -> Judge:
    """The process's one :class:`Judge` (its child starts on the first check)."""
    global _JUDGE
    with _JUDGE_LOCK:
        if _JUDGE is None:
            _JUDGE = Judge()
        return _JUDGE


def _judge_main() -> None:
    """The judge child: imports math-verify, says ``ready``, then answers ``[job, args, timeout_s]`` until EOF."""
    conn = Connection(int(os.environ[_FD]))
    try:
        import math_verify  # noqa: F401 (imported before "ready": its second of start-up is no call's)

        logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": the timer below is ours
        signal.signal(signal.SIGALRM, _overtime)
        _limit(resource.RLIMIT_AS, _address_space() + JUDGE_MEMORY_BYTES)
    except Exception as e:
        conn.send_bytes(f"{type(e).__name__}: {e}".encode())
        return
    conn.send_bytes(b"ready")
    while True:
        try:
            job, args, timeout_s = json.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent closed the pipe, or died
            return
        try:
            answer = _judged(job, args, timeout_s)
        except _Overtime:  # the timer went off just as the check returned
            answer = False
        conn.send_bytes(b"1" if answer else b"0")


def _judged(job: str, args: list[str], timeout_s: float) -> bool:
    used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    _limit(resource.RLIMIT_CPU, int(used + timeout_s + JUDGE_GRACE_S) + 2)  # SIGXCPU ends a child stuck in C
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return bool(_check(job)(*args))
    except (_Overtime, Exception):
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _overtime(signum: int, frame: object) -> None:
    raise _Overtime


def _limit(which: int, soft: int) -> None:
    _, hard = resource.getrlimit(which)
    resource.setrlimit(which, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _address_space() -> int:
    """This process's address space in bytes (``/proc/self/statm``), or 0 where there is none to read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@functools.cache
def _check(job: str) -> Callable[..., bool]:
    """The check at import path ``job`` (only the parent names one: it comes over the judge's private pipe)."""
    module, _, name = job.partition(":")
    return getattr(importlib.import_module(module), name)
