"""An actor that refused a version (its buckets did not match their digests) does not wait for that version again
before it samples: the learner sends each version once, and with one actor the next version needs a step that needs
this actor's groups."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from asyncrl.actors.rollout import RolloutActor
from asyncrl.actors.weights_follower import WeightsFollower


class Trail:
    """The audit trail's part the follower writes to: what it recorded."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def record(self, event: str, /, **fields) -> None:
        self.events.append((event, fields))


def follower_serving(version: int) -> WeightsFollower:
    follower = WeightsFollower(None, None, "", "a1", Trail())  # type: ignore[arg-type]  # only the refusal is used
    follower.version = version
    return follower


def test_a_refused_version_is_no_longer_coming_and_the_next_one_is() -> None:
    follower = follower_serving(29)
    assert follower.coming(30) and follower.coming(31)
    follower._refuse(SimpleNamespace(version=30, digest="d30"), "bucket 0: digest mismatch")  # type: ignore[arg-type]
    assert follower.version == 29 and follower.refused == 30  # the old weights go on serving
    assert not follower.coming(29) and not follower.coming(30)
    assert follower.coming(31)
    actor = SimpleNamespace(weights=follower)  # what the actor's wait before sampling reads
    assert not RolloutActor._awaits(actor, 30)  # type: ignore[arg-type]  # a group released at 30: sampled with 29
    assert RolloutActor._awaits(actor, 31)  # type: ignore[arg-type]
    assert follower.audit.events == [  # type: ignore[attr-defined]
        ("weights.refused", {"version": 30, "digest": "d30", "reason": "bucket 0: digest mismatch"})
    ]


class LoadingEngine:
    """The follower's engine when a broadcast loads: the weights go in, then generation resumes."""

    async def update_weights(self, frames, join, version, buckets, on_loaded) -> dict:
        on_loaded()
        return {}


def test_a_version_loaded_after_a_refusal_clears_it() -> None:
    """After a load, no refusal stands: older ones are moot, and one at or above the loaded version means the learner
    restored a checkpoint and sends those versions anew, which the actor waits for again."""
    follower = follower_serving(29)
    follower._refuse(SimpleNamespace(version=30, digest="d30"), "bucket 0: digest mismatch")  # type: ignore[arg-type]
    follower.epoch = 1  # a member of the formation: the load joins nothing
    manifest = SimpleNamespace(version=28, group_epoch=1, restore=1, digest="d28", buckets=[])  # restored, resent
    asyncio.run(follower._load(LoadingEngine(), manifest, [], failed=lambda exc: None))  # type: ignore[arg-type]
    assert (follower.version, follower.refused) == (28, 0)
    assert follower.coming(29) and follower.coming(30)
