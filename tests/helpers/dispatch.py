"""A dispatcher under test, as the learner builds one: a small run config, a stand-in tokenizer, and a live actor's
heartbeat in the run's registry. Shared by the dispatcher's integration tests."""

from __future__ import annotations

from asyncrl.common.config import RunConfig, load_config
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.wire.messages import Heartbeat
from asyncrl.learner.intake.dispatcher import Dispatcher

RUN = "disp"


def encode(text: str) -> list[int]:
    """A stand-in for the tokenizer: BOS (1), then one id per character."""
    return [1] + [ord(c) % 50 + 4 for c in text]


def make_config(max_staleness: int = 0, groups_per_step: int = 4, run: str = RUN) -> RunConfig:
    return load_config(
        None,
        [
            f"run.name={run}",
            "run.seed=7",
            f"staleness.max_staleness={max_staleness}",
            f"learner.groups_per_step={groups_per_step}",
            "rollout.num_samples=3",
        ],
    )


def make_dispatcher(client, config: RunConfig) -> Dispatcher:
    return Dispatcher(config, ControlPlane(client, config.run.name), encode)


def actor(plane: ControlPlane, process_id: str, ttl_s: float = 30.0) -> None:
    plane.registry.beat(Heartbeat(process_id=process_id, kind="actor", state="generating"), ttl_s=ttl_s)
