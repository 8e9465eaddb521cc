"""The launcher's progress: one line redrawn in place on a terminal; plain lines, a few per run, in a captured log."""

from __future__ import annotations

import io

from asyncrl.cli.children import Progress, progress_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def row(step: int) -> dict:
    return {"step": float(step), "rollout/reward_mean": 0.5, "rollout/staleness_max": 1.0, "step/seconds": 2.0}


def test_a_captured_log_gets_a_plain_line_every_twentieth_of_the_run_and_the_last() -> None:
    log = io.StringIO()
    progress = Progress(50, log)
    for step in [1, 1, *range(2, 51)]:
        progress.show(row(step))
    progress.say("actor-0 exited with an error: killed by SIGKILL")
    progress.end()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert [line.split()[1] for line in lines[:-1]] == [f"{n}/50" for n in range(2, 51, 2)]  # every 50 // 20 = 2
    assert lines[-1] == "actor-0 exited with an error: killed by SIGKILL"


def test_a_terminal_gets_one_line_redrawn_in_place() -> None:
    screen = Terminal()
    progress = Progress(50, screen)
    for step in (1, 1, 2):
        progress.show(row(step))
    progress.say("reward-0 exited with an error: exit 1")
    progress.end()
    line = progress_line
    expected = f"\r{line(row(1), 50)}\r{line(row(2), 50)}\nreward-0 exited with an error: exit 1\n\n"
    assert screen.getvalue() == expected
