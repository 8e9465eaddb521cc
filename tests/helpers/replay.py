"""The replay stream under test: run ``test``'s keys and a writer's batch of synthetic scored groups. Shared by the
replay stream's integration tests."""

from __future__ import annotations

from common import synthetic
from common.keys import RunKeys
from common.replay import ReplayWriter

KEYS = RunKeys("test")


def fill(client, n: int) -> list[str]:
    return ReplayWriter(client, KEYS).add([synthetic.scored_group(4, 32, seed=i) for i in range(n)])
