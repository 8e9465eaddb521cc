"""A folder of the actor's own for vLLM's ZeroMQ IPC sockets, removed when its engine stops.

vLLM names each IPC socket ``$VLLM_RPC_BASE_PATH/<uuid4>`` (the temp folder by default) and never unlinks it:
every engine start left 4–7 socket files in ``/tmp`` (3,354 on one test machine after a few days). An actor points
vLLM at ``<temp>/asyncrl-vllm-<pid>`` instead and removes it on shutdown; a folder whose process is gone (an actor
killed with ``kill -9``) is removed by the next engine that starts on the host.

The name depends on the PID only: vLLM caches its environment once an engine core has started in a process, so a
second engine in the same process must find the same path.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.procs import alive

log = get_logger("engine")
PREFIX = "asyncrl-vllm-"
MAX_SOCKET_PATH = 107
"""Bytes in a Unix socket's path on Linux (``sun_path`` holds 108 with the closing NUL), ZeroMQ's ``ipc://`` too."""
UUID_LENGTH = 36
"""vLLM's socket names: ``str(uuid4())``."""


def claim() -> Path | None:
    """Make this process's folder (after removing those of processes that are gone) and point vLLM at it; None (vLLM
    keeps its default) when the temp folder's path is too long for a socket path in a folder of its own."""
    base = Path(tempfile.gettempdir())
    remove_stale(base)
    folder = base / f"{PREFIX}{os.getpid()}"
    if not _fits(folder.with_name(f"{folder.name}-12345678")):  # with mkdtemp's suffix, should it be needed
        log.warning(
            "the temp folder's path is too long for vLLM's sockets in a folder of their own; they stay in the temp "
            "folder and are not removed at exit (set TMPDIR to a shorter folder)",
            temp=base,
            limit_bytes=MAX_SOCKET_PATH,
        )
        return None
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        if not _ours(folder):  # someone else's, or a link: never let vLLM bind sockets there
            folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
    os.environ["VLLM_RPC_BASE_PATH"] = str(folder)
    return folder


def _fits(folder: Path) -> bool:
    """Whether vLLM's socket paths in ``folder`` stay within the limit."""
    return len(os.fsencode(folder)) + 1 + UUID_LENGTH <= MAX_SOCKET_PATH


def release(folder: Path | None) -> None:
    """Remove the folder and the sockets in it (called once the engine has shut down)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def remove_stale(base: Path) -> list[Path]:
    """Remove the folders under ``base`` whose process is gone; returns them."""
    removed = []
    for folder in base.glob(f"{PREFIX}*"):
        pid = folder.name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)) and _ours(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        log.info("removed vLLM socket folders of processes that are gone", folders=len(removed), under=base)
    return removed


def _ours(folder: Path) -> bool:
    """A real folder (not a link) owned by this user."""
    try:
        info = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
