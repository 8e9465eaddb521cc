"""The one staleness rule, with the arithmetic in comments (AReaL's admission bound)."""

from __future__ import annotations

import pytest

from asyncrl.common.config import load_config
from asyncrl.common.staleness import StalenessBound


def test_capacity_floor_and_may_generate_by_hand() -> None:
    bound = StalenessBound(max_staleness=2, groups_per_step=8)
    assert bound.capacity(0) == 24  # (2 + 0 + 1) × 8: the first three batches may be in flight at once
    assert bound.capacity(5) == 64  # (2 + 5 + 1) × 8
    assert bound.floor(5) == 3  # 5 − 2: at version 5, tokens of versions 3, 4 and 5 are still trained
    assert bound.may_generate(actor_version=3, published_version=5)  # 3 ≥ 5 − 2
    assert not bound.may_generate(actor_version=2, published_version=5)  # behind: it would make stale groups
    assert not bound.synchronous


def test_a_group_waits_for_the_weights_of_its_release_when_they_are_sent() -> None:
    """max_staleness 1, 4 groups a step: the 4 groups released at version 1 (capacity(1) = 12, 8 released before)
    are trained at step 3 at the latest, by the learner at version 2, whose floor is 1: sampled with version 0 they
    would be dropped. The learner releases them while it sends version 1, so an actor still on 0 waits for 1."""
    bound = StalenessBound(max_staleness=1, groups_per_step=4)
    assert bound.capacity(1) == 12 and bound.floor(2) == 1
    assert bound.may_generate(actor_version=0, published_version=1)  # the actor may sample: it is not behind...
    assert bound.sampling_version(issued_version=1, coming_version=1) == 1  # ...but this group waits for version 1
    assert bound.sampling_version(issued_version=1, coming_version=3) == 1  # a re-issued group: its own release
    # weight_sync.sync_every = 2: version 3 is never sent, so the group waits for the newest coming, 2, not for 3
    assert bound.sampling_version(issued_version=3, coming_version=2) == 2


def test_max_staleness_zero_is_synchronous() -> None:
    bound = StalenessBound(max_staleness=0, groups_per_step=4)
    assert bound.synchronous
    assert bound.capacity(3) == 16  # (0 + 3 + 1) × 4: exactly the batches up to and including step 4's
    assert bound.floor(3) == 3 and bound.may_generate(3, 3) and not bound.may_generate(2, 3)


def test_of_a_config_and_bad_values() -> None:
    config = load_config(None, ["staleness.max_staleness=1", "learner.groups_per_step=16"])
    assert StalenessBound.of(config) == StalenessBound(1, 16)
    with pytest.raises(ValueError):
        StalenessBound(-1, 8)
    with pytest.raises(ValueError):
        StalenessBound(0, 0)
