"""No command line shows the Redis password: every command that takes ``--redis URL`` also takes
``--redis-url-file FILE`` (and ``$ASYNCRL_REDIS_URL``), and the README's commands use those, never a URL in argv."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import typer

ROOT = Path(__file__).resolve().parents[3]


def options(command: click.Command, path: str = "") -> dict[str, set[str]]:
    """{command path: its option strings}, for ``command`` and every subcommand."""
    found = {path or "(top)": {opt for param in command.params for opt in getattr(param, "opts", [])}}
    for name, sub in getattr(command, "commands", {}).items():
        found |= options(sub, f"{path} {name}".strip())
    return found


@pytest.mark.parametrize(
    "module",
    ["asyncrl.cli.learner", "asyncrl.cli.launch", "asyncrl.cli.actor", "asyncrl.cli.top"],
)
def test_every_command_that_takes_a_url_takes_a_url_file(module: str) -> None:
    app = __import__(module, fromlist=["app"]).app
    commands = options(typer.main.get_command(app))
    taking_url = {name for name, opts in commands.items() if "--redis" in opts}
    assert all("--redis-url-file" in commands[name] for name in taking_url), commands
    if module != "asyncrl.cli.launch":  # the launcher starts its own Redis and hands its children the URL file
        assert taking_url, f"{module}: no command takes --redis"


def test_the_docs_never_put_a_redis_url_in_a_command_line() -> None:
    docs = "\n".join(path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    blocks = "\n".join(re.findall(r"```(?:bash|sh)?\n(.*?)```", docs, flags=re.DOTALL))
    assert "--redis-url-file runs/demo/redis/url" in blocks  # the by-hand learner of the demo
    assert not re.search(r"--redis[ =]+[\"']?(\$\(|redis://)", blocks), "a URL (password and all) in argv: ps shows it"
