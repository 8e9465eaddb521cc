"""A user's package as pip leaves it on disk: the module and a ``.dist-info`` folder whose ``entry_points.txt``
declares asyncrl names. A folder holding both, put on ``sys.path`` (or ``PYTHONPATH``), is an installed
distribution to ``importlib.metadata`` — what the registries read."""

from __future__ import annotations

from pathlib import Path

MODULE = '''
from asyncrl.environments import EpisodeRow, Step


class KeyValueLookup:
    """Answer with the value the row's ``extra["table"]`` holds for the row's prompt."""

    def __init__(self, row: EpisodeRow, options: dict) -> None:
        self.value, self.right = row.extra.get("table", {}).get(row.prompt, ""), False

    def step(self, action: str) -> Step:
        self.right = action.strip() == self.value
        return Step(done=True)

    def score(self) -> float:
        return 1.0 if self.right else 0.0


def exact(group, options):
    return [1.0 if text.strip() == "ok" else 0.0 for text in group.texts]
'''
ENTRY_POINTS = """[asyncrl.environments]
kv_lookup = kv_envs:KeyValueLookup
python = kv_envs:KeyValueLookup

[asyncrl.rewards]
exact_ok = kv_envs:exact
"""


def installed_plugin(folder: Path) -> Path:
    """Write the package ``kv-envs`` into ``folder`` (its module and its metadata); returns ``folder``. It names the
    environment ``kv_lookup`` and the reward function ``exact_ok``, and also claims ``python``, a built-in name."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kv_envs.py").write_text(MODULE)
    meta = folder / "kv_envs-0.1.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: kv-envs\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text(ENTRY_POINTS)
    return folder
