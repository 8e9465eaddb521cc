"""The learner's telemetry: each step's metrics.jsonl row into Prometheus series and a summary in Redis.

The learner's recorder needs two lines::

    self.telemetry = StepTelemetry(self.plane, config)   # serves /metrics, heartbeats its URL (kind learner)
    self.telemetry.publish(record.values)                 # after the row is written

``publish`` updates the ``asyncrl_learner_*`` series (see ``common/observability/metrics.py``), samples the queue depths
and the process registry (a few Redis round trips per step), and writes a compact summary of the step to
``asyncrl:<run>:summary`` for ``rl-top``. Telemetry never stops training: a Redis error here is logged and the step goes
on (the loop's own Redis calls fail loudly anyway when Redis is really gone).
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Mapping
from typing import Any

from asyncrl.common.config import RunConfig
from asyncrl.common.net import advertise_host
from asyncrl.common.observability import metrics as m
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.heartbeat import HeartbeatThread
from asyncrl.common.wire.messages import Heartbeat
from asyncrl.learner.checkpoint.disk import disk_space
from asyncrl.learner.intake.autoscale import ActorDemand

log = get_logger("telemetry")

RESPONSE_STATISTICS = ("mean", "p50", "p95", "max")
GPU_MEMORY_KINDS = ("allocated", "reserved", "peak", "total", "used")
LATENCY_STAGES = ("queued", "generate", "scoring", "replay", "total")
"""The stages of ``latency/*`` (learner/record/recorder.py: latency_figures), exported by stage."""
# metrics.jsonl key -> (gauge, labels). Keys a step did not compute leave their series absent.
GAUGES: dict[str, tuple[Any, dict[str, str]]] = {
    "rollout/reward_mean": (m.LEARNER_REWARD, {"statistic": "mean"}),
    "rollout/reward_std": (m.LEARNER_REWARD, {"statistic": "std"}),
    "train/loss/kl_ref": (m.LEARNER_KL, {"kl": "reference"}),
    "train/offpolicy/mismatch_kl": (m.LEARNER_KL, {"kl": "mismatch"}),
    "train/kl_reward/kl": (m.LEARNER_KL, {"kl": "reward"}),
    "train/loss/approx_kl": (m.LEARNER_KL, {"kl": "update"}),
    "train/loss/entropy": (m.LEARNER_ENTROPY, {"statistic": "mean"}),
    "train/loss/clip_frac": (m.LEARNER_CLIPPED_RATIO, {"clip": "ppo"}),
    "train/loss/dual_clip_frac": (m.LEARNER_CLIPPED_RATIO, {"clip": "dual"}),
    "train/offpolicy/dropped_frac": (m.LEARNER_CLIPPED_RATIO, {"clip": "mismatch_guard"}),
    "train/offpolicy/behaviour_clip_frac": (m.LEARNER_CLIPPED_RATIO, {"clip": "behaviour"}),
    "train/grad_norm": (m.LEARNER_GRAD_NORM, {"model": "policy"}),
    "train/critic/grad_norm": (m.LEARNER_GRAD_NORM, {"model": "critic"}),
    "train/loss": (m.LEARNER_LOSS, {"model": "policy"}),
    "train/critic/loss": (m.LEARNER_LOSS, {"model": "critic"}),
    "rollout/staleness_max": (m.LEARNER_STALENESS, {"statistic": "max"}),
    "rollout/staleness_mean": (m.LEARNER_STALENESS, {"statistic": "mean"}),
    **{f"rollout/response_tokens_{s}": (m.LEARNER_RESPONSE_LENGTH, {"statistic": s}) for s in RESPONSE_STATISTICS},
    **{f"rollout/prompt_tokens_{s}": (m.LEARNER_PROMPT_LENGTH, {"statistic": s}) for s in ("mean", "max")},
    "rollout/truncated_frac": (m.LEARNER_TRUNCATED_RATIO, {}),
    **{f"latency/{stage}_s": (m.LEARNER_GROUP_STAGE, {"stage": stage}) for stage in LATENCY_STAGES},
    **{f"gpu/memory_{kind}_bytes": (m.LEARNER_GPU_MEMORY, {"kind": kind}) for kind in GPU_MEMORY_KINDS},
    "gpu/utilization": (m.LEARNER_GPU_UTILIZATION, {}),
    "step/idle_fraction": (m.LEARNER_IDLE_RATIO, {}),
    "version": (m.LEARNER_POLICY_VERSION, {}),
}
DROPPED = {
    "groups/dropped_stale": "stale",
    "groups/duplicates": "duplicate",
    "groups/zero_variance": "zero_variance",
    "groups/refused": "refused",
}
SUMMARY_KEYS = (
    "step",
    "version",
    "time",
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/staleness_max",
    "rollout/staleness_mean",
    "rollout/tokens",
    "rollout/response_tokens_mean",
    "rollout/response_tokens_p95",
    "rollout/response_tokens_max",
    "rollout/truncated_frac",
    *(f"latency/{stage}" for stage in ("queued_s", "generate_s", "scoring_s", "replay_s", "total_s", "total_s_max")),
    "train/loss",
    "train/grad_norm",
    "train/loss/clip_frac",
    "train/loss/entropy",
    "train/loss/kl_ref",
    "train/kl_reward/kl",
    "train/offpolicy/mismatch_kl",
    "step/seconds",
    "step/idle_fraction",
    "sync/seconds",
    "groups/dropped_stale",
)
"""The row's keys copied into the Redis summary (the metrics.jsonl names, so a person reads one vocabulary)."""


def observe_group_stages(stages) -> None:
    """One observation per group and stage (``[groups, 4]`` seconds, recorder.py: group_stage_seconds), and the
    group's total, into ``asyncrl_learner_group_stage_duration_seconds``: the distributions behind the means."""
    for row in stages:
        for stage, seconds in zip(LATENCY_STAGES, (*row, row.sum()), strict=True):
            m.LEARNER_GROUP_STAGE_DURATION.labels(stage=stage).observe(float(seconds))


def learner_process_id() -> str:
    """``learner`` on rank 0, ``learner-rank<N>`` on the others (every rank serves its own /metrics)."""
    rank = int(os.environ.get("RANK", "0"))
    return "learner" if rank == 0 else f"learner-rank{rank}"


class StepTelemetry:
    """Serves the learner's ``/metrics`` and heartbeats (kind ``learner``, with the URL) from construction on;
    :meth:`publish` feeds it one step's row."""

    def __init__(self, plane: ControlPlane, config: RunConfig, process_id: str | None = None) -> None:
        self.plane = plane
        self.config = config
        self.process_id = process_id or learner_process_id()
        self.publishes_summary = self.process_id == "learner"
        self.server = m.start_metrics_server(
            config.run.name,
            self.process_id,
            "learner",
            config.monitoring.metrics_port,
            addr=config.monitoring.metrics_host,
        )
        self.state, self.version = "starting", 0
        self.demand = ActorDemand()
        if self.publishes_summary:  # the run wants an actor from its start (rank 0 speaks for the run)
            self._want_actors(1)
        transport = config.transport
        self.heartbeats = HeartbeatThread(plane, self.heartbeat, transport.heartbeat_s, transport.heartbeat_ttl_s)
        self.heartbeats.start()
        atexit.register(self.close)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            process_id=self.process_id,
            kind="learner",
            state=self.state,
            version=self.version,
            host=advertise_host(),
            pid=os.getpid(),
            metrics_url=self.server.url,
        )

    @property
    def url(self) -> str:
        return self.server.url

    def publish(self, values: Mapping[str, float], queues: Mapping[str, int] | None = None, processes=None) -> None:
        """Update every series from one metrics.jsonl row and write the summary; ``queues`` (``queue_depths()``) and
        ``processes`` (``processes()``) are read from Redis unless the caller sampled them already this step."""
        self._update_series(values)
        self.state, self.version = "training", int(values.get("version", self.version))
        if not self.publishes_summary:
            return
        import redis.exceptions

        try:
            queues, live = self._sample_queues(queues, processes)
            wanted = self.demand.observe(float(values.get("step/idle_fraction", 0.0)), live)
            self._want_actors(wanted)
            self.plane.run.publish_summary(self.summary(values, queues) | {"actors/wanted": wanted})
        except redis.exceptions.RedisError as exc:
            log.warning("could not publish step telemetry; training goes on", step=values.get("step"), error=exc)

    def _update_series(self, values: Mapping[str, float]) -> None:
        for key, (gauge, labels) in GAUGES.items():
            if key in values:
                (gauge.labels(**labels) if labels else gauge).set(float(values[key]))
        m.LEARNER_STEPS.inc()
        m.LEARNER_LAST_STEP.set(float(values.get("time", time.time())))
        m.LEARNER_TRAINED_TOKENS.inc(max(float(values.get("rollout/tokens", 0.0)), 0.0))
        m.LEARNER_TRAINED_GROUPS.inc(sum(v for k, v in values.items() if k.startswith("rollout/groups_from/")))
        for key, reason in DROPPED.items():
            m.LEARNER_DROPPED_GROUPS.labels(reason=reason).inc(max(float(values.get(key, 0.0)), 0.0))
        if "step/seconds" in values:
            m.LEARNER_STEP_SECONDS.observe(float(values["step/seconds"]))
        if "sync/seconds" in values:  # only steps whose broadcast (or an overlapped one) finished report it
            m.LEARNER_WEIGHT_SYNC_SECONDS.observe(float(values["sync/seconds"]))
        free, _ = disk_space(self.config.run_dir / "checkpoints")
        if free >= 0:
            m.LEARNER_CHECKPOINT_DISK_FREE.set(free)

    def _sample_queues(self, queues: Mapping[str, int] | None, processes) -> tuple[Mapping[str, int], list]:
        """Sets the queue and process series; the queues and the live heartbeats."""
        queues = self.plane.queue_depths() if queues is None else queues
        for name, depth in queues.items():
            m.LEARNER_QUEUE_DEPTH.labels(queue=name).set(depth)
        live, lost = self.plane.registry.processes() if processes is None else processes
        for kind in ("actor", "reward"):
            m.LEARNER_LIVE_PROCESSES.labels(kind=kind).set(sum(h.kind == kind for h in live))
        m.LEARNER_LOST_PROCESSES.set(len(lost))
        return queues, live

    def summary(self, values: Mapping[str, float], queues: Mapping[str, int]) -> dict[str, Any]:
        """The compact step summary rl-top reads: the row's main figures, the queues, the run's length."""
        out: dict[str, Any] = {k: float(values[k]) for k in SUMMARY_KEYS if k in values}
        out["learner/steps"] = self.config.learner.steps
        out["learner/metrics_url"] = self.server.url
        out.update({f"queue/{name}": depth for name, depth in queues.items()})
        return out

    def finished(self) -> None:
        """The run took its last step: the series says it wants no actor (``mark_finished`` empties the list)."""
        m.LEARNER_ACTORS_WANTED.set(0)

    def _want_actors(self, count: int) -> None:
        """The autoscaling signal, as a series (the HPA's route) and as the run's list in Redis (KEDA's), written
        every step: one transaction, and a Redis that lost its data has the list again at the next step."""
        import redis.exceptions

        m.LEARNER_ACTORS_WANTED.set(count)
        try:
            self.plane.run.set_actors_wanted(count)
        except redis.exceptions.RedisError as exc:
            log.warning("could not publish the actors wanted; training goes on", actors_wanted=count, error=exc)

    def close(self) -> None:
        """Leave the registry and stop serving (idempotent; also run at interpreter exit)."""
        self.heartbeats.stop(leave=True)
        self.server.close()
