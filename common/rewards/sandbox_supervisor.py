"""Stage 2 of the code sandbox: the supervisor of one run, started by path (``python -I -S <this file> <config>``).

The worker (:mod:`asyncrl.common.rewards.sandbox_run`) starts this file behind the fence's launcher with one argument,
the run's configuration (a ``marshal``-ed dict, hex). Behind a namespace fence it is the PID namespace's init: it reads
and removes the tests, builds the private root, forks the program's process (limits, no capability, the run's uid,
then ``exec`` of the harness, :mod:`asyncrl.common.rewards.sandbox_harness`), hands the harness the run's token and
the tests, waits, and writes its report on the pipe ``report_fd``: ``ready`` before the program may exec, then
``exit <wait status> <CPU s> <1 when the tests ran to their end, else 0>``, or ``error ...`` when the program never
ran. It never runs the program's code itself, holds no capability once the program runs, and the program never holds
the report pipe (close-on-exec). It alone knows the run's token until the harness has started.

Rule: this file imports the standard library only. It runs in a bare interpreter (``-I -S``: no site-packages, no
``PYTHON*`` variables, not its own folder on ``sys.path``) where asyncrl is not importable, and importing it would slow
every run (``tests/unit/test_sandbox.py`` parses the imports to hold this); for the same reason its annotations name
builtins only (``typing`` alone costs milliseconds of every run).
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
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4


def call(what: str, function: object, *args: object) -> None:
    """``function(*args)``, a libc call that returns 0 on success; raises ``OSError`` with ``what`` otherwise."""
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


def take_tests(cfg: dict) -> tuple[bytes, bytes]:
    """The run's token (33 bytes: 32 hex digits and a newline, what the harness reads first) and the tests, read
    and removed from the host folder before the program can look there."""
    path = cfg["folder"] + "/tests.py"
    with open(path, "rb") as f:
        tests = f.read()
    os.unlink(path)
    return os.urandom(16).hex().encode() + b"\n", tests


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


def drop_capabilities() -> None:
    """Stage 2 needs none once the program runs: capset(2) with every set empty (header version 3)."""
    call("capset", libc.capset, (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())


def spawn(cfg: dict, cwd: str, report: int, feed: bytes) -> tuple[int, int]:
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
            view = view[os.write(feed_write, view) :]
    except BrokenPipeError:
        pass
    os.close(feed_write)
    return child, verdict_read


def reap(child: int) -> tuple[int, float]:
    """Wait for the program, reaping orphans of the namespace on the way: ``(wait status, CPU seconds)``."""
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == child:
            return status, usage.ru_utime + usage.ru_stime


def tests_passed(verdict: int, token: bytes) -> bool:
    """Whether the pipe holds the token and nothing else (a forked copy of a passing run may add it again). Read
    without waiting: a stray the program left may still hold the write end, and what it writes later is too late."""
    os.set_blocking(verdict, False)
    try:
        data = os.read(verdict, 4096)
    except BlockingIOError:
        return False
    return bool(data) and data == token * (len(data) // len(token))


def main(cfg: dict) -> int:
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


if __name__ == "__main__":
    sys.exit(main(marshal.loads(bytes.fromhex(sys.argv[1]))))
