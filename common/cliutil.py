"""What every command line shares: config loading with --set, finding the run's Redis, error exits."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from common.logs import configure


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-paragraph error for a person (no traceback) and exit."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def load(config_path: Path | None, overrides: list[str] | None, check: Callable[[Any], None] | None = None):
    """The validated run config, or a clear exit (2) naming the bad field.

    ``check`` validates further what the command will use (e.g. the learner's algorithm options against its
    registries); a ``ValueError`` it raises exits the same way, before anything starts.
    """
    from common.config import ConfigError, load_config

    try:
        config = load_config(config_path, overrides or [])
    except ConfigError as exc:
        fail(str(exc))
    if check is not None:
        try:
            check(config)
        except ValueError as exc:  # ConfigError, or a registry's unknown name
            fail(f"invalid config: {exc}")
    configure(config.monitoring.log_level)
    return config


def redis_url(url: str | None, run: str, root: str = "runs") -> str:
    """``url`` if given, else the URL the run's embedded Redis wrote to ``<root>/<run>/redis/url``."""
    if url:
        return url
    url_file = Path(root) / run / "redis" / "url"
    if url_file.is_file():
        return url_file.read_text().strip()
    fail(f"no --redis given and no embedded Redis for run {run!r} ({url_file} is missing)")
