"""Every command line makes OpenMP wait passively before torch loads, and keeps an operator's own choice."""

from __future__ import annotations

import os

import pytest

from asyncrl.cli import actor as actor_cli
from asyncrl.cli import learner as learner_cli
from asyncrl.common.openmp import WAIT_POLICY, passive_waits


def test_passive_unless_the_operator_chose(monkeypatch) -> None:
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    passive_waits()
    assert os.environ[WAIT_POLICY] == "PASSIVE"
    monkeypatch.setenv(WAIT_POLICY, "ACTIVE")
    passive_waits()
    assert os.environ[WAIT_POLICY] == "ACTIVE"


@pytest.mark.parametrize("cli", [learner_cli, actor_cli], ids=["rl-learner", "rl-actor"])
def test_each_command_line_sets_it_before_its_command_runs(cli, monkeypatch) -> None:
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    seen = []
    monkeypatch.setattr(cli, "app", lambda: seen.append(os.environ.get(WAIT_POLICY)))
    monkeypatch.setattr(os, "umask", lambda mask: 0o022)  # rl-learner's private umask: not this process's
    cli.main()
    assert seen == ["PASSIVE"]
