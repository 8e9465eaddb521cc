"""Environments whose tools run code the model wrote: in the sandbox (``common/rewards/sandbox.py``), with its fence and
limits, never in the process that hosts the environment."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from asyncrl.common.environments.protocol import ToolEnvironment, function_spec
from asyncrl.common.rewards.sandbox import run_python

MAX_RESULT_CHARS = 2000
"""Characters of a program's output given back to the model."""
_USED = re.compile(r" \([0-9.]+ s used\)$")


class PythonTool(ToolEnvironment):
    """Questions answered with a ``python`` tool::

        <tool_call>{"name": "python", "arguments": {"code": "print(37*48)"}}</tool_call>

    The code runs in the sandbox (no network, a private file system, CPU, memory and wall-clock limits: options
    ``cpu_s`` 2, ``memory_mb`` 256, ``wall_s`` 5); what it printed comes back, or ``error: …`` saying which limit it
    hit or the last line of its traceback. The reward worker replays the episode and runs the code again: a program
    whose output changes from run to run (the time, random numbers) makes its episode refused as not what the
    environment gives."""

    def make_tools(self, options: dict[str, Any]) -> dict[str, Callable[[dict[str, Any]], str]]:
        limits = {key: options[key] for key in ("cpu_s", "memory_mb", "wall_s") if key in options}
        return {"python": lambda arguments: self._run(str(arguments.get("code", "")), limits)}

    @classmethod
    def tool_specs(cls, options: dict[str, Any]) -> list[dict[str, Any]]:
        about = "Run Python code in a sandbox (no network, no files of yours) and return what it prints."
        return [function_spec("python", about, code="the program; print what you want back")]

    @staticmethod
    def _run(code: str, limits: dict[str, Any]) -> str:
        result = run_python(code, **limits)
        if not result.passed:  # without the measured CPU time: the reward worker's replay must get the same text
            return f"error: {_USED.sub('', result.reason)}"[:MAX_RESULT_CHARS]
        return result.stdout[-MAX_RESULT_CHARS:].strip() or "(the program printed nothing)"
