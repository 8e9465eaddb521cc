"""What the run leaves behind: a line of metrics.jsonl per step, the live telemetry, the facts health judges, and the
audit trail.

:meth:`Recorder.record` builds the step's row from what the owners returned — ``train/*`` (the update), ``sync/*``
(the broadcaster), ``groups/*`` (the batch source), ``rollout/*`` (from the groups trained), ``step/*`` and, after
a resume, ``restore/*`` — lets the health monitor judge it (``health/*``), appends it to metrics.jsonl, and
publishes it to Prometheus, the Redis summary rl-top reads, and the active alerts.

The learner's :attr:`Recorder.audit` records the run's start or resume, its end, and each process found lost; on rank 0
an :class:`~asyncrl.common.plane.audit_file.AuditMirror` copies the run's audit stream into ``audit.jsonl`` on a
daemon thread, and :meth:`Recorder.close` (at the end of the run, or at exit) copies what remains after the learner has
left.
"""

from __future__ import annotations

import atexit
import getpass
import hashlib
import itertools
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from asyncrl.common.config import RunConfig
from asyncrl.common.environments.tool_calls import parse_tool_calls
from asyncrl.common.observability.gpu import gpu_figures
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.plane.audit import Audit
from asyncrl.common.plane.audit_file import AuditMirror, recorded_lost
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.outage import settling
from asyncrl.common.private import open_private
from asyncrl.common.wire.messages import EPISODE_FINISH_REASONS, RolloutGroup, model_turns
from asyncrl.learner.checkpoint.format import Checkpoint
from asyncrl.learner.checkpoint.settings import config_hash
from asyncrl.learner.health.alerts import ProcessFacts
from asyncrl.learner.health.monitor import HealthMonitor
from asyncrl.learner.intake.batch_source import Taken
from asyncrl.learner.record.resources import MemoryTrend
from asyncrl.learner.record.samples import SampleLog, row_advantages
from asyncrl.learner.record.telemetry import StepTelemetry, observe_group_stages
from asyncrl.learner.record.trackers import Trackers
from asyncrl.learner.update.batch import TrainBatch

log = get_logger("learner")


@dataclass
class StepRecord:
    """What one step did; one line of metrics.jsonl."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, prefix: str, figures: dict[str, float]) -> None:
        self.values.update({f"{prefix}/{k}": float(v) for k, v in figures.items()})


class Recorder:
    """metrics.jsonl, telemetry, health facts and the audit trail of one run's learner. Serves ``/metrics`` and
    mirrors the audit stream from construction on, so both work while DeepSpeed starts."""

    def __init__(self, config: RunConfig, plane: ControlPlane) -> None:
        self.plane = plane
        self.config = config
        self.metrics_path = config.run_dir / "metrics.jsonl"
        self.audit_path = config.run_dir / "audit.jsonl"
        monitoring = config.monitoring
        self.samples = SampleLog(
            config.run_dir / "samples.jsonl", monitoring.samples_every, monitoring.samples_per_step, config.run.seed
        )
        self.telemetry = StepTelemetry(plane, config)
        self.memory = MemoryTrend()
        self.trackers = Trackers(config if self.telemetry.publishes_summary else _untracked(config))
        self.audit = Audit(plane.client, config.run.name, self.telemetry.process_id, "learner")
        self.owns_audit = self.telemetry.publishes_summary  # rank 0
        self.mirror = AuditMirror(plane.client, config.run.name, self.audit_path).start() if self.owns_audit else None
        atexit.register(self.close)  # after telemetry's: runs first, so the learner's own leaving is copied too
        self.health: HealthMonitor | None = None  # set once the run state it rolls back exists
        self._lost: dict[str, str] = {}  # id → kind of processes whose heartbeat expired, ever (facts are cumulative)
        self._lost_now: set[str] = set()  # ids whose heartbeat was expired at the last look
        self._next_look = 0.0  # the registry is read at most once a second between steps
        self._dead_at_start = plane.queue_depths()["dead_letters"]

    def started(self, resumed_from: Checkpoint | None = None) -> None:
        """``run.started`` (or ``run.resumed``, with the checkpoint and its step) in the audit trail: the config's
        training-settings hash (as in a checkpoint's state.json), the sha256 of config.json, the user."""
        if not self.owns_audit:
            return
        config_json = self.config.run_dir / "config.json"
        fields = {
            "config_hash": config_hash(self.config),
            "config_json_sha256": hashlib.sha256(config_json.read_bytes()).hexdigest() if config_json.is_file() else "",
            "user": _user(),
            "model": self.config.model.path,
            "steps": self.config.learner.steps,
        }
        # a process lost before this learner started, and recorded so by the one before it, is not lost again
        self._lost_now = recorded_lost(self.plane.client, self.config.run.name, set(self._processes()[1]))
        if resumed_from is None:
            self.audit.record("run.started", **fields)
        else:
            self.audit.record("run.resumed", **fields, checkpoint=resumed_from.path, from_step=resumed_from.state.step)

    def close(self, version: int | None = None, outcome: str = "") -> None:
        """The run ended (``run.finished`` with ``outcome`` at ``version``, when given): leave the registry, stop
        serving, and copy the rest of the audit stream (idempotent; also run at exit)."""
        if version is not None and self.owns_audit:
            self.audit.record("run.finished", outcome=outcome, version=version, steps=self.config.learner.steps)
        self.telemetry.close()
        self.trackers.close()
        if self.mirror is not None:
            self.mirror.close()

    def record(
        self, version: int, started: float, taken: Taken, batch: TrainBatch, advantages=None, **parts: dict
    ) -> StepRecord:
        """The row of step ``version``: ``parts`` are prefixed figures (``train=…, sync=…, restore=…``); with the
        update's ``[B, T]`` ``advantages``, samples.jsonl rows when they are due."""
        record = StepRecord()
        for prefix, figures in parts.items():
            if figures:
                record.add(prefix, figures)
        record.add("rollout", rollout_figures(version, taken, batch) | tool_call_figures(taken, self.samples.decode))
        timelines = group_timelines(taken)
        stages = group_stage_seconds(timelines)
        record.add("latency", latency_figures(stages))
        record.values |= taken.figures() | gpu_figures() | self.memory.figures(time.time())
        record.values["step/seconds"] = time.perf_counter() - started
        record.values["step/idle_fraction"] = taken.waited_s / max(record.values["step/seconds"], 1e-9)
        # sampled once a step, for health and metrics
        queues, processes = self.plane.queue_depths(), self._processes()
        self._note_lost(processes[1])
        if self.health is not None:
            record.add("health", self.health.observe(version, record.values, self._facts(queues)))
        self._write(version, record)
        self.trackers.metrics(version, record.values)
        self._sample(version, taken, batch, advantages, timelines)
        self.telemetry.publish(record.values, queues, processes)
        observe_group_stages(stages)
        if self.health is not None:
            self.plane.run.set_alerts(self.health.active_alerts())
        return record

    def _sample(self, version: int, taken: Taken, batch: TrainBatch, advantages, timelines) -> None:
        """samples.jsonl (rank 0), and its newest rows for rl-top."""
        if not self.owns_audit or advantages is None or not self.samples.due(version):
            return
        by_response = row_advantages(batch.keys, advantages, batch.response_mask)
        rows = self.samples.write(version, taken.groups, by_response, timelines)
        self.plane.run.publish_samples(rows)
        self.trackers.samples(version, rows)

    def note_lost_processes(self) -> None:
        """Between steps (the learner waiting for a batch): ``process.lost`` for a process whose heartbeat expired
        since the last look, at most once a second; rank 0 only, which writes the audit trail."""
        now = time.monotonic()
        if not self.owns_audit or now < self._next_look:
            return
        self._next_look = now + 1.0
        self._note_lost(self._processes()[1])

    def _processes(self) -> tuple[list, dict[str, str]]:
        """The registry's (live, lost); none lost while Redis has just come back (heartbeats that expired meanwhile
        are being renewed)."""
        processes = self.plane.registry.processes()
        if settling(self.plane.client, self.config.transport.heartbeat_ttl_s):
            return processes[0], {}
        return processes

    def _note_lost(self, lost: dict[str, str]) -> None:
        """``process.lost`` in the audit trail for each process whose heartbeat expired since the last look."""
        if self.owns_audit:
            for process_id in sorted(lost.keys() - self._lost_now):
                self.audit.record("process.lost", process=process_id, kind=lost[process_id])
        self._lost_now = set(lost)
        self._lost.update(lost)

    def _facts(self, queues: dict[str, int]) -> ProcessFacts:
        dead = queues["dead_letters"] - self._dead_at_start
        return ProcessFacts(
            actors_lost=sum(kind == "actor" for kind in self._lost.values()),
            reward_errors=max(0, dead),
            lost=tuple(f"{pid} ({kind})" for pid, kind in sorted(self._lost.items())),
        )

    def _write(self, version: int, record: StepRecord) -> None:
        record.values.update({"step": float(version), "version": float(version), "time": time.time()})
        with open_private(self.metrics_path, "a") as f:
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
        if v.get("train/offpolicy/dropped_frac", 0.0) > 0:
            log.warning(
                "the mismatch guard dropped sequences from this step's loss",
                step=version,
                dropped_frac=round(v["train/offpolicy/dropped_frac"], 4),
                mismatch_kl=round(v.get("train/offpolicy/mismatch_kl", 0.0), 4),
                action="actors sampled with weights far from the learner's (a bad load, or too much staleness); "
                "see staleness.max_sequence_kl and staleness.veto, and lower staleness.max_staleness if it persists",
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
        **length_figures(taken),
        **episode_figures(taken),
        **ending_figures(taken),
    }


TIMELINE = ("issued", "taken", "generated", "stored", "batch_complete")
"""A group's timeline (wall-clock seconds): issued by the learner, taken by an actor, generated, stored in the replay
stream (after scoring), its batch complete."""


def group_timelines(taken: Taken) -> dict[str, dict[str, float]]:
    """Each group's :data:`TIMELINE` by group id. Times come from the hosts that saw each event (the learner's issue
    record, the actor's ``taken_at``, Redis's stream entry id), so across hosts the split is as good as their clocks
    agree. Groups that lack a part (an issue record already retired, an actor that does not stamp ``taken_at``) are
    left out."""
    out = {}
    for entry in taken.entries:
        rollout = entry.group.rollout
        issued, taken_at = taken.issued_at.get(rollout.group_id), rollout.timings.get("taken_at")
        if issued is None or taken_at is None:
            continue
        generated = taken_at + rollout.timings.get("generate", 0.0)
        stored = int(entry.entry_id.split("-", 1)[0]) / 1000  # a stream id is Redis's clock in ms
        times = (issued, taken_at, generated, stored, taken.complete_at)
        out[rollout.group_id] = dict(zip(TIMELINE, times, strict=True))
    return out


def group_stage_seconds(timelines: dict[str, dict[str, float]]) -> np.ndarray:
    """Each group's seconds in the four stages between its :data:`TIMELINE`'s events, ``[groups, 4]``: queued
    (issued → taken by an actor), generate, scoring (generated → in the replay stream), replay (in the stream → the
    learner's batch complete)."""
    rows = [[t[b] - t[a] for a, b in itertools.pairwise(TIMELINE)] for t in timelines.values()]
    return np.asarray(rows, np.float64).reshape(-1, 4)


def latency_figures(stages: np.ndarray) -> dict[str, float]:
    """Where the step's groups spent their time (means over :func:`group_stage_seconds`' rows, seconds):

    - ``latency/queued_s``: the prompt queue (admission holds groups back while the actors are at the staleness
      bound);
    - ``latency/generate_s``: the actor's generation (a multi-turn episode's environment steps included);
    - ``latency/scoring_s``: the push, the reward worker's queue and its scoring;
    - ``latency/replay_s``: waiting in the replay stream to be trained;
    - ``latency/total_s`` (and ``latency/total_s_max``): issued → batch complete, the sum of the four.

    No group with every part, no figures."""
    if not len(stages):
        return {}
    totals = stages.sum(axis=1)
    means = stages.mean(axis=0)
    return {
        "queued_s": float(means[0]),
        "generate_s": float(means[1]),
        "scoring_s": float(means[2]),
        "replay_s": float(means[3]),
        "total_s": float(totals.mean()),
        "total_s_max": float(totals.max()),
    }


def length_figures(taken: Taken) -> dict[str, float]:
    """How long the step's responses and prompts are, over every response sampled (trained or not):
    ``rollout/response_tokens_{mean,p50,p95,max}``, ``rollout/truncated_frac`` (the share cut by a token limit:
    finish reason ``length``), ``rollout/prompt_tokens_{mean,max}`` (one per group), and for multi-turn episodes
    ``rollout/turn_tokens_{mean,max}`` (each of the model's turns)."""
    rollouts = [e.group.rollout for e in taken.entries]
    lengths = np.concatenate([r.lengths for r in rollouts]).astype(np.float64)
    prompts = np.asarray([len(r.prompt_ids) for r in rollouts], np.float64)
    reasons = [reason for r in rollouts for reason in r.finish_reasons]
    figures = {
        "response_tokens_mean": float(lengths.mean()),
        "response_tokens_p50": float(np.percentile(lengths, 50)),
        "response_tokens_p95": float(np.percentile(lengths, 95)),
        "response_tokens_max": float(lengths.max()),
        "truncated_frac": sum(reason == "length" for reason in reasons) / len(reasons),
        "prompt_tokens_mean": float(prompts.mean()),
        "prompt_tokens_max": float(prompts.max()),
    }
    turns = [
        end - start
        for r in episode_rollouts(taken)
        for i in range(r.num_samples)
        for start, end, trained in r.segments(i)
        if trained
    ]
    if turns:
        figures |= {"turn_tokens_mean": float(np.mean(turns)), "turn_tokens_max": float(max(turns))}
    return figures


def episode_rollouts(taken: Taken) -> list[RolloutGroup]:
    """The step's rollouts of multi-turn episodes (responses with a loss mask)."""
    return [e.group.rollout for e in taken.entries if len(e.group.rollout.loss_mask)]


def episode_figures(taken: Taken) -> dict[str, float]:
    """``rollout/episode_*`` when the step trained multi-turn episodes (responses with a loss mask): model turns per
    episode (mean, max), response tokens per episode (mean, max) and the share of them the model sampled."""
    rollouts = episode_rollouts(taken)
    if not rollouts:
        return {}
    turns = [model_turns(r.trained(i)) for r in rollouts for i in range(r.num_samples)]
    lengths = np.concatenate([r.lengths for r in rollouts])
    sampled = sum(int(r.loss_mask.sum()) for r in rollouts)
    return {
        "episode_turns_mean": float(np.mean(turns)),
        "episode_turns_max": float(max(turns)),
        "episode_tokens_mean": float(lengths.mean()),
        "episode_tokens_max": float(lengths.max()),
        "episode_sampled_frac": sampled / max(int(lengths.sum()), 1),
    }


def ending_figures(taken: Taken) -> dict[str, float]:
    """How the step's episodes ended: ``rollout/episode_endings/<reason>``, the share of its trained episodes with
    each finish reason (:data:`~asyncrl.common.environments.turns.EPISODE_FINISH_REASONS`); and what environment
    faults cost since the last step — ``rollout/faulted_episodes``, the episodes a fault ended (their groups generated
    again, never trained), and ``rollout/env_error_frac``, their share of those and the trained ones."""
    reasons = [reason for r in episode_rollouts(taken) for reason in r.finish_reasons]
    if not reasons and not taken.faulted_episodes:
        return {}
    figures = {f"episode_endings/{name}": reasons.count(name) / max(len(reasons), 1) for name in EPISODE_FINISH_REASONS}
    figures["faulted_episodes"] = float(taken.faulted_episodes)
    figures["env_error_frac"] = taken.faulted_episodes / (taken.faulted_episodes + len(reasons))
    return figures


def tool_call_figures(taken: Taken, decode: Callable[[list[int]], str] | None) -> dict[str, float]:
    """``rollout/episode_tool_calls_mean`` and ``rollout/episode_malformed_calls_mean``: the tool calls per episode in
    the model's turns (``common/environments/tool_calls.py``), well-formed and malformed, when the step trained
    episodes."""
    rollouts = episode_rollouts(taken)
    if not rollouts or decode is None:
        return {}
    calls = malformed = episodes = 0
    for rollout in rollouts:
        for i in range(rollout.num_samples):
            ids, episodes = rollout.response(i)[0], episodes + 1
            for start, end, by_model in rollout.segments(i):
                if by_model:
                    parsed = parse_tool_calls(decode(ids[start:end].tolist()))
                    calls, malformed = calls + len(parsed.calls), malformed + len(parsed.errors)
    return {"episode_tool_calls_mean": calls / episodes, "episode_malformed_calls_mean": malformed / episodes}


def _untracked(config: RunConfig) -> RunConfig:
    """``config`` without trackers: a learner rank other than 0 mirrors nothing (rank 0 has every row)."""
    return config.model_copy(update={"monitoring": config.monitoring.model_copy(update={"trackers": []})})


def _user() -> str:
    """The operating-system user running the learner ("" when the system cannot say)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""
