"""vLLM's per-version routine lines are dropped at INFO in an actor's vLLM processes, and nothing else is."""

from __future__ import annotations

import logging

from asyncrl.actors.lifeline import ACTOR_PID_ENV
from asyncrl.actors.vllm_logs import RoutineLines, quiet_routine_lines


def record(msg: str, level: int = logging.INFO, *args) -> logging.LogRecord:
    return logging.LogRecord("vllm.v1.core.sched.scheduler", level, __file__, 1, msg, args, None)


def test_the_routine_lines_are_dropped_at_info_only() -> None:
    lines = RoutineLines()
    assert not lines.filter(record("setting pause state to %s", logging.INFO, "PAUSED_ALL"))
    assert not lines.filter(record("Reloading and processing weights took %.2f seconds", logging.INFO, 0.01))
    assert lines.filter(record("setting pause state to %s", logging.DEBUG, "UNPAUSED"))
    assert lines.filter(record("Reloading and processing weights took %.2f seconds", logging.WARNING, 9.0))
    assert lines.filter(record("Automatically detected platform %s.", logging.INFO, "cpu"))


def test_the_plugin_filters_vllms_handlers_once_and_only_in_an_actors_process(monkeypatch) -> None:
    handler = logging.StreamHandler()
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        monkeypatch.delenv(ACTOR_PID_ENV, raising=False)
        quiet_routine_lines()
        assert not handler.filters
        monkeypatch.setenv(ACTOR_PID_ENV, "1234")
        quiet_routine_lines()
        quiet_routine_lines()  # vLLM may load plugins more than once in a process
        assert [type(f) for f in handler.filters] == [RoutineLines]
    finally:
        logger.removeHandler(handler)


def test_vllm_finds_the_plugin_in_the_installed_package() -> None:
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("asyncrl_routine_lines") == "asyncrl.actors.vllm_logs:quiet_routine_lines", plugins
