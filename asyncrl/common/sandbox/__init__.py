"""Run untrusted Python (a model's program plus its tests) behind the strongest fence this machine allows.

The entry points — :func:`run_python_tests`, :func:`run_python` — and :func:`isolation`, the fence of this process:
detected once, at the first run, by starting each candidate in turn, and logged then. The parts, each a module:

- :mod:`~asyncrl.common.sandbox.fences`: the fences, what each one isolates and what none does, and the
  candidates this machine may start;
- :mod:`~asyncrl.common.sandbox.run`: one run behind a given fence — files, limits, wall clock, output,
  report, verdict;
- :mod:`~asyncrl.common.sandbox.supervisor`: stage 2, started by path; it builds the private root, starts the
  run's two interpreters and reports;
- :mod:`~asyncrl.common.sandbox.harness`: what those run — the program in one, its tests in the other, calls
  between them by value — and why only tests that ran to their end pass a run.

Each call runs the program under ``python -I`` (isolated mode: no ``PYTHON*`` variables, no user site-packages) with
an environment of only ``PATH`` and ``HOME``. The process tree::

    worker thread
      setpriv --pdeathsig KILL            the worker dies -> this dies (a new session: one process group)
        unshare ... --fork --kill-child   only with namespaces; it dies -> the namespace's init dies
          python -I -S supervisor.py <config>
                                          stage 2, init of the PID namespace: builds the private root, forks,
                                          waits, reports on a pipe (ready / exit status, CPU seconds, tests passed)
            python -I -S -c <boot> runner the tests, not dumpable, holding the run's token; the program's names are
                                          handles into the server
            python -I -c <boot> server    the untrusted program, then the tests' calls into it

Both with the limits of the run. Stage 2 and the harness run in interpreters where asyncrl is not importable: both
import the standard library only.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.sandbox.fences import Isolation, candidates
from asyncrl.common.sandbox.run import Limits, SandboxResult, run_behind

log = get_logger("sandbox")

_PROBE_WALL_S = 30.0  # detection must not mistake a loaded machine for a refusal
_ISOLATION: Isolation | None = None  # detected at the first run
_DETECT_LOCK = threading.Lock()


def isolation() -> Isolation:
    """The fence of this process, detected at the first call by starting each candidate once, and logged then.

    Raises when none starts (``setpriv``/``unshare`` missing, or the interpreter cannot run): the worker's fault.
    """
    global _ISOLATION
    with _DETECT_LOCK:
        if _ISOLATION is None:
            _ISOLATION = _detect()
            _log_isolation(_ISOLATION)
        return _ISOLATION


def run_python_tests(
    code: str, tests: str, *, cpu_s: float = 2, memory_mb: int = 256, wall_s: float = 5
) -> SandboxResult:
    """Run ``code``, then ``tests`` against its top-level names; it passes when the tests' last statement has run
    (or they exited with a success code, as ``unittest.main()`` does).

    The tests run in an interpreter of their own: the program's functions and objects reach them as handles, values
    cross by value, and a handle never compares with a value. The program's exit status alone never passes a run:
    exiting before the tests end (with any status) fails it (:mod:`~asyncrl.common.sandbox.harness` says
    how, what crosses between the two, and what a program can still do).

    The script is killed when it uses ``cpu_s`` CPU seconds (rounded up to whole seconds), ``memory_mb``
    MiB of address space (an allocation beyond it fails with ``MemoryError``), or ``wall_s`` seconds of
    wall-clock time. A sandbox that cannot start raises (that is the worker's fault, not the code's).
    """
    return run_behind(isolation(), code, tests, Limits(cpu_s, memory_mb, wall_s))


def run_python(code: str, *, cpu_s: float = 2, memory_mb: int = 256, wall_s: float = 5) -> SandboxResult:
    """Run ``code`` alone (a tool call's program) behind the same fence and limits as :func:`run_python_tests`;
    ``passed`` when it ran to its end, ``stdout`` what it printed."""
    return run_python_tests(code, "pass", cpu_s=cpu_s, memory_mb=memory_mb, wall_s=wall_s)


# --------------------------------------------------------------------------- which fence


def _detect() -> Isolation:
    """The first candidate that runs a trivial program; the refusals of the stronger ones are kept in ``refused``."""
    refused: list[str] = []
    for fence in candidates():
        try:
            result = run_behind(fence, "", "", Limits(cpu_s=10, memory_mb=512, wall_s=_PROBE_WALL_S))
        except RuntimeError as error:
            refused.append(f"{fence.fence}: {error}")
            continue
        if result.passed:
            return replace(fence, refused="; ".join(refused))
        refused.append(f"{fence.fence}: the probe {result.reason}")
    raise RuntimeError("the sandbox cannot start on this machine: " + "; ".join(refused))


def _log_isolation(fence: Isolation) -> None:
    fields = {
        "fence": fence.fence,
        "namespaces": ",".join(fence.namespaces) or "none",
        "user": fence.user,
        "processes": fence.processes,
    }
    if not fence.refused:
        log.info("sandbox isolation", **fields)
        return
    log.warning(
        "sandbox runs behind a weaker fence",
        **fields,
        refused=fence.refused,
        action="let the reward worker create namespaces (root with CAP_SYS_ADMIN, or user namespaces "
        "enabled: sysctl user.max_user_namespaces), or keep secrets and services out of its reach",
    )
