"""The environment host's fence: environment code runs fenced off from the process it serves (an actor and its engine,
or a reward worker), so a hostile ``step`` can end only its own host.

Environments are named by the operator's config, but more and more come from hubs of other people's code. Without a
fence, ``os.kill(os.getppid(), 9)`` in a ``step`` kills the actor. :func:`host_fence` picks, once per process, the
strongest fence of :func:`~asyncrl.common.sandbox.fences.host_candidates` whose host starts (and logs it);
:func:`launch` starts a host behind it; :func:`enter` is what the host does first, before any environment code:

``namespaces`` (the actor is root): the host is the init of its own PID namespace, with a fresh ``/proc``, in its own
    mount and IPC namespaces and its own session, and runs as a per-host uid with no capabilities and
    ``no_new_privs``. It cannot name the actor's processes (``getppid()`` is 0, ``kill(0)`` reaches its own process
    group, ``kill(-1)`` its own namespace), nor signal, trace (``ptrace``, ``process_vm_writev``,
    ``/proc/<pid>/mem``) or read the files of its uid (the run folder is 0700, its files 0600).
``user-namespaces`` (any other actor, or a root that may create namespaces only with a user namespace): the same
    namespaces plus a user namespace; the host keeps the actor's uid (root inside, no capabilities, so it cannot
    unmount its ``/proc`` to see the host's). It cannot signal or trace the actor's processes (it cannot name them),
    but it can read what the actor's uid may read.
``none``: the host runs as before, in its own session only; the log says so with a warning.

Under both namespace fences the whole filesystem is read-only for the host but its scratch: a private tmpfs on the
temporary folder, ``/dev/shm`` (the engine's shared memory is not there) and ``$HOME`` (empty, the host's own), each of
``environment.max_memory_mb``. The interpreter, the venv and the folders asyncrl and the working folder lie in are bound
back, read-only, where a scratch tmpfs (or, for the per-host uid, a folder it may not enter such as ``/root``) would
hide them. The host keeps the network (an environment may call a service) unless ``environment.fence = "offline"``;
its environment variables are the actor's but for the run's secrets (the Redis URL, CURVE keys).

Not fenced: the network (loopback services, abstract Unix sockets) under ``auto``; the kernel; devices the host's uid
may open (a GPU: its memory, not the engine's); CPU and memory beyond ``environment.max_memory_mb`` (no cgroup).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, TypedDict

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.sandbox.fences import HOST_UID_BASE, Isolation, host_candidates

log = get_logger("environment_host")
READY = {"ready": True}
"""The first line a host writes once it can take requests (behind its fence, before any environment code runs)."""
PLAN_VARIABLE = "ASYNCRL_ENV_FENCE"
"""The host's fence (:func:`plan`, as JSON) on its way to :func:`enter`, in the host's environment."""
SECRETS = (
    "ASYNCRL_REDIS_URL",
    "ASYNCRL_REDIS_URL_FILE",
    "ASYNCRL_CURVE_CLIENT_KEY",
    "ASYNCRL_CURVE_CLIENT_KEYS",
    "ASYNCRL_CURVE_SERVER_KEY",
)
"""The run's secrets a fenced host does not inherit."""
PROBE_S = 60.0
_FENCES: dict[str, Isolation] = {}
_LOCK = threading.Lock()
_HOSTS = itertools.count()
MOUNT_ATTR_RDONLY, AT_RECURSIVE, AT_FDCWD, SYS_MOUNT_SETATTR = 1, 0x8000, -100, 442  # the same number on every arch


def host_fence(setting: str) -> Isolation:
    """The fence of this process's environment hosts for ``environment.fence`` (``auto``, ``offline`` or ``none``),
    found at the first call by starting a host behind each candidate in turn, and logged then.

    ``offline`` with no namespace fence on this machine raises: the operator asked for no network."""
    with _LOCK:
        if setting not in _FENCES:
            _FENCES[setting] = _detect(setting)
            _log_fence(_FENCES[setting], setting)
        return _FENCES[setting]


def launch(fence: Isolation, memory_mb: int, stderr: int | IO[Any] | None = None) -> subprocess.Popen[str]:
    """``python -m asyncrl.actors.environments.host`` behind ``fence``, in a session of its own (so its process group
    is the launcher and the host), with stdin and stdout pipes. Call it from a thread that outlives the host: the
    launcher's parent-death signal follows the thread that started it."""
    env = {**os.environ, "ASYNCRL_ENV_MEMORY_MB": str(memory_mb)}
    if fence.launcher:
        env = {name: value for name, value in env.items() if name not in SECRETS}
        env[PLAN_VARIABLE] = json.dumps(plan(fence, memory_mb))
    return subprocess.Popen(
        [*fence.launcher, sys.executable, "-m", "asyncrl.actors.environments.host"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
        text=True,
        bufsize=1,
        start_new_session=True,
    )


class FencePlan(TypedDict):
    """What :func:`plan` hands a host, as JSON in its environment."""

    uid: int | None
    scratch: list[str]
    binds: list[str]
    home: str
    shared: list[str]
    size_mb: int
    proc_writable: bool


def plan(fence: Isolation, memory_mb: int) -> FencePlan:
    """What :func:`enter` does in a host behind ``fence``: ``uid`` (a per-host uid, or None), ``scratch`` (folders
    that get a private tmpfs, shallowest first), ``binds`` (paths inside them bound back read-only), ``home`` (the
    host's own, 0700), ``shared`` (temporary folders, 1777) and ``proc_writable``."""
    uid = HOST_UID_BASE + (os.getpid() % 4096) * 4096 + next(_HOSTS) % 4096 if fence.per_run_uid else None
    home, tmp = os.path.realpath(os.path.expanduser("~")), os.path.realpath(tempfile.gettempdir())
    scratch = {tmp, "/tmp", "/dev/shm", home}
    if uid is not None:  # a fresh uid owns nothing: it enters a folder only where others may
        scratch |= {blocked for path in _needed() if (blocked := _first_closed(path))}
    scratch = {os.path.realpath(folder) for folder in scratch if os.path.isdir(folder)} - {"/"}
    binds = [path for path in _needed() if path not in scratch and any(_below(path, s) for s in scratch)]
    binds = [path for path in binds if not any(_below(path, other) and path != other for other in binds)]
    return {
        "uid": uid,
        "scratch": sorted(scratch, key=lambda p: p.count("/")),
        "binds": binds,
        "home": home,
        "shared": sorted({tmp, "/tmp", "/dev/shm"}),
        "size_mb": memory_mb,
        "proc_writable": _proc_writable(uid),
    }


def _proc_writable(uid: int | None) -> bool:
    """Whether the host's ``/proc`` may be writable (the sandbox's user namespace needs it): not for a host whose uid
    is the machine's root (a root actor's ``user-namespaces``), which could write the files of ``/proc`` root may
    write (``/proc/sys``, ``/proc/sysrq-trigger``); hiding them by binds would stop the sandbox mounting its ``/proc``.
    Such a host's sandbox falls back to its ``rlimits`` fence, still inside this one."""
    return uid is not None or os.geteuid() != 0


@functools.cache
def _needed() -> tuple[str, ...]:
    """What a host must read: the interpreter's prefixes, ``sys.path``, the working folder, the folder asyncrl is in."""
    import asyncrl

    package = Path(asyncrl.__file__).parent.parent  # asyncrl/common and asyncrl/actors are inside it
    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.getcwd(), *sys.path, package}
    return tuple(sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)}))


def _first_closed(path: str) -> str | None:
    """The first folder from ``/`` down to ``path`` that a uid owning nothing may not enter."""
    parts = Path(path).parts
    for depth in range(1, len(parts) + 1):
        folder = os.path.join(*parts[:depth])
        if not os.stat(folder).st_mode & 0o001:
            return folder
    return None


def _below(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


# --------------------------------------------------------------------------- which fence


def _detect(setting: str) -> Isolation:
    """The first candidate behind which a host starts; the refusals of the stronger ones are kept in ``refused``."""
    none = Isolation("none", (), "the actor's uid", "the actor's", (), per_run_uid=False)
    if setting == "none":
        return none
    try:
        candidates = host_candidates(network=setting != "offline")
    except RuntimeError as error:  # no setpriv or unshare
        candidates, refused = [none], [str(error)]
    else:
        refused = []
    for fence in candidates:
        if fence.fence == "none" and setting == "offline":
            break
        why = _probe(fence) if fence.launcher else ""
        if not why:
            return replace(fence, refused="; ".join(refused))
        refused.append(f"{fence.fence}: {why}")
    raise RuntimeError(
        "environment.fence = 'offline' needs namespaces, which this machine refused: " + "; ".join(refused)
    )


def _probe(fence: Isolation) -> str:
    """Start a host behind ``fence`` and wait for it to say it is ready; "" when it did, else why not."""
    with tempfile.TemporaryFile() as err:
        proc = launch(fence, 512, stderr=err)
        try:
            ready = _first_line(proc, PROBE_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.communicate()
        if ready == READY:
            return ""
        err.seek(0)
        lines = err.read().decode(errors="replace").strip().splitlines()
        return lines[-1][-300:] if lines else f"exit {proc.returncode}"


def _first_line(proc: subprocess.Popen[str], timeout_s: float) -> object:
    """The first line ``proc`` writes, as JSON (None when it writes none within ``timeout_s``)."""
    box: list[object] = [None]
    stdout = proc.stdout
    if stdout is None:
        raise ValueError("the process was started without a stdout pipe (start it with launch())")

    def read() -> None:
        with contextlib.suppress(ValueError):
            box[0] = json.loads(stdout.readline())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0]


def _log_fence(fence: Isolation, setting: str) -> None:
    network = "none" if "net" in fence.namespaces else "the actor's"
    fields = {
        "fence": fence.fence,
        "namespaces": ",".join(fence.namespaces) or "none",
        "user": fence.user,
        "processes": fence.processes,
        "network": network,
    }
    if fence.fence != "none" and not fence.refused:
        log.info("environment host fence", **fields)
    elif setting == "none":
        log.info(
            "environment host unfenced (environment.fence = 'none'): its environments can signal, trace and "
            "write into this process",
            **fields,
        )
    else:
        action = (
            "let this process create namespaces (root with CAP_SYS_ADMIN, or user namespaces enabled: sysctl "
            "user.max_user_namespaces), or run only environments you trust"
        )
        log.warning("environment host behind a weaker fence", **fields, refused=fence.refused, action=action)


# --------------------------------------------------------------------------- in the host


def enter(fence_plan: FencePlan) -> None:
    """The host's first act behind a namespace fence (it is root in its namespaces still): the read-only view, its
    scratch, the binds back, then its uid and no capability ever again."""
    from asyncrl.common.sandbox import supervisor as stage2

    uid, home = fence_plan["uid"], fence_plan["home"]
    sources = {path: os.open(path, os.O_PATH) for path in fence_plan["binds"]}  # before scratch hides them
    _read_only("/")
    if fence_plan["proc_writable"]:  # a sandbox started from the host writes its uid_map there
        _read_only("/proc", False)
    for folder in fence_plan["scratch"]:
        os.makedirs(folder, exist_ok=True)  # one below another scratch folder
        mode = "1777" if folder in fence_plan["shared"] else "700" if folder == home else "755"
        owner = f",uid={uid},gid={uid}" if uid is not None and folder == home else ""
        options = f"size={fence_plan['size_mb']}m,mode={mode}{owner}"
        stage2.mount("tmpfs", folder, stage2.MS_NOSUID | stage2.MS_NODEV, "tmpfs", options)
    for path, fd in sources.items():
        _mount_point(path)
        stage2.mount(f"/proc/self/fd/{fd}", path, stage2.MS_BIND | stage2.MS_REC)
        _read_only(path)
        os.close(fd)
    os.chdir(os.getcwd())  # the working folder as bound back, not the one under the scratch
    stage2.drop_privileges({"rlimits": [], "uid": uid}, os.getppid())
    if uid is None:
        stage2.drop_capabilities()
    os.environ.pop(PLAN_VARIABLE, None)


def _mount_point(path: str) -> None:
    """``path`` and the folders above it made in a scratch tmpfs, each enterable by every uid (0755): the process
    served runs with umask 077 (every asyncrl command does, ``common/private.py``), under which they would be 0700 and
    hide what is bound back below them (the interpreter's own library under ``/root``, say) from the host's uid."""
    previous = os.umask(0o022)
    try:
        os.makedirs(path, exist_ok=True)
    finally:
        os.umask(previous)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _read_only(path: str, read_only: bool = True) -> None:
    """``path`` and every mount below it read-only (``mount_setattr``, Linux 5.12); with ``read_only`` False, the
    mount at ``path`` alone writable again."""
    from asyncrl.common.sandbox import supervisor as stage2

    attr = _MountAttr(*((MOUNT_ATTR_RDONLY, 0) if read_only else (0, MOUNT_ATTR_RDONLY)), 0, 0)
    flags = AT_RECURSIVE if read_only else 0
    stage2.call(
        f"read-only {path}",
        stage2.libc.syscall,
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
