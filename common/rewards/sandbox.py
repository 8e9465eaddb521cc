"""Run untrusted Python (a model's program plus its tests) behind the strongest fence this machine allows.

Each call writes the program to ``main.py`` and the tests to ``tests.py`` in a fresh temporary folder and runs the
test harness (:data:`_HARNESS`) under ``python -I`` (isolated mode: no ``PYTHON*`` variables, no user site-packages)
with an environment of only ``PATH`` and ``HOME``. The process tree::

    worker thread
      setpriv --pdeathsig KILL            the worker dies -> this dies (a new session: one process group)
        unshare ... --fork --kill-child   only with namespaces; it dies -> the namespace's init dies
          stage 2 (python -I -S)          init of the PID namespace: builds the private root, forks, waits,
                                          reports on a pipe (ready / exit status, CPU seconds, tests passed)
            python -I -c <harness>        the untrusted program, then its tests, with the limits below

Which fence runs is decided once per process (:func:`isolation`, logged at first use); the strongest that starts:

``namespaces`` (the worker is root, e.g. in CI): new PID, network, mount, IPC and UTS namespaces; the program runs as a
    per-run unprivileged uid (:data:`UID_BASE` and up, its own ``RLIMIT_NPROC`` budget) with no capabilities and
    ``no_new_privs``. A user namespace is not used: it would give nothing an unprivileged uid does not already have.
``user-namespaces`` (the worker is not root, or root may not create namespaces without one): the same namespaces
    plus a user namespace (``unshare --user --map-root-user``); the program is root inside it, the worker's uid
    outside, with no capabilities. ``RLIMIT_NPROC`` then counts the processes of that user namespace only — but not
    when the worker is the host's root, whom ``RLIMIT_NPROC`` never binds: the fork bomb is then unbounded.
``rlimits`` (no namespaces at all, e.g. a container without ``CAP_SYS_ADMIN`` and without user namespaces): only
    the resource limits, a process group, the parent-death signal, and — when the worker is root — the per-run uid
    (so ``RLIMIT_NPROC`` holds and every process of that uid is killed after the run). The program sees the host's
    network (loopback included) and every file its uid may read. The program's children outlive a worker that dies
    (one that lives kills the process group and, when root, every process of the per-run uid). A root worker whose
    interpreter a per-run uid cannot reach (e.g. one under ``/root``) runs the program as root, with no capabilities:
    the last resort, which may signal every process of root, the worker too.

Without user namespaces a root worker still runs the ``namespaces`` fence; any other worker runs ``rlimits``.

Isolated under both namespace fences:

- processes: only its own are visible (a fresh ``/proc``): the worker and every other process of the host cannot be
  signalled, traced or read (``/proc/<pid>/environ``); its parent (``os.getppid()``, 1) is the namespace's init,
  which ignores every signal sent from inside, holds no capability once the program runs, and is not dumpable (so
  not traceable, its ``/proc`` entries closed);
- network: none, not even loopback (a new network namespace has only a ``lo`` that is down);
- filesystem: a private ``tmpfs`` root (``SCRATCH_BYTES``, ``SCRATCH_INODES``) holding the working folder
  ``/sandbox`` (also ``HOME``), ``/tmp`` and ``/dev/shm``, the rest of it read-only; read-only binds of ``/usr`` (with
  the host's ``/bin``, ``/lib*``, ``/sbin`` links), the interpreter's prefixes (the venv and its base Python),
  ``/etc/ld.so.cache`` and ``/etc/localtime``; ``/dev/null``, ``zero``, ``full``, ``random``, ``urandom``. Everything
  else — ``/root``, ``/home``, the run folder, the repository, ``/sys``, other temporary files — is not there;
- resources: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NOFILE``, ``RLIMIT_FSIZE`` (which also bounds stdout/stderr: they
  go to files in the host folder, never into this process's memory), ``RLIMIT_NPROC`` (:data:`MAX_PROCESSES`,
  threads included; not for the host's root, see above), no core dumps;
- lifetime: killing the namespace's init kills everything in it. That happens when the program exits, at the
  wall-clock limit (the whole process group is killed), and when the worker dies (``setpriv --pdeathsig`` ends
  ``unshare``, whose ``--kill-child`` ends the init: the program can clear neither). The parent-death signal follows
  the *thread* that started the run; :func:`run_python_tests` blocks that thread until the run has ended.

Not isolated, under any fence: the kernel (no seccomp filter: a kernel exploit escapes); the files of the read-only
binds above (nothing secret, but readable); the clock; the host's CPU and memory beyond the limits — ``RLIMIT_AS`` is
per process, so a run holds at most ``MAX_PROCESSES`` x ``memory_mb`` of memory (no cgroup bounds the sum), and
``cpu_s`` bounds each process's CPU time, ``wall_s`` the whole run. A fence for one untrusted program, not a VM.

The verdict: the tests decide, never the program's exit status. Stage 2 draws a random token per run and hands it,
with the tests, to the harness on a pipe once the program's process has exec'd; the harness runs the program, then
the tests, and writes the token back on a second pipe only after the tests' last statement has run, then exits at
once (``os._exit(0)``). A run passes when the token came back and the process exited with status 0. So exiting early
(``sys.exit()``, ``raise SystemExit(0)``, ``os._exit(0)``, in a ``finally``, an ``atexit`` handler, a signal), killing
itself or its parent, forking a child to carry on, printing or writing anything to any descriptor, rebinding
``AssertionError`` or the builtins (an ``assert`` raises the real ``AssertionError``: CPython 3.9+ loads it directly)
or a trace or profile function left to skip the tests' lines (cleared before the tests) all score 0. The tests are
never in the program's folder, and ``python -O`` does not apply to them (compiled with ``optimize=0``).

Not prevented — the program and the tests share one interpreter, as they must (the tests call the program's
functions and read its objects), and nothing in an interpreter is private from code running in it: a program that
reads the harness's own state — the frames below its own (``sys._getframe``, a signal handler's frame, a
traceback), the garbage collector's objects, or raw memory through ``ctypes`` — can find the token and its
descriptor, and one that rewrites a running frame can skip a test. Nor a program that meets the tests' checks
dishonestly: an object whose ``__eq__`` always says yes, or a name the tests call rebound in the namespace they share.
Tests should compare plain values (``type(x) is int and x == 5``). The defence is against a program that ends or
fakes its run, not against one written against this harness.
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
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from asyncrl.common.observability.logs import get_logger

log = get_logger("sandbox")

MAX_OPEN_FILES = 64
MAX_FILE_BYTES = 8 * 2**20
MAX_PROCESSES = 32  # RLIMIT_NPROC: tasks of the run's uid, threads included (and x memory_mb: a run's memory bound)
SCRATCH_BYTES = 64 * 2**20  # the private tmpfs: working folder, /tmp and /dev/shm together
SCRATCH_INODES = 4096
UID_BASE = 2_000_000_000  # per-run uids (root workers): far above any real account
_TAIL_BYTES = 2000
_POLL_S = 0.01
_PROBE_WALL_S = 30.0  # detection must not mistake a loaded machine for a refusal
_NAMESPACE_NAMES = ("pid", "net", "mount", "ipc", "uts")
_NAMESPACES = ("--pid", "--net", "--mount", "--ipc", "--uts", "--fork", "--kill-child")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_DEVICE_LINKS = (("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"),
                 ("/dev/stdout", "/proc/self/fd/1"), ("/dev/stderr", "/proc/self/fd/2"))
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")


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
class Isolation:
    """Which fence runs untrusted code on this machine (the module docstring says what each one isolates).

    ``fence`` is ``namespaces``, ``user-namespaces`` or ``rlimits``; ``launcher`` the command that precedes the
    stage-2 interpreter; ``per_run_uid`` whether the program runs as a uid of its own (root workers only);
    ``refused`` why each stronger fence did not start here (empty for the strongest).
    """

    fence: str
    namespaces: tuple[str, ...]
    user: str
    processes: str
    launcher: tuple[str, ...]
    per_run_uid: bool
    refused: str = ""


_ISOLATION: Isolation | None = None  # detected at the first run
_DETECT_LOCK = threading.Lock()
_RUN_COUNTER = itertools.count()


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
    """Run ``code``, then ``tests`` in its namespace; it passes when the tests' last statement has run.

    The program's exit status alone never passes a run: exiting before the tests end (with any status) fails it
    (the module docstring says how, and what a program can still do).

    The script is killed when it uses ``cpu_s`` CPU seconds (rounded up to whole seconds), ``memory_mb``
    MiB of address space (an allocation beyond it fails with ``MemoryError``), or ``wall_s`` seconds of
    wall-clock time. A sandbox that cannot start raises (that is the worker's fault, not the code's).
    """
    return _run_python_tests(isolation(), code, tests, _Limits(cpu_s, memory_mb, wall_s))


def run_python(code: str, *, cpu_s: float = 2, memory_mb: int = 256, wall_s: float = 5) -> SandboxResult:
    """Run ``code`` alone (a tool call's program) behind the same fence and limits as :func:`run_python_tests`;
    ``passed`` when it ran to its end, ``stdout`` what it printed."""
    return run_python_tests(code, "pass", cpu_s=cpu_s, memory_mb=memory_mb, wall_s=wall_s)


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class _Limits:
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


def _run_python_tests(fence: Isolation, code: str, tests: str, limits: _Limits) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as tmp:
        folder = Path(tmp).resolve()
        # errors="replace": a lone surrogate in model output must fail the test, not this process.
        (folder / "main.py").write_text(f"{code}\n", encoding="utf-8", errors="replace")
        # Stage 2 reads and removes the tests before the program starts; 0600: a per-run uid cannot read them first.
        (folder / "tests.py").touch(mode=0o600)
        (folder / "tests.py").write_text(f"{tests}\n", encoding="utf-8", errors="replace")
        start = time.monotonic()
        outcome = _run(fence, folder, limits)
        seconds = time.monotonic() - start
    return SandboxResult(*_verdict(outcome, limits), seconds, outcome.stdout)


def _run(fence: Isolation, folder: Path, limits: _Limits) -> _Outcome:
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


def _launch(launcher: tuple[str, ...], config: dict[str, object], report_fd: int, outputs: tuple[int, int],
            wall_s: float) -> bool:
    """Start stage 2 behind ``launcher``, wait up to ``wall_s``, kill its process group, reap; True when it timed out.

    No ``preexec_fn``: everything between fork and exec happens in ``setpriv`` and stage 2, never in this
    (threaded) process.
    """
    try:
        proc = subprocess.Popen(
            [*launcher, sys.executable, "-I", "-S", "-c", _STAGE2, marshal.dumps(config).hex()],
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


def _verdict(outcome: _Outcome, limits: _Limits) -> tuple[bool, str]:
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
        [_tool("setpriv"), "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--",
         sys.executable, "-I", "-S", "-c", "import os, contextlib\nwith contextlib.suppress(OSError): os.kill(-1, 9)"],
        env={}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
        check=False,
    )


# --------------------------------------------------------------------------- stage 2


def _stage2_config(folder: Path, rlimits: list[tuple[int, int, int]], uid: int | None, private_root: bool,
                   report_fd: int) -> dict[str, object]:
    """Everything stage 2 needs, marshalled onto its command line (the same interpreter reads it; ``json`` would
    import ``re``, a few milliseconds of every run)."""
    read_only, links = _visible_paths()
    return {
        "folder": str(folder),
        "python": sys.executable,
        "harness": _HARNESS,
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


# Stage 2 runs in a bare interpreter (``python -I -S``: this project is not importable there, and importing it would
# slow every run), so it is source text. Between namespaces it is the PID namespace's init; it never runs the
# program's code itself, holds no capability once the program runs, and writes its report to ``report_fd``, which
# the program never holds (close-on-exec). It alone knows the run's token until the harness has started.
_STAGE2 = r'''
import ctypes, marshal, os, resource, sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 262144
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, MNT_DETACH = 1, 4, 24, 38, 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4


def call(what, function, *args):
    if function(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source, target, flags, fstype="none", data=""):
    call(f"mount {target}", libc.mount, source.encode(), target.encode(), fstype.encode(), flags, data.encode())


def bind(source, target, read_only):
    """Bind without MS_REC (mounts below the source stay hidden), then remount nosuid, read-only if asked."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    mount(source, target, MS_BIND)
    kept = os.statvfs(target).f_flag & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)  # maybe locked: keep them
    mount("none", target, MS_REMOUNT | MS_BIND | MS_NOSUID | kept | (MS_RDONLY | MS_NODEV if read_only else 0))


def take_tests(cfg):
    """The run's token (33 bytes: 32 hex digits and a newline, what the harness reads first) and the tests, read
    and removed from the host folder before the program can look there."""
    path = cfg["folder"] + "/tests.py"
    with open(path, "rb") as f:
        tests = f.read()
    os.unlink(path)
    return os.urandom(16).hex().encode() + b"\n", tests


def enter_private_root(cfg):
    """A tmpfs over the host folder, filled, made the root (the old one detached), then read-only but 3 folders."""
    new, uid = cfg["folder"], cfg["uid"]
    with open(new + "/main.py", "rb") as f:
        program = f.read()
    mount("none", "/", MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    mount("tmpfs", new, MS_NOSUID | MS_NODEV, "tmpfs", cfg["scratch"])
    for path in cfg["read_only"]:
        bind(path, new + path, read_only=True)
    for path in cfg["devices"]:
        bind(path, new + path, read_only=False)
    for link, target in cfg["links"]:
        os.makedirs(os.path.dirname(new + link), exist_ok=True)
        os.symlink(target, new + link)
    for path, mode in (("/sandbox", 0o700), ("/tmp", 0o1777), ("/dev/shm", 0o1777), ("/proc", 0o555)):
        os.makedirs(new + path, exist_ok=True)
        os.chmod(new + path, mode)
    with open(new + "/sandbox/main.py", "wb") as f:
        f.write(program)
    if uid is not None:
        os.chown(new + "/sandbox", uid, uid)
    mount("proc", new + "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "proc")  # this PID namespace's processes only
    os.chdir(new)
    call("pivot_root", libc.syscall, ctypes.c_long(SYS_PIVOT_ROOT[os.uname().machine]), b".", b".")
    call("detach the old root", libc.umount2, b".", MNT_DETACH)
    os.chdir("/")
    for path in ("/sandbox", "/tmp", "/dev/shm"):
        # writable mounts of their own before / turns read-only; MS_REC keeps the binds below them (a venv in /tmp)
        mount(path, path, MS_BIND | MS_REC)
    mount("none", "/", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_privileges(cfg, parent):
    """In the program's process before its exec: limits, no capability ever again, the run's uid."""
    for kind, soft, hard in cfg["rlimits"]:
        resource.setrlimit(kind, (soft, hard))
    for cap in range(64):  # the bounding set; stops at the last cap, or at once without CAP_SETPCAP (none to drop)
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    call("no_new_privs", libc.prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    call("pdeathsig", libc.prctl, PR_SET_PDEATHSIG, 9, 0, 0, 0)  # after setresuid, which clears it
    if os.getppid() != parent:
        raise RuntimeError("stage 2 ended before the program started")


def drop_capabilities():
    """Stage 2 needs none once the program runs: capset(2) with every set empty (header version 3)."""
    call("capset", libc.capset, (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())


def spawn(cfg, cwd, report, feed):
    """Fork the program's process; it execs only once this one holds no capability and has reported ``ready``, so
    the program never meets a privileged parent. Once it has exec'd, hand its harness ``feed`` (the token, then the
    tests) and return ``(pid, verdict pipe)``; raises if it could not start."""
    parent = os.getpid()
    go_read, go_write = os.pipe()
    errors_read, errors_write = os.pipe()  # close-on-exec: EOF without a word once the exec succeeded
    feed_read, feed_write = os.pipe()
    verdict_read, verdict_write = os.pipe()  # the token comes back here once the tests have run to their end
    child = os.fork()
    if child == 0:
        try:
            for fd in (go_write, errors_read, feed_write, verdict_read):
                os.close(fd)
            os.chdir(cwd)
            drop_privileges(cfg, parent)
            if os.read(go_read, 1) != b"g":
                raise RuntimeError("stage 2 ended before the program started")
            os.set_inheritable(feed_read, True)
            os.set_inheritable(verdict_write, True)
            argv = [cfg["python"], "-I", "-c", cfg["harness"], str(feed_read), str(verdict_write)]
            os.execve(cfg["python"], argv, {"PATH": cfg["path"], "HOME": cwd})
        except BaseException as error:
            os.write(errors_write, f"{type(error).__name__}: {error}".encode())
        finally:
            os._exit(127)
    for fd in (go_read, errors_write, feed_read, verdict_write):
        os.close(fd)
    drop_capabilities()
    os.write(report, b"ready\n")  # a worker that died closed the other end: BrokenPipeError ends it all
    os.write(go_write, b"g")
    os.close(go_write)
    with os.fdopen(errors_read, "rb") as errors:
        message = errors.read().decode(errors="replace")
    if message:
        os.waitpid(child, 0)
        raise RuntimeError(message)
    try:  # the harness reads it all before the program runs; one that died unread is a failed run, not an error
        view = memoryview(feed)
        while view:
            view = view[os.write(feed_write, view):]
    except BrokenPipeError:
        pass
    os.close(feed_write)
    return child, verdict_read


def reap(child):
    """Wait for the program, reaping orphans of the namespace on the way: ``(wait status, CPU seconds)``."""
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == child:
            return status, usage.ru_utime + usage.ru_stime


def tests_passed(verdict, token):
    """Whether the pipe holds the token and nothing else (a forked copy of a passing run may add it again). Read
    without waiting: a stray the program left may still hold the write end, and what it writes later is too late."""
    os.set_blocking(verdict, False)
    try:
        data = os.read(verdict, 4096)
    except BlockingIOError:
        return False
    return bool(data) and data == token * (len(data) // len(token))


def main(cfg):
    report = cfg["report_fd"]
    os.set_inheritable(report, False)
    try:
        token, tests = take_tests(cfg)
        if cfg["private_root"]:
            enter_private_root(cfg)
        call("not dumpable", libc.prctl, PR_SET_DUMPABLE, 0, 0, 0, 0)  # nor traceable, nor its /proc readable
        child, verdict = spawn(cfg, "/sandbox" if cfg["private_root"] else cfg["folder"], report, token + tests)
    except Exception as error:
        os.write(report, f"error {type(error).__name__}: {error}\n".encode())
        return 125
    status, cpu = reap(child)
    os.write(report, f"exit {status} {cpu:.3f} {int(tests_passed(verdict, token))}\n".encode())
    return 0


sys.exit(main(marshal.loads(bytes.fromhex(sys.argv[1]))))
'''


# The program's process runs this (``python -I -c``) with the two pipes' descriptors as its arguments: it reads the
# token and the tests, closes that pipe, then runs the program and the tests as one ``__main__`` module. Everything it
# uses once the program has run is bound beforehand (the program may rebind any global, builtin or module attribute),
# and the token is written only on the path where the tests' code returned; every other way out (an exception,
# ``SystemExit``, ``os._exit``, a signal, ``atexit``) leaves without it. Then ``os._exit(0)``: no ``atexit`` handler,
# finaliser or non-daemon thread of the program runs after the token.
_HARNESS = r"""
import os, sys


def harness(feed, verdict):
    data = bytearray()
    while chunk := os.read(feed, 65536):
        data += chunk
    os.close(feed)
    token, tests = bytes(data[:33]), bytes(data[33:])
    with open("main.py", "rb") as f:
        program = compile(f.read(), os.path.abspath("main.py"), "exec", dont_inherit=True, optimize=0)
    checks = compile(tests, "tests.py", "exec", dont_inherit=True, optimize=0)
    run, write, leave, settrace, setprofile = exec, os.write, os._exit, sys.settrace, sys.setprofile
    monitoring = getattr(sys, "monitoring", None)  # 3.12+: callbacks the program may have left on every line
    get_tool, set_events = (monitoring.get_tool, monitoring.set_events) if monitoring else (None, None)
    tools = tuple(range(6)) if monitoring else ()
    streams = (sys.stdout, sys.stderr)
    module = type(sys)("__main__")
    module.__file__ = program.co_filename
    namespace = module.__dict__
    sys.modules["__main__"], sys.argv[:] = module, ["main.py"]
    run(program, namespace)
    settrace(None)
    setprofile(None)
    for tool in tools:
        if get_tool(tool) is not None:
            set_events(tool, 0)
    run(checks, namespace)
    for stream in streams:  # output beyond its limit fails the run here, before the token
        stream.flush()
    write(verdict, token)
    leave(0)


harness(int(sys.argv[1]), int(sys.argv[2]))
"""


# --------------------------------------------------------------------------- which fence


def _tool(name: str) -> str:
    found = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if found is None:
        raise RuntimeError(f"the sandbox needs {name} from util-linux: install it (apt-get install util-linux)")
    return found


def _candidates() -> list[Isolation]:
    """The fences to try, strongest first (the module docstring compares them).

    A root worker tries ``rlimits`` twice: as a per-run uid, which cannot start when the interpreter lies where
    only root may look (e.g. under ``/root``), then as root itself — the last resort, and said so.
    """
    root = os.geteuid() == 0
    base = (_tool("setpriv"), "--pdeathsig", "KILL", "--")
    unshare = (_tool("unshare"), *_NAMESPACES, "--")
    per_run, own_budget = f"a per-run uid ({UID_BASE} and up), no capabilities", f"RLIMIT_NPROC {MAX_PROCESSES}"
    user_namespaces = Isolation(
        "user-namespaces", ("user", *_NAMESPACE_NAMES), "the worker's uid, root in its user namespace, no capabilities",
        "not limited: RLIMIT_NPROC never binds the host's root" if root else f"{own_budget} in its user namespace",
        (*base, unshare[0], "--user", "--map-root-user", *unshare[1:]), per_run_uid=False,
    )
    worker_uid = Isolation(
        "rlimits", (), "the worker's uid" + (" (root)" if root else ""),
        "not limited: RLIMIT_NPROC would count the worker's own processes", base, per_run_uid=False,
    )
    if not root:
        return [user_namespaces, worker_uid]
    return [
        Isolation("namespaces", _NAMESPACE_NAMES, per_run, f"{own_budget} for that uid", (*base, *unshare), True),
        user_namespaces,
        Isolation("rlimits", (), per_run, f"{own_budget} for that uid", base, per_run_uid=True),
        worker_uid,
    ]


def _detect() -> Isolation:
    """The first candidate that runs a trivial program; the refusals of the stronger ones are kept in ``refused``."""
    refused: list[str] = []
    for fence in _candidates():
        try:
            result = _run_python_tests(fence, "", "", _Limits(cpu_s=10, memory_mb=512, wall_s=_PROBE_WALL_S))
        except RuntimeError as error:
            refused.append(f"{fence.fence}: {error}")
            continue
        if result.passed:
            return replace(fence, refused="; ".join(refused))
        refused.append(f"{fence.fence}: the probe {result.reason}")
    raise RuntimeError("the sandbox cannot start on this machine: " + "; ".join(refused))


def _log_isolation(fence: Isolation) -> None:
    fields = {"fence": fence.fence, "namespaces": ",".join(fence.namespaces) or "none", "user": fence.user,
              "processes": fence.processes}
    if not fence.refused:
        log.info("sandbox isolation", **fields)
        return
    log.warning("sandbox runs behind a weaker fence", **fields, refused=fence.refused,
                action="let the reward worker create namespaces (root with CAP_SYS_ADMIN, or user namespaces "
                "enabled: sysctl user.max_user_namespaces), or keep secrets and services out of its reach")
