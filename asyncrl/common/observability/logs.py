"""Structured logs: one line per event, ``key=value`` pairs after a short message.

Every process logs through :func:`get_logger`. An event says what happened, to what, and —
where a person has something to do — what to do, e.g.::

    log.warning("dropped malformed message", channel="rollouts", field="logprobs",
                action="check the sender's asyncrl version")
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

_CONFIGURED = False


def _format_value(value: Any) -> str:
    text = str(value)
    if text == "" or any(ch.isspace() or ch in '"=' for ch in text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


class KVLogger:
    """A thin wrapper over :class:`logging.Logger` that renders keyword fields as ``key=value``."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def _log(self, level: int, msg: str, fields: dict[str, Any]) -> None:
        if not self._logger.isEnabledFor(level):
            return
        tail = " ".join(f"{k}={_format_value(v)}" for k, v in fields.items())
        self._logger.log(level, f"{msg} {tail}" if tail else msg, stacklevel=3)

    def debug(self, msg: str, **fields: Any) -> None:
        self._log(logging.DEBUG, msg, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._log(logging.INFO, msg, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._log(logging.WARNING, msg, fields)

    def error(self, msg: str, **fields: Any) -> None:
        self._log(logging.ERROR, msg, fields)


class _Stderr:
    """``sys.stderr`` as it is when a line is written, not when logging was configured: whatever replaced it since (a
    test harness capturing output, a process redirecting its own) gets the line, and a closed former stream none."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str | None = None, stream: Any = None) -> None:
    """Configure the root handler once per process (level from ``ASYNCRL_LOG_LEVEL``, default INFO), writing to
    ``stream``, else to the process's standard error of the moment."""
    global _CONFIGURED
    if _CONFIGURED:
        return
    handler = logging.StreamHandler(stream or _Stderr())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s pid=%(process)d: %(message)s"))
    root = logging.getLogger("asyncrl")
    root.addHandler(handler)
    root.setLevel(level or os.environ.get("ASYNCRL_LOG_LEVEL", "INFO"))
    root.propagate = False
    _CONFIGURED = True


def get_logger(component: str) -> KVLogger:
    """The logger of one component, named ``asyncrl.<component>``."""
    return KVLogger(logging.getLogger(f"asyncrl.{component}"))


def worth_logging(count: int) -> bool:
    """Whether the ``count``-th occurrence of something repeated is logged: the 1st, 10th, 100th, … (with the count
    in the line), so a flood of hostile messages cannot flood the log while each kind is still seen at once."""
    return count > 0 and count == 10 ** (len(str(count)) - 1)
