"""What every command line shares: config loading with --set, finding the run's Redis, error exits."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

from common.logs import configure


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-paragraph error for a person (no traceback) and exit."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def load(config_path: Path | None, overrides: list[str] | None):
    """The validated run config, or a clear exit naming the bad field."""
    from common.config import ConfigError, load_config

    try:
        config = load_config(config_path, overrides or [])
    except ConfigError as exc:
        fail(str(exc))
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
