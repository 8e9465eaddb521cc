"""Files of a run that only its owner reads: folders 0700, files 0600.

A run's folder reveals the run: ``config.json`` (model, data set, hosts), the prompts and responses of
``samples.jsonl``, the audit trail, the logs, the checkpoints (the trained weights) and Redis's AOF (every message,
the password's hash included). Other users of the machine get none of it: the run folder and every folder under it
are 0700 (:func:`private_dir`), and the files in them 0600 (:func:`open_private`; :data:`PRIVATE_UMASK` for what
other libraries create: DeepSpeed's checkpoint files, redis-server's AOF, a child's files).

A folder or file left wider by an older run is narrowed when it is next opened: the modes do not depend on who
created it first.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Any

PRIVATE_UMASK = 0o077
"""The umask of every process of a run (set by its command line's entry point, passed on to its children): what it
creates is its owner's only, whatever library creates it."""


def private_umask() -> int:
    """Set this process's umask to :data:`PRIVATE_UMASK` (children inherit it); returns the previous one."""
    return os.umask(PRIVATE_UMASK)


def private_dir(path: str | Path) -> Path:
    """``path`` as a folder of mode 0700: created with any missing parents (each 0700), or narrowed to 0700 when it
    exists. Returns it."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made a moment ago by another process of the run
            folder.mkdir(mode=0o700)
    _narrow(path, 0o700)
    return path


def open_private(path: str | Path, mode: str = "a", **kwargs: Any) -> IO[Any]:
    """``open(path, mode)`` for writing a file of mode 0600 in a 0700 folder (created as with :func:`private_dir`);
    an existing file is narrowed to 0600. ``mode`` is one of ``a``, ``w``, ``ab``, ``wb``."""
    path = Path(path)
    if mode.rstrip("b") not in ("a", "w"):
        raise ValueError(f"open_private writes: mode must be a, w, ab or wb, not {mode!r}")
    private_dir(path.parent)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        found = os.fstat(fd)
        if found.st_mode & 0o777 != 0o600 and found.st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


_WARNED: set[Path] = set()  # paths this process could not narrow (said once each)


def _narrow(path: Path, mode: int) -> None:
    found = path.stat()
    if found.st_mode & 0o777 == mode:
        return
    if found.st_uid != os.geteuid():  # another user's (a shared mount): only its owner may narrow it
        from asyncrl.common.observability.logs import get_logger

        if path in _WARNED:
            return
        _WARNED.add(path)
        get_logger("files").warning(
            "a run folder is not this user's and stays readable by others",
            path=path,
            mode=oct(found.st_mode & 0o777),
            action=f"chmod {mode:o} {path} as its owner",
        )
        return
    os.chmod(path, mode)
