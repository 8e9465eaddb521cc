"""What one learner step leaves behind: a line of metrics.jsonl, the live telemetry, and the facts health judges.

:meth:`Recorder.record` builds the step's row from what the owners returned — ``train/*`` (the update), ``sync/*``
(the broadcaster), ``groups/*`` (the batch source), ``rollout/*`` (from the groups trained), ``step/*`` and, after
a resume, ``restore/*`` — lets the health monitor judge it (``health/*``), appends it to metrics.jsonl, and
publishes it to Prometheus, the Redis summary rl-top reads, and the active alerts.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from common.config import RunConfig
from common.control import ControlPlane
from common.logs import get_logger
from learner.alerts import ProcessFacts
from learner.batch import TrainBatch
from learner.batch_source import Taken
from learner.health import HealthMonitor
from learner.telemetry import StepTelemetry

log = get_logger("learner")


@dataclass
class StepRecord:
    """What one step did; one line of metrics.jsonl."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, prefix: str, figures: dict[str, float]) -> None:
        self.values.update({f"{prefix}/{k}": float(v) for k, v in figures.items()})


class Recorder:
    """metrics.jsonl, telemetry and health facts of one run's learner. Serves ``/metrics`` from construction on, so
    the endpoint is up while DeepSpeed starts."""

    def __init__(self, config: RunConfig, plane: ControlPlane) -> None:
        self.plane = plane
        self.metrics_path = config.run_dir / "metrics.jsonl"
        self.telemetry = StepTelemetry(plane, config)
        self.health: HealthMonitor | None = None  # set once the run state it rolls back exists
        self._lost: dict[str, str] = {}  # id → kind of processes whose heartbeat expired, ever (facts are cumulative)
        self._dead_at_start = plane.queue_depths()["dead_letters"]

    def record(self, version: int, started: float, taken: Taken, batch: TrainBatch, **parts: dict) -> StepRecord:
        """The row of step ``version``: ``parts`` are prefixed figures (``train=…, sync=…, restore=…``)."""
        record = StepRecord()
        for prefix, figures in parts.items():
            if figures:
                record.add(prefix, figures)
        record.add("rollout", rollout_figures(version, taken, batch))
        record.values |= taken.figures()
        record.values["step/seconds"] = time.perf_counter() - started
        record.values["step/idle_fraction"] = taken.waited_s / max(record.values["step/seconds"], 1e-9)
        # sampled once a step, for health and metrics
        queues, processes = self.plane.queue_depths(), self.plane.registry.processes()
        if self.health is not None:
            record.add("health", self.health.observe(version, record.values, self._facts(queues, processes)))
        self._write(version, record)
        self.telemetry.publish(record.values, queues, processes)
        if self.health is not None:
            self.plane.run.set_alerts(self.health.active_alerts())
        return record

    def _facts(self, queues: dict[str, int], processes: tuple) -> ProcessFacts:
        _, lost = processes
        self._lost.update(lost)
        dead = queues["dead_letters"] - self._dead_at_start
        return ProcessFacts(
            actors_lost=sum(kind == "actor" for kind in self._lost.values()),
            reward_errors=max(0, dead),
            lost=tuple(f"{pid} ({kind})" for pid, kind in sorted(self._lost.items())),
        )

    def _write(self, version: int, record: StepRecord) -> None:
        record.values.update({"step": float(version), "version": float(version), "time": time.time()})
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with Path(self.metrics_path).open("a") as f:
            f.write(json.dumps(record.values) + "\n")
        v = record.values
        log.info(
            "step",
            step=version,
            reward=round(v["rollout/reward_mean"], 3),
            loss=round(v["train/loss"], 4),
            staleness=v["rollout/staleness_max"],
            sync_s=round(v.get("sync/seconds", 0.0), 3),
            step_s=round(v["step/seconds"], 2),
        )


def rollout_figures(version: int, taken: Taken, batch: TrainBatch) -> dict[str, float]:
    """``rollout/*`` of the step that made ``version``: rewards, staleness (version − 1 − each token's version),
    tokens, and the groups from each actor."""
    staleness = (version - 1 - batch.versions[batch.response_mask]).float()
    generate = [e.group.rollout.timings.get("generate", 0.0) for e in taken.entries]
    tokens = int(batch.response_mask.sum())
    rewards = taken.rewards()
    by_actor = Counter(e.group.rollout.actor_id or "unknown" for e in taken.entries)
    return {
        **{f"groups_from/{actor}": float(n) for actor, n in sorted(by_actor.items())},
        "tokens_ahead": float((staleness[staleness < 0]).numel()),  # sampled by weights a resume discarded
        "reward_mean": float(rewards.mean()),  # over every response sampled, also when only pairs are trained
        "reward_std": float(rewards.std(ddof=1)) if rewards.size > 1 else 0.0,
        "staleness_max": float(staleness.max()) if tokens else 0.0,
        "staleness_mean": float(staleness.mean()) if tokens else 0.0,
        "tokens": float(tokens),
        "generate_s_mean": sum(generate) / len(generate),
    }
