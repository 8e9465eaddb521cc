"""``rl-actor``: rollout actors and reward workers. Heavy libraries are imported inside commands only."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="asyncrl actors: rollout and reward workers.")

RedisOpt = Annotated[str | None, typer.Option(help="Redis URL of the run (default: the run's embedded Redis).")]
RunOpt = Annotated[str, typer.Option(help="Run name.")]


@app.callback()
def _group() -> None:
    """asyncrl actors: rollout and reward workers."""


@app.command("show-config")
def show_config(redis: RedisOpt = None, run: RunOpt = "demo") -> None:
    """Print the run config this process would work from, read from the run's Redis."""
    from common.cliutil import fail, redis_url
    from common.control import ControlPlane, RunNotFoundError, connect

    try:
        config = ControlPlane(connect(redis_url(redis, run)), run).read_config()
    except RunNotFoundError as exc:
        fail(str(exc))
    print(config.to_json())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
