"""One run of the code sandbox: a program and its tests behind a given fence, with limits, to a :class:`SandboxResult`.

:func:`run_behind` writes the program to ``main.py`` and the tests to ``tests.py`` in a fresh temporary folder and
starts stage 2 (:mod:`asyncrl.common.sandbox.supervisor`, run by path: ``python -I -S <its file> <config>``)
behind the fence's launcher (:mod:`asyncrl.common.sandbox.fences`), in a new session, with an environment of
only ``PATH``. Stage 2 sets the limits of :class:`Limits` in the run's two processes, the program's and the tests',
and runs the harness (:mod:`asyncrl.common.sandbox.harness`, compiled once here) in both with an environment
of only ``PATH`` and ``HOME``. This module
owns the rest: the wall clock (it kills the whole process group), the output (stdout and stderr go to files bounded by
``RLIMIT_FSIZE``, of which only the last few KiB are read back), stage 2's report, the per-run uid of a root worker
(and, under the ``rlimits`` fence, killing every process of that uid after the run), and the verdict's reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import marshal
import math
import os
import resource
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.common.sandbox.fences import MAX_PROCESSES, UID_BASE, Isolation, tool

MAX_OPEN_FILES = 64
MAX_FILE_BYTES = 8 * 2**20
SCRATCH_BYTES = 64 * 2**20  # the private tmpfs: working folder, /tmp and /dev/shm together
SCRATCH_INODES = 4096
SUPERVISOR = Path(__file__).resolve().with_name("supervisor.py")  # stage 2, run by path
HARNESS = Path(__file__).resolve().with_name("harness.py")  # compiled here, run by the run's two interpreters
_TAIL_BYTES = 2000
_POLL_S = 0.01
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_DEVICE_LINKS = (
    ("/dev/fd", "/proc/self/fd"),
    ("/dev/stdin", "/proc/self/fd/0"),
    ("/dev/stdout", "/proc/self/fd/1"),
    ("/dev/stderr", "/proc/self/fd/2"),
)
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_RUN_COUNTER = itertools.count()


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run.

    ``reason`` starts with one word — ``passed``, ``failed``, ``timeout``, ``memory`` or ``output`` —
    then a colon and details (for ``failed``, the last line of stderr, usually the assertion).
    """

    passed: bool
    reason: str
    seconds: float
    stdout: str = ""
    """The last few KiB of what the program printed."""


@dataclass(frozen=True)
class Limits:
    """What one run may use: ``cpu_s`` CPU seconds per process, ``memory_mb`` MiB of address space per process,
    ``wall_s`` seconds of wall-clock time for the whole run."""

    cpu_s: float
    memory_mb: int
    wall_s: float

    def rlimits(self, nproc: bool) -> list[tuple[int, int, int]]:
        """``(resource, soft, hard)`` triples, set by stage 2 in the program's process just before its exec.

        CPU: the soft limit sends SIGXCPU (terminates unless handled), the hard one a second later SIGKILL.
        Every other soft limit equals its hard one, so the code cannot raise it back. ``RLIMIT_NPROC`` only when
        it counts this run alone (``nproc``): for the worker's own uid it would count the worker's processes too.
        """
        cpu = max(1, math.ceil(self.cpu_s))
        memory = int(self.memory_mb) * 2**20
        limits = [
            (resource.RLIMIT_CPU, cpu, cpu + 1),
            (resource.RLIMIT_AS, memory, memory),
            (resource.RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
            (resource.RLIMIT_FSIZE, MAX_FILE_BYTES, MAX_FILE_BYTES),
            (resource.RLIMIT_CORE, 0, 0),  # no core dumps from a crash or SIGXCPU
        ]
        return [*limits, (resource.RLIMIT_NPROC, MAX_PROCESSES, MAX_PROCESSES)] if nproc else limits


@dataclass(frozen=True)
class _Outcome:
    timed_out: bool
    returncode: int | None  # the program's (negative: the signal that killed it); None: its init died first
    cpu_used: float
    stderr: str
    tests_passed: bool = False  # the harness handed back the run's token: the tests ran to their end
    stdout: str = ""


def run_behind(fence: Isolation, code: str, tests: str, limits: Limits) -> SandboxResult:
    """Run ``code``, then ``tests`` in its namespace, behind ``fence``; raises when the sandbox could not start
    (the worker's fault, not the code's)."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as tmp:
        folder = Path(tmp).resolve()
        # errors="replace": a lone surrogate in model output must fail the test, not this process.
        (folder / "main.py").write_text(f"{code}\n", encoding="utf-8", errors="replace")
        # Stage 2 reads and removes the tests before the program starts; 0600: a per-run uid cannot read them first.
        (folder / "tests.py").touch(mode=0o600)
        (folder / "tests.py").write_text(f"{tests}\n", encoding="utf-8", errors="replace")
        (folder / "harness").touch(mode=0o600)  # the same: its code, compiled once per worker, read by stage 2
        (folder / "harness").write_bytes(_harness_code())
        start = time.monotonic()
        outcome = _run(fence, folder, limits)
        seconds = time.monotonic() - start
    return SandboxResult(*_verdict(outcome, limits), seconds, outcome.stdout)


def _run(fence: Isolation, folder: Path, limits: Limits) -> _Outcome:
    """Run ``folder/main.py`` behind ``fence``; raises when the program could not be started.

    stdout and stderr go to files in ``folder`` (bounded by ``RLIMIT_FSIZE``); both are read back through the
    descriptors opened here, never by name: under the ``rlimits`` fence the program owns the folder and could put a
    FIFO or a link in the file's place.
    """
    uid = _run_uid() if fence.per_run_uid else None
    private_root = bool(fence.namespaces)
    if uid is not None and not private_root:  # the program runs in the host folder, as that uid
        os.chown(folder, uid, uid)
        os.chown(folder / "main.py", uid, uid)
    nproc = uid is not None or "user" in fence.namespaces  # a budget of this run's own
    report_read, report_write = os.pipe()
    config = _stage2_config(folder, limits.rlimits(nproc), uid, private_root, report_write)
    try:
        with (folder / "stdout").open("w+b") as out, (folder / "stderr").open("w+b") as err:
            timed_out = _launch(fence.launcher, config, report_write, (out.fileno(), err.fileno()), limits.wall_s)
            report = _read_report(report_read)
            stderr, stdout = _tail(err.fileno()), _tail(out.fileno())
    finally:
        os.close(report_read)
        if uid is not None and not private_root:
            _sweep(uid)
    return dataclasses.replace(_outcome(fence, report, timed_out, stderr), stdout=stdout)


def _launch(
    launcher: tuple[str, ...], config: dict[str, object], report_fd: int, outputs: tuple[int, int], wall_s: float
) -> bool:
    """Start stage 2 behind ``launcher``, wait up to ``wall_s``, kill its process group, reap; True when it timed out.

    No ``preexec_fn``: everything between fork and exec happens in ``setpriv`` and stage 2, never in this
    (threaded) process.
    """
    try:
        proc = subprocess.Popen(
            [*launcher, sys.executable, "-I", "-S", str(SUPERVISOR), marshal.dumps(config).hex()],
            cwd="/",
            env={"PATH": os.environ.get("PATH", os.defpath)},
            stdin=subprocess.DEVNULL,
            stdout=outputs[0],
            stderr=outputs[1],
            start_new_session=True,
            pass_fds=(report_fd,),
        )
    finally:
        os.close(report_fd)  # stage 2 holds the only write end now
    try:
        return _wait(proc, wall_s)
    finally:  # also on KeyboardInterrupt: never leave the group running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _reap(proc)


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


def _reap(proc: subprocess.Popen[bytes]) -> None:
    _, status = os.waitpid(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # tell Popen it is reaped


def _read_report(fd: int) -> dict[str, str]:
    """Stage 2's report, ``{word: rest of line}``: ``ready`` (written before the program may exec), then
    ``exit <wait status> <CPU s> <1 when the tests ran to their end, else 0>``; ``error ...`` when something failed
    before the program ran.

    Read once the launcher is reaped: every writer is gone by then (the program never had the pipe), so whatever
    is not in the pipe now never will be.
    """
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    lines = data.decode("utf-8", errors="replace").splitlines()
    return {word: rest for word, _, rest in (line.partition(" ") for line in lines)}


def _outcome(fence: Isolation, report: dict[str, str], timed_out: bool, stderr: str) -> _Outcome:
    """How the program ended; raises when it never ran (its stderr then holds only the launcher's words)."""
    if "ready" not in report or "error" in report:
        detail = report.get("error") or stderr.strip()[-500:] or "no report"
        late = " within the wall-clock limit" if timed_out else ""
        raise RuntimeError(f"the sandbox did not start{late} ({fence.fence}): {detail}")
    if "exit" not in report:  # its init was killed: the wall clock, or a program that killed its launcher
        return _Outcome(timed_out, None, 0.0, stderr)
    status, cpu, tested = report["exit"].split()
    return _Outcome(timed_out, os.waitstatus_to_exitcode(int(status)), float(cpu), stderr, tested == "1")


def _verdict(outcome: _Outcome, limits: Limits) -> tuple[bool, str]:
    """``(passed, reason)`` from how the program ended: passed only when its tests ran to the end and it exited 0."""
    returncode, stderr = outcome.returncode, outcome.stderr
    if outcome.timed_out:
        return False, f"timeout: wall-clock limit of {limits.wall_s} s exceeded"
    if returncode is None:
        return False, "failed: the sandbox was killed before the program ended"
    if returncode == 0:
        if outcome.tests_passed:
            return True, "passed"
        return False, "failed: exit status 0 before the tests had run to their end (the program exited early)"
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and outcome.cpu_used >= limits.cpu_s):
        return False, f"timeout: CPU-time limit of {limits.cpu_s} s exceeded ({outcome.cpu_used:.2f} s used)"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return False, f"memory: limit of {limits.memory_mb} MiB exceeded"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:  # Python ignores SIGXFSZ: EFBIG instead
        return False, f"output: file-size limit of {MAX_FILE_BYTES} bytes exceeded"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else "(no stderr)"
    return False, f"failed: exit status {returncode}: {last}"


def _tail(fd: int) -> str:
    """The last few KiB of an open file as text (enough for a traceback's final line)."""
    size = os.fstat(fd).st_size
    return os.pread(fd, _TAIL_BYTES, max(0, size - _TAIL_BYTES)).decode("utf-8", errors="replace")


def _run_uid() -> int:
    """A uid for one run of a root worker: unique among this process's concurrent runs, distinct across workers
    (by pid) but for a rare collision, which would only share an ``RLIMIT_NPROC`` budget. It owns no file."""
    return UID_BASE + (os.getpid() % 4096) * 4096 + next(_RUN_COUNTER) % 4096


def _sweep(uid: int) -> None:
    """``rlimits`` fence, root worker: kill every process of the run's uid, strays that left the process group too
    (``kill(-1)`` as that uid reaches exactly its processes, the caller aside)."""
    subprocess.run(
        [
            tool("setpriv"),
            "--reuid",
            str(uid),
            "--regid",
            str(uid),
            "--clear-groups",
            "--",
            sys.executable,
            "-I",
            "-S",
            "-c",
            "import os, contextlib\nwith contextlib.suppress(OSError): os.kill(-1, 9)",
        ],
        env={},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=30,
        check=False,
    )


# --------------------------------------------------------------------------- stage 2's configuration


def _stage2_config(
    folder: Path, rlimits: list[tuple[int, int, int]], uid: int | None, private_root: bool, report_fd: int
) -> dict[str, object]:
    """Everything stage 2 needs, marshalled onto its command line (the same interpreter reads it; ``json`` would
    import ``re``, a few milliseconds of every run)."""
    read_only, links = _visible_paths()
    return {
        "folder": str(folder),
        "python": sys.executable,
        "site": _site_packages(),
        "path": os.environ.get("PATH", os.defpath),
        "uid": uid,
        "rlimits": rlimits,
        "report_fd": report_fd,
        "private_root": private_root,
        "read_only": read_only,
        "devices": [path for path in _DEVICES if os.path.exists(path)],
        "links": links,
        "scratch": f"size={SCRATCH_BYTES},nr_inodes={SCRATCH_INODES},mode=755",
    }


@functools.cache
def _visible_paths() -> tuple[list[str], list[tuple[str, str]]]:
    """``(read-only binds, symlinks)`` of the private root: the system's ``/usr`` (and the host's ``/bin``, ``/lib*``,
    ``/sbin``, links on a merged-usr system), this interpreter's prefixes (a venv and its base), two files of
    ``/etc`` the loader and ``time`` read. A prefix below one already bound is not bound again."""
    binds: list[str] = []
    links: list[tuple[str, str]] = list(_DEVICE_LINKS)
    for top in ("/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin", "/usr"):
        if os.path.islink(top):
            links.append((top, os.readlink(top)))
        elif os.path.isdir(top):
            binds.append(top)
    prefixes = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    for prefix in sorted(os.path.abspath(p) for p in prefixes):
        if not any(prefix == bound or prefix.startswith(bound + "/") for bound in binds):
            binds.append(prefix)
    binds += [path for path in _SYSTEM_FILES if os.path.exists(path)]
    return binds, links


@functools.cache
def _site_packages() -> list[str]:
    """This interpreter's site-packages folders, which the test runner (started without ``site``) puts on its path."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths["purelib"], paths["platlib"]) if os.path.isdir(p)))


@functools.cache
def _harness_code() -> bytes:
    """The harness, compiled once (``marshal``: the sandbox runs this same interpreter): compiling its text costs
    each of a run's two interpreters milliseconds. Stage 2 hands it to both on a pipe (the file is not inside the
    private root); docstrings are left out (``optimize=2``; the harness has no ``assert``)."""
    return marshal.dumps(compile(HARNESS.read_text(encoding="utf-8"), "harness.py", "exec", optimize=2))
