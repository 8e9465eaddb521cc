"""A user's package that declares an environment and a reward function as entry points: every process finds the
names by itself — the learner's config check (``rl-learner resolve``) and a process that makes the environment as an
actor or reward worker does — with nothing imported first and no import path in the config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.plugin_dist import installed_plugin
from tests.helpers.stack import BIN, ROOT

MAKES_ONE = """
from asyncrl.common.environments.protocol import EpisodeRow, make_environment
env = make_environment("kv_lookup", {}, EpisodeRow(prompt="k", answer="", extra={"table": {"k": "v"}}))
env.step("v")
print(type(env).__module__, env.score())
"""


def test_entry_point_names_work_in_every_process(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(installed_plugin(tmp_path / "site"))}
    sets = ["environment.name=kv_lookup", 'reward.functions=[{name="exact_ok"}]', f"run.root={tmp_path}"]
    command = [BIN / "rl-learner", "resolve", ROOT / "configs/agent.toml", "--dry-run"]
    done = subprocess.run([*command, *(a for s in sets for a in ("--set", s))], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    typo = subprocess.run([*command, "--set", "environment.name=kv_lookpu"], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert typo.returncode == 2 and "kv_lookup" in typo.stderr, typo.stderr[-2000:]  # the known names include it
    made = subprocess.run([sys.executable, "-c", MAKES_ONE], env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and made.stdout.split() == ["kv_envs", "1.0"], made.stderr[-2000:]
