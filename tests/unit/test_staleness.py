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
