"""An actor's liveness (actors/liveness.py): progress is no group in hand, a weight load, or a token within the
stall limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.actors import liveness
from asyncrl.actors.liveness import ALIVE_ENV


@pytest.mark.parametrize(
    ("running", "syncing", "since", "progressing"),
    [
        (0, False, 10_000.0, True),  # nothing to generate: an idle engine is not a hung one
        (3, False, 2.0, True),
        (3, False, 301.0, False),  # groups in hand, no token for five minutes: hung
        (3, True, 301.0, True),  # loading weights: the broadcast's own time limit applies
    ],
)
def test_progress(running: int, syncing: bool, since: float, progressing: bool) -> None:
    assert liveness.engine_progressing(running, syncing, since) is progressing


def test_a_long_environment_step_raises_the_stall_limit() -> None:
    assert liveness.stall_limit_s(10.0) == liveness.STALL_S
    assert liveness.stall_limit_s(3600.0) == 3660.0


def test_the_file_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ALIVE_ENV, raising=False)
    assert liveness.alive_file() is None
    monkeypatch.setenv(ALIVE_ENV, str(tmp_path / "sub" / "alive"))
    path = liveness.alive_file()
    liveness.touch(path)
    assert path.is_file()
