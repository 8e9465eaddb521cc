"""Waiting for an event in a test: poll a condition until it holds, with a deadline, never a bare sleep.

A test that sleeps for "long enough" is either slow or flaky (on a loaded machine the event comes later); one that
polls returns as soon as the event happened and fails, naming what it waited for, only when it never does.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from asyncrl.common.plane.outage import RedisUnavailable

T = TypeVar("T")
NOT_YET = (FileNotFoundError, RedisUnavailable)
"""What a condition may raise while its event has not happened: a file not written yet, Redis not (yet) up."""


def wait_for(
    condition: Callable[[], T],
    what: str,
    *,
    proc: subprocess.Popen | None = None,
    timeout_s: float = 60,
    poll_s: float = 0.05,
    log: Path | None = None,
) -> T:
    """Call ``condition`` every ``poll_s`` until it returns something truthy, and return that.

    A condition that raises ``FileNotFoundError`` (or ``RedisUnavailable``) counts as not yet. Fails naming ``what``
    after ``timeout_s``, or as soon as ``proc`` (the process that should bring the event about) has exited, naming
    its exit code; ``log`` (that process's output file) is added to either failure.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if value := condition():
                return value
        except NOT_YET:
            pass
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process {proc.pid} exited ({proc.returncode}) before {what}{_tail(log)}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"no {what} within {timeout_s:g} s{_tail(log)}")
        time.sleep(poll_s)


def _tail(log: Path | None) -> str:
    """The process's output, for a failure message."""
    if log is None:
        return ""
    try:
        return ":\n" + log.read_text(errors="replace")
    except OSError as exc:
        return f" (its log {log} unreadable: {exc})"
