"""The building blocks of every config section: :class:`Section` (unknown fields refused, values checked as they
are assigned), the value types and bounds the sections share, and :func:`check_values`, which refuses what no
setting can hold (non-finite numbers, nesting deeper than :data:`MAX_DEPTH`) anywhere in a config."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Strict,
)


class ConfigError(ValueError):
    """A config that cannot be used; the message names each bad field and what is allowed."""


Int = Annotated[int, Strict()]
"""An integer setting: ``true`` is not a count and ``1e9`` (a TOML float) is not an integer, so both are refused."""


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a number is needed, not true or false")
    return value


ZeroStage = Annotated[Literal[0, 1, 2, 3], BeforeValidator(_not_a_bool)]
"""A DeepSpeed ZeRO stage (``true`` would pass as stage 1)."""

WEEK_S = 7 * 24 * 3600
"""Upper bound of every time limit in seconds: a process never waits longer than this for anything."""
MAX_STEPS = 10_000_000
"""Upper bound of step counts and periods in steps."""
MAX_TOKENS = 2**24
"""Upper bound of token lengths (16M: beyond the longest context of any released model)."""
MAX_SEED = 2**32 - 1
"""Largest seed (NumPy's bound; actors add their process id to it)."""
MAX_DEPTH = 32
"""Deepest nesting of tables and arrays in a config (free-form option tables included)."""
MAX_CONFIG_BYTES = 16 * 2**20
"""Largest config file read."""
GROUP_BASELINE_ADVANTAGES = frozenset({"grpo", "dr_grpo", "rloo"})
"""Advantage estimators whose baseline is the response's own group: a group of one response has advantage 0."""


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )


def check_values(value: Any, where: list[str], prefix: str = "invalid config: ") -> None:
    """Refuse tables and arrays nested deeper than :data:`MAX_DEPTH` and non-finite numbers anywhere in ``value``
    (free-form option tables included: JSON has no infinity, so one would reach other processes as null). Iterative,
    so that no nesting depth can exhaust the stack; the error names the setting (the first levels of its path)."""
    stack: list[tuple[Any, list[str]]] = [(value, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise ConfigError(f"{prefix}{dotted(path)}: {node} is not a finite number; give a finite value")
        if not isinstance(node, (dict, list)):
            continue
        if len(path) >= MAX_DEPTH:  # the whole config is the first level
            raise ConfigError(
                f"{prefix}{dotted(path[: max(2, len(where))])}: nested more than {MAX_DEPTH} levels deep (tables "
                "and arrays); flatten it"
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((child, [*path, str(key)]) for key, child in items)


def dotted(path: list[str]) -> str:
    return ".".join(path) or "(top level)"
