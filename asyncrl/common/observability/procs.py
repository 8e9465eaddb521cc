"""Reading the process tree from ``/proc`` (Linux): whose parent is who, which processes a process has; CPU lists."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``kill(pid, 0)``; another user's counts, and so does a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def name_and_state(pid: int) -> tuple[str, str] | None:
    """The command name and state letter (``R``, ``S``, ``Z`` for a zombie, …) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and ')': it ends at the last ')'.
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :][:1]


def parent_of(pid: int) -> int:
    """The parent PID of ``pid`` (0 when the process is gone or ``/proc`` cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) is in parentheses and may hold spaces and ')': parse after the last ')'.
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def parents() -> dict[int, int]:
    """PID → parent PID of every process (a process that ends while it is read is left out)."""
    found = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (parent := parent_of(int(entry.name))):
                found[int(entry.name)] = parent
    return found


def ended(pid: int) -> bool:
    """Whether ``pid`` has ended: gone, or a zombie that only waits to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def child_pids(pid: int) -> list[int]:
    """The PIDs whose parent is ``pid``."""
    return [child for child, parent in parents().items() if parent == pid]


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``: its children, theirs, and so on."""
    tree = parents()
    below: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in tree.items() if parent in frontier} - below
        below |= frontier
    return below


def move_process(cpus: set[int]) -> None:
    """Move every thread of this process to ``cpus`` (``os.sched_setaffinity(0, ...)`` moves only the calling one;
    threads started later inherit their starter's CPUs). Raises ``OSError`` when none of ``cpus`` can run it."""
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)
