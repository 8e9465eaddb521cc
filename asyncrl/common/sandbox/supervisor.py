"""Stage 2 of the code sandbox: the supervisor of one run, started by path (``python -I -S <this file> <config>``).

The worker (:mod:`asyncrl.common.sandbox.run`) starts this file behind the fence's launcher with one argument,
the run's configuration (a ``marshal``-ed dict, hex). Behind a namespace fence it is the PID namespace's init: it reads
and removes the tests and the harness's compiled code, builds the private root, forks the run's two processes (limits,
no capability, the run's uid, then ``exec`` of :data:`BOOT`, which runs the harness's code handed on a pipe,
:mod:`asyncrl.common.sandbox.harness`): the test runner and the program server. The program runs only once the
runner has made itself non-dumpable and said so; the runner then gets the run's token and the tests. This process
waits for the runner and writes its report on the pipe ``report_fd``: ``ready`` before either may exec, then ``exit
<wait status> <CPU s> <1 when the tests ran to their end, else 0>`` — the program's status when it ended before the
tests did (it then says why), else the runner's — or ``error ...`` when they never ran. It never runs the program's
code itself, holds no capability once they run, and neither holds the report pipe (close-on-exec). It and the runner
alone know the run's token.

Rule: this file imports the standard library only. It runs in a bare interpreter (``-I -S``: no site-packages, no
``PYTHON*`` variables, not its own folder on ``sys.path``) where asyncrl is not importable, and importing it would slow
every run (``tests/integration/common/sandbox/test_sandbox.py`` parses the imports to hold this); for the same reason
its annotations name builtins only (``typing`` alone costs milliseconds of every run).
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 262144
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, MNT_DETACH = 1, 4, 24, 38, 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
BOOT = (
    "import marshal, os, sys\nfd, code = int(sys.argv.pop(1)), b''\n"
    "while chunk := os.read(fd, 65536):\n    code += chunk\nos.close(fd)\nexec(marshal.loads(code))\n"
)
"""What each of the run's interpreters runs first: the harness's code, read from the pipe its first argument names."""
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4


def call(what: str, function: ctypes._NamedFuncPointer, *args: object) -> None:
    """``function(*args)``, a libc call that returns 0 on success; raises ``OSError`` with ``what`` otherwise.
    (``_NamedFuncPointer`` is typeshed's name for a function of a ``CDLL``; annotations are never evaluated here.)"""
    if function(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str, target: str, flags: int, fstype: str = "none", data: str = "") -> None:
    call(f"mount {target}", libc.mount, source.encode(), target.encode(), fstype.encode(), flags, data.encode())


def bind(source: str, target: str, read_only: bool) -> None:
    """Bind without MS_REC (mounts below the source stay hidden), then remount nosuid, read-only if asked."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    mount(source, target, MS_BIND)
    kept = os.statvfs(target).f_flag & (MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)  # maybe locked: keep them
    mount("none", target, MS_REMOUNT | MS_BIND | MS_NOSUID | kept | (MS_RDONLY | MS_NODEV if read_only else 0))


def take_tests(cfg: dict) -> tuple[bytes, bytes, bytes]:
    """The run's token (33 bytes: 32 hex digits and a newline, what the runner reads first), the tests and the
    harness's code, read and removed from the host folder before the program can look there."""
    found = []
    for name in ("tests.py", "harness"):
        with open(cfg["folder"] + "/" + name, "rb") as f:
            found.append(f.read())
        os.unlink(cfg["folder"] + "/" + name)
    return os.urandom(16).hex().encode() + b"\n", *found


def enter_private_root(cfg: dict) -> None:
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


def drop_privileges(cfg: dict, parent: int) -> None:
    """In each of the run's processes before its exec: limits, no capability ever again, the run's uid."""
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


def drop_capabilities() -> None:
    """Stage 2 needs none once the program runs: capset(2) with every set empty (header version 3)."""
    call("capset", libc.capset, (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())


def start(cfg: dict, cwd: str, parent: int, role: str, fds: tuple[int, ...]) -> tuple[int, int, int, int]:
    """Fork one process of the run, which execs the harness as ``role`` with ``fds`` once told to (:func:`release`);
    ``(pid, go pipe, errors pipe, code pipe)``. Every other descriptor of this process is close-on-exec."""
    go_read, go_write = os.pipe()
    errors_read, errors_write = os.pipe()  # close-on-exec: EOF without a word once the exec succeeded
    code_read, code_write = os.pipe()  # the harness's code, read by BOOT
    child = os.fork()
    if child == 0:
        try:
            os.chdir(cwd)
            drop_privileges(cfg, parent)
            if os.read(go_read, 1) != b"g":
                raise RuntimeError("stage 2 ended before the program started")
            for fd in (code_read, *fds):
                os.set_inheritable(fd, True)
            flags, extra = (["-I", "-S"], cfg["site"]) if role == "runner" else (["-I"], [])
            argv = [cfg["python"], *flags, "-c", BOOT, str(code_read), role, *map(str, fds), *extra]
            os.execve(cfg["python"], argv, {"PATH": cfg["path"], "HOME": cwd})
        except BaseException as error:
            os.write(errors_write, f"{type(error).__name__}: {error}".encode())
        finally:
            os._exit(127)
    for fd in (go_read, errors_write, code_read):
        os.close(fd)
    return child, go_write, errors_read, code_write


def release(started: tuple[int, int, int, int]) -> None:
    """Let a process of :func:`start` exec; raises with its error when it could not."""
    child, go_write, errors_read, _ = started
    os.write(go_write, b"g")
    os.close(go_write)
    with os.fdopen(errors_read, "rb") as errors:
        message = errors.read().decode(errors="replace")
    if message:
        os.waitpid(child, 0)
        raise RuntimeError(message)


def hand(fd: int, data: bytes) -> None:
    """Write ``data`` and close; a reader that died unread is a failed run, not an error."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:
        pass
    os.close(fd)


def spawn(cfg: dict, cwd: str, report: int, feed: bytes, code: bytes) -> tuple[int, int, int, int]:
    """Start the test runner and the program server (``harness.py``): both exec only once this process holds
    no capability and has reported ``ready``, so the program never meets a privileged parent. The program runs only
    once the runner has made itself non-dumpable and said so (``r`` on the verdict pipe); the runner then gets
    ``feed`` (the token, then the tests). ``(runner pid, server pid, verdict pipe, watch pipe)``; raises if either
    could not start."""
    parent = os.getpid()
    feed_read, feed_write = os.pipe()
    verdict_read, verdict_write = os.pipe()  # "r" when the runner is unreachable; the token when the tests ended
    calls_read, calls_write = os.pipe()  # runner -> server
    replies_read, replies_write = os.pipe()  # server -> runner
    go_read, go_write = os.pipe()  # the program runs once this says so
    watch_read, watch_write = os.pipe()  # closed once the server is reaped: its strays may hold its pipes open
    runner_fds = (feed_read, verdict_write, calls_write, replies_read, watch_read)
    server_fds = (calls_read, replies_write, go_read)
    runner = start(cfg, cwd, parent, "runner", runner_fds)
    server = start(cfg, cwd, parent, "server", server_fds)
    for fd in (*runner_fds, *server_fds):
        os.close(fd)
    drop_capabilities()
    os.write(report, b"ready\n")  # a worker that died closed the other end: BrokenPipeError ends it all
    release(runner)
    release(server)  # its interpreter starts beside the runner's; the program waits for the word
    hand(runner[3], code)
    hand(server[3], code)
    if os.read(verdict_read, 1) != b"r":
        raise RuntimeError("the test runner ended before it was ready (see stderr)")
    hand(go_write, b"g")  # a server that died on its own: the runner sees it
    hand(feed_write, feed)
    return runner[0], server[0], verdict_read, watch_write


def reap(runner: int, server: int, watch: int) -> dict[int, tuple[int, float]]:
    """Wait for the runner, reaping orphans of the namespace on the way: ``{pid: (wait status, CPU seconds)}`` of
    the runner and, when it ended first, the server — then ``watch`` is closed, which tells the runner."""
    ended = {}
    while runner not in ended:
        pid, status, usage = os.wait4(-1, 0)
        if pid in (runner, server):
            ended[pid] = (status, usage.ru_utime + usage.ru_stime)
        if pid == server:
            os.close(watch)
    return ended


def verdict_word(verdict: int) -> bytes:
    """What the runner wrote after ``r``: the token, ``g`` (the program's process ended first) or nothing. Read
    without waiting: a stray of the tests may still hold the write end, and what it writes later is too late."""
    os.set_blocking(verdict, False)
    try:
        return os.read(verdict, 4096)
    except BlockingIOError:
        return b""


def outcome(runner: int, server: int, verdict: int, watch: int, token: bytes) -> tuple[int, float, bool]:
    """``(wait status, CPU seconds, tests passed)`` of the process that decided the run: the runner's, or the
    server's when the program ended before the tests did (its exit status and stderr say why)."""
    ended = reap(runner, server, watch)
    word = verdict_word(verdict)
    if word == b"g":
        while server not in ended:  # its pipe reached EOF: it is ending, if not gone
            pid, status, usage = os.wait4(-1, 0)
            ended[pid] = (status, usage.ru_utime + usage.ru_stime)
        return (*ended[server], False)
    passed = bool(word) and word == token * (len(word) // len(token))
    return (*ended[runner], passed)


def main(cfg: dict) -> int:
    report = cfg["report_fd"]
    os.set_inheritable(report, False)
    try:
        token, tests, code = take_tests(cfg)
        if cfg["private_root"]:
            enter_private_root(cfg)
        call("not dumpable", libc.prctl, PR_SET_DUMPABLE, 0, 0, 0, 0)  # nor traceable, nor its /proc readable
        cwd = "/sandbox" if cfg["private_root"] else cfg["folder"]
        runner, server, verdict, watch = spawn(cfg, cwd, report, token + tests, code)
    except Exception as error:
        os.write(report, f"error {type(error).__name__}: {error}\n".encode())
        return 125
    status, cpu, passed = outcome(runner, server, verdict, watch, token)
    os.write(report, f"exit {status} {cpu:.3f} {int(passed)}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(marshal.loads(bytes.fromhex(sys.argv[1]))))
