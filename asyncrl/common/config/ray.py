"""The ``[ray]`` section: how ``rl-launch ray`` places a run on a Ray cluster (``cli/ray_launch.py``). Ray only places
and watches processes: the run's own data plane (Redis, ZeroMQ) carries everything, as on one machine. One placement
group holds the run's head — Redis, the learner's ranks and the reward workers, on one node; each rollout actor is a
Ray actor of its own, spread over the nodes that have its resources. Flags of ``rl-launch ray`` override these
fields one for one."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator

from asyncrl.common.config.base import Int, Section

RESOURCE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,63}$")
Amount = Annotated[float, Field(ge=0.0, le=1e6, allow_inf_nan=False)]
"""An amount of a Ray resource (a node declares its custom ones with ``ray start --resources``)."""


class RaySection(Section):
    address: str = Field(default="auto", min_length=1, max_length=512)
    """The cluster (``ray.init``'s address): ``auto``, the cluster this host is a node of; ``HOST:PORT`` of its
    head; or ``ray://HOST:10001`` through Ray Client."""
    actors: Int = Field(default=2, ge=0, le=4096)
    """Rollout actors, each a Ray actor of its own, spread over the nodes that have their resources."""
    rewards: Int = Field(default=1, ge=0, le=256)
    """Reward workers, beside the learner on the head's node."""
    learner_ranks: Int = Field(default=1, ge=1, le=64)
    """Learner ranks (``torchrun --nproc-per-node``), on the head's node."""
    gpus: bool = False
    """Ask Ray for GPUs: one per learner rank, ``rollout.tensor_parallel_size`` per rollout actor. Off: CPUs only."""
    head_cpus: float = Field(default=1.0, ge=0.0, le=4096.0)
    """CPUs the head's placement group reserves (Redis, the learner, the reward workers)."""
    actor_cpus: float = Field(default=1.0, ge=0.0, le=4096.0)
    """CPUs each rollout actor reserves."""
    head_resources: dict[str, Amount] = Field(default_factory=dict)
    """More resources the head's bundle needs (custom ones, e.g. ``{learner_node = 1}``, to put it on a kind of
    node)."""
    actor_resources: dict[str, Amount] = Field(default_factory=dict)
    """More resources each rollout actor needs (custom ones, e.g. ``{rollout_node = 1}``)."""
    max_restarts: Int = Field(default=3, ge=0, le=1000)
    """How often Ray starts a rollout actor again, on another node, after its node died (``max_restarts``)."""

    @field_validator("head_resources", "actor_resources")
    @classmethod
    def _resources(cls, resources: dict[str, Amount]) -> dict[str, Amount]:
        for name in resources:
            if not RESOURCE_NAME.match(name):
                raise ValueError(f"{name!r}: a resource is named with letters, digits and _.:- (ray start --resources)")
            if name in ("CPU", "GPU"):
                raise ValueError(f"{name}: set ray.gpus, ray.head_cpus or ray.actor_cpus for CPUs and GPUs")
        return resources
