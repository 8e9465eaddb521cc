"""A run that cannot fit its model is refused by the commands a user starts, before any process or server starts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from asyncrl.common.data.tasks import TASK_ALPHABET
from asyncrl.common.tiny_models.character import init_model
from tests.helpers.stack import BIN, ROOT

pytestmark = pytest.mark.integration


def test_rl_launch_refuses_a_max_model_len_beyond_the_models_context_before_starting_anything(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", alphabet=TASK_ALPHABET, max_position=256)
    sets = [f"run.root={tmp_path / 'runs'}", "run.name=long", f"model.path={model}", "model.max_model_len=1024"]
    command = [BIN / "rl-launch", "run", ROOT / "configs/demo.toml", *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.max_model_len = 1024" in lines[0] and "at most 256" in lines[0], lines
    assert not (tmp_path / "runs" / "long" / "redis").exists()  # no server was started
