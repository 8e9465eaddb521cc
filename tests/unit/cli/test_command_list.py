"""``--help`` of a command group lists each command by its first clause; the command's own ``--help`` keeps it all."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from asyncrl.cli.learner import app as learner_app
from asyncrl.cli.util import listed_briefly


def test_each_command_is_listed_by_its_first_clause() -> None:
    app = typer.Typer()

    @app.command()
    def check(name: str = "x") -> None:
        """Check the thing before anything starts: the folder loads, the sizes fit. Exit 2 otherwise."""

    @app.command()
    def train() -> None:
        """Train it. Then stop."""

    listed = CliRunner().invoke(listed_briefly(app), ["--help"], env={"COLUMNS": "200"}).output
    assert "Check the thing before anything starts" in listed and "the folder loads" not in listed
    assert "Train it" in listed and "Then stop" not in listed
    whole = CliRunner().invoke(app, ["check", "--help"], env={"COLUMNS": "200"}).output
    assert "the folder loads, the sizes fit" in whole


def test_the_learners_command_list_fits_a_screen() -> None:
    listed = CliRunner().invoke(listed_briefly(learner_app), ["--help"], env={"COLUMNS": "100"}).output
    assert len(listed.splitlines()) <= 30, listed
