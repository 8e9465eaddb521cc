"""``rl-launch``: one machine, one command. Starts the run's embedded Redis (and, as they land,
the learner, rollout actors and reward workers as child processes) and stops them all on Ctrl-C."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="asyncrl local launcher.")


@app.callback()
def _group() -> None:
    """asyncrl local launcher."""


@app.command()
def redis(
    config: Annotated[Path | None, typer.Argument(help="Run config (TOML).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value.")] = None,
) -> None:
    """Start the run's embedded Redis, publish the resolved config, and serve until Ctrl-C."""
    from common.cliutil import fail, load
    from common.config import write_resolved
    from common.control import ControlPlane, connect
    from common.redis_server import EmbeddedRedis, EmbeddedRedisError

    resolved = load(config, set_)
    write_resolved(resolved)
    try:
        server = EmbeddedRedis(resolved.run_dir / "redis").start()
    except EmbeddedRedisError as exc:
        fail(str(exc))
    try:
        ControlPlane(connect(server.url), resolved.run.name).publish_config(resolved)
        typer.echo(
            f"run {resolved.run.name!r}: redis at 127.0.0.1:{server.port} "
            f"(URL with password in {server.directory / 'url'}); Ctrl-C stops it",
            err=True,
        )
        _wait_for_stop_signal()
    finally:
        server.stop()


def _wait_for_stop_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
