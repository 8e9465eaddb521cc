"""Stale build locks of torch's JIT extension cache, found before DeepSpeed builds or loads its ops.

DeepSpeed compiles its small ops (``cpu_adam`` for optimizer offload; the learner skips the CPU shared-memory
collective, :func:`asyncrl.learner.dist.skip_shared_memory_collective`) with
``torch.utils.cpp_extension.load`` on first use. torch serialises builds with a ``torch.utils.file_baton.FileBaton``:
the builder creates ``<extensions dir>/<op>/lock`` with ``O_EXCL``, runs ``ninja`` in that folder, and deletes the
file; everyone else polls until the file is gone, with no timeout. The file holds no process id, so a learner killed
during the build leaves it behind and every later learner on the host waits forever, silently.

:func:`clear_stale_locks` decides what a lock's owner is doing from what a build looks like from outside: while torch
builds, ``ninja`` and the compiler run with the op's folder as their working directory, so a lock with no process
working in its folder, older than ``grace_s`` (the moment between taking the baton and starting ``ninja``), has no
owner. Such a lock is removed with a warning naming it (the build then starts over; ``ninja`` redoes whatever the dead
build left unfinished). A lock whose build is alive — the orphaned ``ninja`` of a killed learner, or another program's
build — is waited for, up to ``wait_s``, then the learner stops with one line naming the file, the process and the
fix. Processes of other users whose working directory cannot be read are not seen (the default cache is per-user).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.common.observability.logs import get_logger

log = get_logger("learner")

LOCK_NAME = "lock"
"""The file name of torch's baton in each op's build folder (``torch.utils.cpp_extension._jit_compile``)."""
GRACE_S = 30.0
WAIT_S = 900.0


class StaleLockError(RuntimeError):
    """A build lock that could not be cleared; the message names the file and the fix."""


def extensions_root() -> Path:
    """Where torch builds JIT extensions: ``$TORCH_EXTENSIONS_DIR``, else its per-user cache folder for this Python and
    accelerator (``~/.cache/torch_extensions/py311_cpu``), as ``torch.utils.cpp_extension._get_build_directory``."""
    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(root)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def processes_in(folder: Path, exclude: tuple[int, ...] | None = None) -> list[int]:
    """Ids of the processes whose working directory is ``folder`` or below it (this process is left out unless
    ``exclude`` says otherwise); processes whose directory cannot be read are not counted."""
    exclude = (os.getpid(),) if exclude is None else exclude
    target = os.path.realpath(folder)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
        except OSError:  # gone, or another user's
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            found.append(int(entry.name))
    return sorted(found)


def prefer_environment_ninja() -> Path | None:
    """Put this Python environment's ``ninja`` first on ``PATH`` for torch's JIT builds; return it (None if absent).

    torch runs whichever ``ninja`` ``PATH`` names, and ninja versions keep their build log in different formats
    (1.11 hashes commands with MurmurHash, log v5; 1.13 with rapidhash, log v7). A learner started as
    ``.venv/bin/rl-learner`` without the environment activated finds the system's ninja, one under ``torchrun`` or an
    activated environment finds the environment's: each reads the other's log as changed commands and rebuilds the op
    from scratch, 45-200 s on two cores, every time the other kind built last. One ninja per environment builds once.
    """
    ninja = Path(sys.executable).parent / "ninja"
    if not (ninja.is_file() and os.access(ninja, os.X_OK)):
        return None
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != str(ninja.parent):
        os.environ["PATH"] = os.pathsep.join([str(ninja.parent), path]) if path else str(ninja.parent)
    return ninja


def clear_stale_locks(
    root: Path | None = None,
    *,
    grace_s: float = GRACE_S,
    wait_s: float = WAIT_S,
    poll_s: float = 0.5,
    builders: Callable[[Path], list[int]] = processes_in,
) -> list[Path]:
    """Remove the build locks under ``root`` (default :func:`extensions_root`) that no process holds (see the module
    docstring); wait for those whose build is alive. Returns the removed locks; raises :class:`StaleLockError` when
    a lock outlives ``wait_s`` with its build alive, or cannot be removed."""
    root = extensions_root() if root is None else root
    locks = sorted(root.glob(f"*/{LOCK_NAME}")) if root.is_dir() else []
    return [lock for lock in locks if _clear(lock, grace_s, wait_s, poll_s, builders)]


def _clear(lock: Path, grace_s: float, wait_s: float, poll_s: float, builders: Callable[[Path], list[int]]) -> bool:
    """True when ``lock`` was stale and is removed; False when its owner released it while we looked."""
    deadline = time.monotonic() + wait_s
    told = False
    seen_building_at = None
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return False  # released by its builder
        pids = builders(lock.parent)
        now = time.monotonic()
        if pids:
            seen_building_at = now
            if not told:
                log.info("waiting for a torch extension build in progress", lock=lock, pids=pids)
                told = True
        elif age >= grace_s and (seen_building_at is None or now - seen_building_at >= min(grace_s, 5.0)):
            return _remove(lock, age)
        if now >= deadline:
            owner = f"process(es) {', '.join(map(str, pids))} still building in {lock.parent}" if pids else "no owner"
            raise StaleLockError(
                f"{lock}: torch's extension build lock has been held for {age:.0f}s ({owner}); wait for that build, or "
                f"stop it and delete the file (rm {lock}), then start the learner again"
            )
        time.sleep(poll_s)


def _remove(lock: Path, age: float) -> bool:
    try:
        lock.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StaleLockError(
            f"{lock}: a stale torch extension build lock (no process builds in its folder, {age:.0f}s old) that this "
            f"learner cannot delete ({exc.strerror}); delete it (rm {lock}) or set TORCH_EXTENSIONS_DIR to a folder "
            "of your own, then start the learner again"
        ) from exc
    log.warning(
        "removed a stale torch extension build lock",
        lock=lock,
        age_s=round(age),
        why="no process builds in its folder (a process killed during a JIT build leaves the lock behind)",
    )
    return True
