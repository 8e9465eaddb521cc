"""``rl-learner``: the learner's command line. Heavy libraries are imported inside commands only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="asyncrl learner: owns the run.")

ConfigArg = Annotated[Path | None, typer.Argument(help="Run config (TOML); defaults apply when omitted.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value.")]


@app.command()
def resolve(
    config: ConfigArg = None,
    set_: SetOpt = None,
    redis: Annotated[str | None, typer.Option(help="Also publish the resolved config to this Redis URL.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and print only; write nothing.")] = False,
) -> None:
    """Validate a config, write runs/<name>/config.json and (with --redis) publish it for actors."""
    from common.cliutil import load
    from common.config import write_resolved

    resolved = load(config, set_)
    print(resolved.to_json())
    if dry_run:
        return
    path = write_resolved(resolved)
    typer.echo(f"wrote {path}", err=True)
    if redis:
        from common.control import ControlPlane, connect

        ControlPlane(connect(redis), resolved.run.name).publish_config(resolved)
        typer.echo(f"published to {redis.split('@')[-1]} as run {resolved.run.name!r}", err=True)


@app.command()
def fields(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON rows.")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a Markdown table (the README's).")] = False,
) -> None:
    """Print the config reference: every field, its default and its meaning."""
    from common.config import field_help

    rows = field_help()
    if as_json:
        print(json.dumps([{"field": n, "default": d, "help": h} for n, d, h in rows], indent=1))
        return
    if markdown:
        print("| field | default | meaning |\n| --- | --- | --- |")
        for name, default, doc in rows:
            escaped = doc.replace("|", r"\|")
            print(f"| `{name}` | `{default}` | {escaped} |")
        return
    for name, default, doc in rows:
        print(f"{name} = {default}\n    {doc}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
