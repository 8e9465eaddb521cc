"""Function calls in a model's turn, in the format Qwen2.5 and Hermes chat templates teach their models.

A call is a JSON object with ``name`` and ``arguments`` between ``<tool_call>`` and ``</tool_call>``::

    <tool_call>{"name": "calc", "arguments": {"expression": "37*48"}}</tool_call>

:func:`parse_tool_calls` returns every well-formed call and, for each malformed one, why it is malformed (unclosed
tag, not JSON, no name, arguments that are not an object): an environment answers a malformed call with an error
observation and counts it — it never raises on what a model wrote.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedCalls:
    calls: list[ToolCall]
    errors: list[str]
    """Why each malformed call was refused, in order of appearance."""

    @property
    def any(self) -> bool:
        return bool(self.calls or self.errors)


def parse_tool_calls(text: str) -> ParsedCalls:
    """The calls in ``text`` and the reasons its malformed ones were refused."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith(CLOSE):
            errors.append(f"a {OPEN} without {CLOSE}")
            continue
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"not JSON ({exc.msg} at character {exc.pos})")
            continue
        except RecursionError:
            errors.append("nested too deeply")
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            errors.append('not an object with a "name" string')
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some templates write the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            errors.append(f'"arguments" of {value["name"]!r} is not an object')
            continue
        calls.append(ToolCall(value["name"], arguments))
    return ParsedCalls(calls, errors)
