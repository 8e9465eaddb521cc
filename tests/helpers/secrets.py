"""Looking for a secret where it must not be: command lines, files of a run, /metrics pages."""

from __future__ import annotations

import stat
import urllib.request
from pathlib import Path

from asyncrl.common.observability.procs import descendants

HOLDERS = {"redis/url", "redis/redis.conf"}
"""Files of a run folder that hold the Redis password by design (written 0600)."""


def processes_showing(secret: str, root_pid: int) -> list[str]:
    """``pid: command line`` of every process from ``root_pid`` down whose argv holds ``secret``."""
    shown = []
    for pid in sorted({root_pid} | descendants(root_pid)):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # ended while we looked
        if secret.encode() in argv:
            command = argv.replace(b"\0", b" ").decode(errors="replace")
            shown.append(f"{pid}: {command[:200]}")
    return shown


def files_exposing(secret: str, folder: Path) -> list[str]:
    """Files under ``folder`` that hold ``secret`` but should not, or hold it and others can read."""
    exposed = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if secret.encode() not in path.read_bytes():
            continue
        name = path.relative_to(folder).as_posix()
        mode = stat.S_IMODE(path.stat().st_mode)
        if name not in HOLDERS:
            exposed.append(f"{name} holds the secret")
        elif mode & 0o077:
            exposed.append(f"{name} holds the secret with mode {mode:o}")
    return exposed


def pages_showing(secret: str, urls: list[str]) -> list[str]:
    """The /metrics URLs whose page (labels included) holds ``secret``."""
    return [url for url in urls if secret in urllib.request.urlopen(url, timeout=10).read().decode()]
