"""The one staleness rule of a run: how far behind the learner's policy a trained token may have been sampled.

Two notions of "the version" meet here, and each side reads the one it can see:

- the **learner's version** ``v``: optimizer steps applied so far (the step being trained is ``v + 1``). The
  dispatcher admits prompt groups by it and the learner judges arriving groups by it.
- the **published version** ``p``: the newest weights the learner has finished sending to the actors (the
  ``version`` key in Redis). An actor cannot see ``v`` — with a broadcast in flight ``p`` trails ``v`` by one —
  so it judges its own weights by ``p``.

With ``s = max_staleness`` and ``G = groups_per_step`` (the staleness-bounded admission of AReaL: Fu et al. 2025,
"AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning")::

    capacity(v)          = (s + v + 1) · G      groups released, not lost or discarded, while the learner is at v
    floor(v)             = v − s                the oldest token version a batch trained at v may hold
    may_generate(a, p)   = a ≥ p − s            an actor holding version a samples only while this holds
    sampling_version(r, c) = min(r, c)          a group released at r waits for these weights (c: the newest sent)

A group released at version v is among the first (s + v + 1)·G and, trained in release order, lands in a batch
no later than step v + s, whose floor is v: so it must be sampled with weights v or newer. The learner releases v's
groups as soon as it starts sending v (with ``weight_sync.overlap`` the transfer runs beside the next step), so an
actor still holding v − 1 waits for v before it samples such a group (``actors/rollout.py``: ``_weights_for``; not
when it refused v, which is not sent again) —
otherwise a large model, whose transfer takes seconds, has its actors fill the queue with groups the learner then
drops. With that, ``floor`` is rarely hit, and ``s = 0`` is exactly synchronous on-policy training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.common.config import RunConfig


@dataclass(frozen=True)
class StalenessBound:
    """``max_staleness`` versions at most between sampling and training; ``groups_per_step`` groups per version."""

    max_staleness: int
    groups_per_step: int

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.groups_per_step < 1:
            raise ValueError(f"need max_staleness >= 0 and groups_per_step >= 1, got {self}")

    @classmethod
    def of(cls, config: RunConfig) -> StalenessBound:
        """The bound of a run config (``staleness.max_staleness``, ``learner.groups_per_step``)."""
        return cls(config.staleness.max_staleness, config.learner.groups_per_step)

    def capacity(self, version: int) -> int:
        """How many groups may have been released (and not lost or discarded) while the learner is at ``version``."""
        return (self.max_staleness + version + 1) * self.groups_per_step

    def floor(self, version: int) -> int:
        """The oldest token version the learner at ``version`` still trains on (older groups are dropped)."""
        return version - self.max_staleness

    def may_generate(self, actor_version: int, published_version: int) -> bool:
        """Whether an actor holding ``actor_version`` may sample while ``published_version`` is the newest sent."""
        return actor_version >= published_version - self.max_staleness

    @staticmethod
    def sampling_version(issued_version: int, coming_version: int) -> int:
        """The weights a training group released at ``issued_version`` is sampled with (at least): those of its
        release, the floor of the latest batch it can land in — or, when the learner does not send that version
        (``weight_sync.sync_every``), the newest it is sending (``coming_version``)."""
        return min(issued_version, coming_version)

    @property
    def synchronous(self) -> bool:
        """``max_staleness = 0``: every batch comes from the weights being trained (no overlap is possible)."""
        return self.max_staleness == 0
