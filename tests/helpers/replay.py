"""The replay stream under test: run ``test``'s keys and a writer's batch of synthetic scored groups. Shared by the
replay stream's integration tests."""

from __future__ import annotations

from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.plane.replay import ReplayWriter
from asyncrl.common.tiny_models import synthetic

KEYS = RunKeys("test")


def fill(client, n: int) -> list[str]:
    return ReplayWriter(client, KEYS).add([synthetic.scored_group(4, 32, seed=i) for i in range(n)])
