"""What every command line shares: config loading with --set, finding the run's Redis, error exits."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from asyncrl.common.exit_codes import ExitCode
from asyncrl.common.observability.logs import configure


def fail(message: str, code: int = ExitCode.REFUSED) -> NoReturn:
    """Print a one-paragraph error for a person (no traceback) and exit."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def crash(exc: BaseException) -> NoReturn:
    """Exit 1 after an error no command handled, written once for a person and for ``rl-launch``
    (``cli/children.py: root_cause``): its traceback, each exception it was raised from as one line saying where
    (not a traceback of its own), then ``error: Type: message`` on one line, last. Plain text, written here rather than
    by ``sys.excepthook``: Typer's hook draws a panel that wraps the message at the terminal's width, and
    ``torch.distributed`` wraps the hook to put ``[rank0]: `` before every line."""
    lines = ["Traceback (most recent call last):\n", *traceback.extract_tb(exc.__traceback__).format()]
    for cause in _raised_from(exc):
        frames = traceback.extract_tb(cause.__traceback__)
        where = f" ({frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
        lines.append(f"raised from {_one_line(cause)}{where}\n")
    lines.append(f"error: {_one_line(exc)}\n")
    sys.stderr.write("".join(lines))
    sys.stderr.flush()
    raise SystemExit(1)


def _raised_from(exc: BaseException, most: int = 8) -> list[BaseException]:
    """The exceptions ``exc`` was raised from or while handling, nearest first (as Python would print them)."""
    chain: list[BaseException] = []
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while cause is not None and len(chain) < most and all(cause is not seen for seen in chain):
        chain.append(cause)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return chain


def _one_line(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def load(config_path: Path | None, overrides: list[str] | None, check: Callable[[Any], None] | None = None):
    """The validated run config, or a clear exit (2) naming the bad field.

    ``check`` validates further what the command will use (e.g. the learner's algorithm options against its
    registries); a ``ValueError`` it raises exits the same way, before anything starts.
    """
    from asyncrl.common.config import ConfigError, load_config

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


REDIS_URL_ENV = "ASYNCRL_REDIS_URL"
"""Environment variable with the run's Redis URL (password included): how a launcher or a pod hands it over."""
REDIS_URL_FILE_ENV = "ASYNCRL_REDIS_URL_FILE"
"""Environment variable naming a file that holds the URL (e.g. a mounted Kubernetes Secret)."""


def given_redis_url(url: str | None, url_file: Path | None) -> str | None:
    """The Redis URL a person or launcher gave, from the first of: ``--redis``, ``--redis-url-file``,
    ``$ASYNCRL_REDIS_URL``, ``$ASYNCRL_REDIS_URL_FILE``; None when none is.

    ``--redis`` with a password works but puts the password in the process's command line, which every local
    user can read (``ps``); the launcher never does that, and a warning says what to use instead.
    """
    if url:
        if _has_password(url):
            print(
                "warning: --redis puts the Redis password in this process's command line (ps shows it); "
                f"use --redis-url-file FILE (mode 0600) or ${REDIS_URL_ENV} instead",
                file=sys.stderr,
            )
        return url
    if url_file is not None:
        return _read_url_file(url_file)
    if os.environ.get(REDIS_URL_ENV):
        return os.environ[REDIS_URL_ENV]
    if os.environ.get(REDIS_URL_FILE_ENV):
        return _read_url_file(Path(os.environ[REDIS_URL_FILE_ENV]))
    return None


def _read_url_file(path: Path) -> str:
    try:
        url = path.read_text().strip()
    except OSError as exc:
        fail(f"cannot read the Redis URL file {path}: {exc.strerror}")
    if not url:
        fail(f"the Redis URL file {path} is empty")
    return url


def redis_url(url: str | None, run: str, root: str = "runs", url_file: Path | None = None) -> str:
    """The run's Redis URL (:func:`given_redis_url`), else the one its embedded Redis wrote to
    ``<root>/<run>/redis/url``."""
    if given := given_redis_url(url, url_file):
        return given
    embedded = Path(root) / run / "redis" / "url"
    if embedded.is_file():
        return embedded.read_text().strip()
    fail(
        f"no Redis URL for run {run!r}: give --redis-url-file FILE or ${REDIS_URL_ENV}, or start the run's "
        f"embedded Redis ({embedded} is missing)"
    )


RedisOpt = Annotated[
    str | None,
    typer.Option(help="Redis URL of the run. ps shows it: with a password use --redis-url-file or ASYNCRL_REDIS_URL."),
]
RedisFileOpt = Annotated[
    Path | None,
    typer.Option("--redis-url-file", help="File holding the run's Redis URL (0600; e.g. a mounted Secret)."),
]


def _has_password(url: str) -> bool:
    from urllib.parse import urlsplit

    return bool(urlsplit(url).password)


def listed_briefly(app: typer.Typer) -> typer.Typer:
    """``app`` with each command listed in its ``--help`` by the first clause of its docstring (up to the first
    ``. `` or ``: ``); ``COMMAND --help`` still shows the whole. Typer lists the whole docstring otherwise."""
    for command in app.registered_commands:
        doc = " ".join((command.help or (command.callback.__doc__ if command.callback else None) or "").split())
        if command.short_help is None and doc:
            cut = min((i for i in (doc.find(". "), doc.find(": ")) if i > 0), default=len(doc))
            command.short_help = doc[:cut].rstrip(".")
    return app


def bin_path(command: str) -> str:
    """A console script of this environment (``rl-actor``, ``torchrun``…): beside the Python that runs this command.
    A process started on another node (a Slurm step, a Ray actor) needs the environment at the same path there."""
    return str(Path(sys.executable).parent / command)
