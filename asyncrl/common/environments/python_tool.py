"""Environments whose tools run code the model wrote: in the sandbox (``common/sandbox/``), with its fence and
limits, never in the process that hosts the environment."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from asyncrl.common.environments.protocol import OutOfTime, ToolEnvironment, function_spec
from asyncrl.common.sandbox import run_python

MAX_RESULT_CHARS = 2000
"""Characters of a program's output given back to the model."""


class PythonTool(ToolEnvironment):
    """Questions answered with a ``python`` tool::

        <tool_call>{"name": "python", "arguments": {"code": "print(37*48)"}}</tool_call>

    The code runs in the sandbox (no network, a private file system, CPU, memory and wall-clock limits: options
    ``cpu_s`` 2, ``memory_mb`` 256, ``wall_s`` 5); what it printed comes back, or ``error: …`` saying which limit it
    hit or the last line of its traceback. A program that runs out of time gets one text, whichever of its CPU and
    wall-clock limits it met first (which one does depends on the machine's load).

    The reward worker replays the episode and runs the code again. A program whose output changes from run to run (the
    time, random numbers) makes its episode refused as not what the environment gives. Time is the exception: an
    episode whose program ran out of time where the replay's did not is accepted (it told the model only that), and a
    replay whose program ran out of time where the episode's did not is tried again later."""

    def make_tools(self, options: dict[str, Any]) -> dict[str, Callable[[dict[str, Any]], str]]:
        limits = _limits(options)
        stop = out_of_time(limits)
        return {"python": lambda arguments: self._run(str(arguments.get("code", "")), limits, stop)}

    def time_limited(self, options: dict[str, Any]) -> dict[str, str]:
        return {"python": out_of_time(_limits(options))}

    @classmethod
    def tool_specs(cls, options: dict[str, Any]) -> list[dict[str, Any]]:
        about = "Run Python code in a sandbox (no network, no files of yours) and return what it prints."
        return [function_spec("python", about, code="the program; print what you want back")]

    @staticmethod
    def _run(code: str, limits: dict[str, Any], stop: str) -> str:
        result = run_python(code, **limits)
        if result.reason.startswith("timeout:"):
            return OutOfTime(stop)
        if not result.passed:
            return f"error: {result.reason}"[:MAX_RESULT_CHARS]
        return result.stdout[-MAX_RESULT_CHARS:].strip() or "(the program printed nothing)"


def _limits(options: dict[str, Any]) -> dict[str, Any]:
    """The sandbox limits the options set; the others keep :func:`run_python`'s defaults."""
    return {key: options[key] for key in ("cpu_s", "memory_mb", "wall_s") if key in options}


def out_of_time(limits: dict[str, Any]) -> str:
    """The tool's result for a program stopped by its CPU-time or wall-clock limit."""
    defaults = inspect.signature(run_python).parameters
    cpu_s, wall_s = (limits.get(key, defaults[key].default) for key in ("cpu_s", "wall_s"))
    return f"error: timeout: the program ran out of time (limits: {cpu_s} s of CPU, {wall_s} s of wall clock)"
