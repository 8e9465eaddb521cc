"""The code sandbox's fences: what each one isolates, and the candidates this machine may start, strongest first.

This module describes; :func:`asyncrl.common.sandbox.isolation` picks, once per process, the strongest
candidate that starts, and :mod:`asyncrl.common.sandbox.run` runs a program behind it:

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
- filesystem: a private ``tmpfs`` root (``SCRATCH_BYTES``, ``SCRATCH_INODES`` of ``run``) holding the working
  folder ``/sandbox`` (also ``HOME``), ``/tmp`` and ``/dev/shm``, the rest of it read-only; read-only binds of ``/usr``
  (with the host's ``/bin``, ``/lib*``, ``/sbin`` links), the interpreter's prefixes (the venv and its base Python),
  ``/etc/ld.so.cache`` and ``/etc/localtime``; ``/dev/null``, ``zero``, ``full``, ``random``, ``urandom``. Everything
  else — ``/root``, ``/home``, the run folder, the repository, ``/sys``, other temporary files — is not there;
- resources: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NOFILE``, ``RLIMIT_FSIZE`` (which also bounds stdout/stderr: they
  go to files in the host folder, never into this process's memory), ``RLIMIT_NPROC`` (:data:`MAX_PROCESSES`,
  threads included; not for the host's root, see above), no core dumps;
- lifetime: killing the namespace's init kills everything in it. That happens when the program exits, at the
  wall-clock limit (the whole process group is killed), and when the worker dies (``setpriv --pdeathsig`` ends
  ``unshare``, whose ``--kill-child`` ends the init: the program can clear neither). The parent-death signal follows
  the *thread* that started the run; :func:`~asyncrl.common.sandbox.run_python_tests` blocks that thread until
  the run has ended.

Not isolated, under any fence: the kernel (no seccomp filter: a kernel exploit escapes); the files of the read-only
binds above (nothing secret, but readable); the clock; the host's CPU and memory beyond the limits — ``RLIMIT_AS`` is
per process, so a run holds at most ``MAX_PROCESSES`` x ``memory_mb`` of memory (no cgroup bounds the sum), and
``cpu_s`` bounds each process's CPU time, ``wall_s`` the whole run. A fence for one untrusted program, not a VM.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

MAX_PROCESSES = 32  # RLIMIT_NPROC: tasks of the run's uid, threads included (and x memory_mb: a run's memory bound)
UID_BASE = 2_000_000_000  # per-run uids (root workers): far above any real account
_NAMESPACE_NAMES = ("pid", "net", "mount", "ipc", "uts")
_NAMESPACES = ("--pid", "--net", "--mount", "--ipc", "--uts", "--fork", "--kill-child")


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


def tool(name: str) -> str:
    """The path of a util-linux tool the fences need (``setpriv``, ``unshare``); raises, saying how to install it."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if found is None:
        raise RuntimeError(f"the sandbox needs {name} from util-linux: install it (apt-get install util-linux)")
    return found


def candidates() -> list[Isolation]:
    """The fences to try, strongest first (the module docstring compares them).

    A root worker tries ``rlimits`` twice: as a per-run uid, which cannot start when the interpreter lies where
    only root may look (e.g. under ``/root``), then as root itself — the last resort, and said so.
    """
    root = os.geteuid() == 0
    base = (tool("setpriv"), "--pdeathsig", "KILL", "--")
    unshare = (tool("unshare"), *_NAMESPACES, "--")
    per_run, own_budget = f"a per-run uid ({UID_BASE} and up), no capabilities", f"RLIMIT_NPROC {MAX_PROCESSES}"
    user_namespaces = Isolation(
        "user-namespaces",
        ("user", *_NAMESPACE_NAMES),
        "the worker's uid, root in its user namespace, no capabilities",
        "not limited: RLIMIT_NPROC never binds the host's root" if root else f"{own_budget} in its user namespace",
        (*base, unshare[0], "--user", "--map-root-user", *unshare[1:]),
        per_run_uid=False,
    )
    worker_uid = Isolation(
        "rlimits",
        (),
        "the worker's uid" + (" (root)" if root else ""),
        "not limited: RLIMIT_NPROC would count the worker's own processes",
        base,
        per_run_uid=False,
    )
    if not root:
        return [user_namespaces, worker_uid]
    return [
        Isolation("namespaces", _NAMESPACE_NAMES, per_run, f"{own_budget} for that uid", (*base, *unshare), True),
        user_namespaces,
        Isolation("rlimits", (), per_run, f"{own_budget} for that uid", base, per_run_uid=True),
        worker_uid,
    ]


# --------------------------------------------------------------------------- the environment host's fences
# Environment code (``actors/environments/host.py``) is not a model's program: it needs the venv, its packages, the
# network where it calls a service, and time. So its fences keep the filesystem (read-only) and, unless asked, the
# network, and fence the process off from the process it serves (``actors/environments/fence.py`` says what each does).

HOST_UID_BASE = UID_BASE - 2**24
"""Per-host uids of a root actor's environment hosts: below the sandbox's per-run uids, far above any real account."""
_HOST_NAMESPACES = ("pid", "mount", "ipc")


def host_candidates(network: bool) -> list[Isolation]:
    """The environment host's fences to try, strongest first: ``namespaces`` (root: PID, mount and IPC namespaces, a
    per-host uid), ``user-namespaces`` (the same plus a user namespace: the actor's uid, no capabilities), and
    ``none``. Without ``network`` each namespace fence adds a network namespace (no network, not even loopback).

    Each launcher starts the host in a fresh ``/proc`` of its own PID namespace, whose init it is; the caller starts
    it in a new session (``kill(0)`` from the host then reaches only the host's own process group).
    """
    root = os.geteuid() == 0
    names = _HOST_NAMESPACES if network else (*_HOST_NAMESPACES, "net")
    unshare = (tool("unshare"), *(f"--{name}" for name in names), "--mount-proc", "--fork", "--kill-child")
    base = (tool("setpriv"), "--pdeathsig", "KILL", "--")
    own = "its own PID namespace (it is the init)"
    user_namespaces = Isolation(
        "user-namespaces",
        ("user", *names),
        "the actor's uid, root in its user namespace, no capabilities",
        own,
        (*base, unshare[0], "--user", "--map-root-user", *unshare[1:], "--"),
        per_run_uid=False,
    )
    none = Isolation("none", (), "the actor's uid" + (" (root)" if root else ""), "the actor's", (), per_run_uid=False)
    if not root:
        return [user_namespaces, none]
    per_host = f"a per-host uid ({HOST_UID_BASE} and up), no capabilities"
    return [
        Isolation("namespaces", names, per_host, own, (*base, *unshare, "--"), per_run_uid=True),
        user_namespaces,
        none,
    ]
