"""Log lines go to the process's standard error of the moment, not to the one logging was configured with."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from asyncrl.common.observability import logs


def test_a_line_goes_to_the_stderr_of_the_moment_and_a_closed_former_one_is_no_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logs, "_CONFIGURED", False)
    root = logging.getLogger("asyncrl")
    monkeypatch.setattr(root, "handlers", [])
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logs.configure("INFO")
    logs.get_logger("stream-test").info("to the first", n=1)
    first.close()  # as a test harness closes the stream it captured a test's output with
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    logs.get_logger("stream-test").warning("to the one of the moment", n=2)
    text = later.getvalue()
    assert "to the one of the moment" in text and "Logging error" not in text and "to the first" not in text
