"""Prometheus metrics shared by every process, named ``asyncrl_<component>_<what>_<unit>``.

Every series lives in the default registry. A process serves them on ``/metrics`` with
:func:`start_metrics_server` and puts the URL in its heartbeat (``common/plane/process_registry.py``), so that
``rl-top --targets`` and a Prometheus file_sd can find every process without a fixed port.

Learner series whose figure a step may not compute (KL to the reference, entropy, critic loss, …) carry a
label, so they appear only once a step reported them: a missing figure is absent, never a misleading 0.
"""

from __future__ import annotations

import os
import resource
import threading
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from asyncrl.common.net import advertise_host
from asyncrl.common.observability.logs import get_logger

if TYPE_CHECKING:
    pass

log = get_logger("metrics")

WIRE_MALFORMED = Counter(
    "asyncrl_wire_malformed_messages_total",
    "Messages refused by a decoder, by channel and offending field.",
    ["channel", "field"],
)
CHANNEL_SENT = Counter("asyncrl_channel_sent_messages_total", "Messages sent on a ZeroMQ channel.", ["channel"])
CHANNEL_SENT_BYTES = Counter("asyncrl_channel_sent_bytes_total", "Bytes sent on a ZeroMQ channel.", ["channel"])
CHANNEL_RECEIVED = Counter(
    "asyncrl_channel_received_messages_total", "Well-formed messages received on a ZeroMQ channel.", ["channel"]
)
CHANNEL_REFUSED_CLIENTS = Counter(
    "asyncrl_channel_refused_clients_total",
    "CURVE handshakes refused on a ZeroMQ channel because the client's public key is not authorised.",
    ["channel"],
)
CHANNEL_REFUSED_HANDSHAKES = Counter(
    "asyncrl_channel_refused_handshakes_total",
    "Connections to a ZeroMQ channel that failed the CURVE handshake (no run credential, or an unauthorised key): "
    "nothing they sent was read.",
    ["channel"],
)
CHANNEL_UNSEALED = Counter(
    "asyncrl_channel_unsealed_messages_total",
    "Messages refused on a ZeroMQ channel before decoding because their seal (the run secret's MAC) did not verify.",
    ["channel"],
)
REPLAY_ENTRIES_ADDED = Counter("asyncrl_replay_entries_added_total", "Scored groups added to the replay stream.")
REPLAY_ENTRIES_READ = Counter("asyncrl_replay_entries_read_total", "Scored groups read from the replay stream.")
REPLAY_DEAD_LETTERS = Counter(
    "asyncrl_replay_dead_letters_total", "Replay entries moved to the dead-letter stream.", ["field"]
)

REWARD_SCORED_GROUPS = Counter(
    "asyncrl_reward_scored_groups_total", "Rollout groups scored by a reward worker and written to the replay stream."
)
REWARD_DEAD_LETTERED_GROUPS = Counter(
    "asyncrl_reward_dead_lettered_groups_total",
    "Rollout groups a reward worker could not score, moved to the dead-letter stream, by reward function.",
    ["function"],
)
REWARD_REFUSED_GROUPS = Counter(
    "asyncrl_reward_refused_groups_total",
    "Rollout groups a reward worker refused without scoring (moved to the dead-letter stream), by reason.",
    ["reason"],
)
REWARD_REPLACED_TEXTS = Counter(
    "asyncrl_reward_replaced_texts_total",
    "Responses whose text, as sent, differed from the decode of their token ids; the decode was scored.",
)
REWARD_FAILED_CALLS = Counter(
    "asyncrl_reward_failed_calls_total",
    "Reward-function calls that raised or returned unusable scores (timeouts are counted apart).",
    ["function"],
)
REWARD_TIMED_OUT_CALLS = Counter(
    "asyncrl_reward_timed_out_calls_total", "Reward-function calls abandoned at the time limit.", ["function"]
)
REWARD_SCORING_SECONDS = Histogram(
    "asyncrl_reward_scoring_seconds",
    "Seconds to score one rollout group with every reward function, retries included.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
ENVIRONMENT_REQUESTS = Counter(
    "asyncrl_reward_environment_requests_total",
    "Environment requests a reward worker served for actors (environment.isolation = workers), by op (make, step, "
    "score, close; invalid, unsealed) and outcome (ok, failed: the environment failed; refused: a malformed request, "
    "or one without the run's seal).",
    ["op", "outcome"],
)


DISPATCHER_SKIPPED_ROWS = Gauge(
    "asyncrl_dispatcher_skipped_rows",
    "Rows of the task's data file left out at load because their prompt is too long to serve (task.overlong = skip).",
)
DISPATCHER_RELEASED_GROUPS = Counter(
    "asyncrl_dispatcher_released_groups_total",
    "Prompt groups released into the prompt queue by admission control (replacements of lost groups included).",
)
DISPATCHER_REISSUED_GROUPS = Counter(
    "asyncrl_dispatcher_reissued_groups_total",
    "Prompt groups re-issued because their actor died or they missed the deadline.",
)
DISPATCHER_LOST_GROUPS = Counter(
    "asyncrl_dispatcher_lost_groups_total",
    "Prompt groups given up on after missing the deadline (or losing their actor) once more after re-issue.",
)
DISPATCHER_REFUSED_GROUPS = Counter(
    "asyncrl_dispatcher_refused_groups_total",
    "Prompt groups retired because a reward worker refused or dead-lettered them for good (a replacement is released).",
)
DISPATCHER_DUPLICATE_GROUPS = Counter(
    "asyncrl_dispatcher_duplicate_groups_total",
    "Scored groups the learner dropped because the same group id was already trained (a re-issued group's twin).",
)


# ------------------------------------------------------------------ rollout actor

ACTOR_GENERATED_TOKENS = Counter(
    "asyncrl_actor_generated_tokens_total", "Response tokens generated by a rollout actor (prompts not counted)."
)
ACTOR_GENERATED_GROUPS = Counter(
    "asyncrl_actor_generated_groups_total", "Prompt groups (K responses each) generated by a rollout actor."
)
ACTOR_GENERATION_SECONDS = Histogram(
    "asyncrl_actor_generation_seconds",
    "Seconds from a group's start to its last response on a rollout actor (weight updates in between included).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
ACTOR_POLICY_VERSION = Gauge("asyncrl_actor_policy_version", "Policy version of the weights a rollout actor holds.")
ACTOR_WEIGHT_DIGEST_MISMATCHES = Counter(
    "asyncrl_actor_weight_digest_mismatches_total",
    "Weight versions a rollout actor received but refused to load: a bucket's digest did not match the manifest.",
)
ACTOR_RUNNING_GROUPS = Gauge("asyncrl_actor_running_groups", "Prompt groups a rollout actor is generating now.")
ACTOR_EPISODE_TURNS = Histogram(
    "asyncrl_actor_episode_turns",
    "Model turns per multi-turn episode on a rollout actor.",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
ACTOR_FAULTED_GROUPS = Counter(
    "asyncrl_actor_faulted_groups_total",
    "Groups an environment fault ended an episode of, never trained: generated again (retried) or, past "
    "environment.fault_attempts, dead-lettered.",
    ["outcome"],
)
ACTOR_EPISODE_ENDINGS = Counter(
    "asyncrl_actor_episode_endings_total",
    "Multi-turn episodes ended on a rollout actor, by how: done, stopped (the model ended the conversation), "
    "max_turns, max_tokens, deadline, environment_error.",
    ["ending"],
)
ACTOR_ENVIRONMENT_STEP_SECONDS = Histogram(
    "asyncrl_actor_environment_step_seconds",
    "Seconds of one environment step on a rollout actor (failed and timed-out steps included).",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0),
)
ACTOR_ENVIRONMENT_MOVES = Counter(
    "asyncrl_actor_environment_moves_total",
    "Episodes whose environment was made again on another reward worker after the one holding it was lost, its "
    "earlier steps replayed there (environment.isolation = workers).",
)

# ------------------------------------------------------------------ learner (updated once per step)

LEARNER_STEPS = Counter("asyncrl_learner_steps_total", "Optimizer steps taken by the learner.")
LEARNER_TRAINED_TOKENS = Counter("asyncrl_learner_trained_tokens_total", "Response tokens the learner trained on.")
LEARNER_TRAINED_GROUPS = Counter("asyncrl_learner_trained_groups_total", "Scored groups the learner trained on.")
LEARNER_DROPPED_GROUPS = Counter(
    "asyncrl_learner_dropped_groups_total",
    "Scored groups the learner acknowledged without training, by reason (stale, duplicate, zero_variance, refused).",
    ["reason"],
)
LEARNER_STEP_SECONDS = Histogram(
    "asyncrl_learner_step_seconds",
    "Wall seconds of one learner step (waiting for data, training, broadcast).",
    buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
)
LEARNER_WEIGHT_SYNC_SECONDS = Histogram(
    "asyncrl_learner_weight_sync_seconds",
    "Seconds of one weight broadcast to the rollout actors (group formation included when it was re-formed).",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
LEARNER_POLICY_VERSION = Gauge("asyncrl_learner_policy_version", "Policy version after the learner's last step.")
LEARNER_LAST_STEP = Gauge(
    "asyncrl_learner_last_step_timestamp_seconds", "Unix time at which the learner finished its last step."
)
LEARNER_IDLE_RATIO = Gauge(
    "asyncrl_learner_idle_ratio", "Fraction of the last step the learner spent waiting for scored groups."
)
LEARNER_EVAL_SCORE = Gauge(
    "asyncrl_learner_eval_score",
    "Scores of the newest complete eval round (learner/intake/evaluation.py), by figure (pass@k, mean@k, accuracy).",
    ["figure"],
)
LEARNER_EVAL_STEP = Gauge("asyncrl_learner_eval_step", "Step (policy version) the newest eval round evaluated.")
LEARNER_EVAL_ROUNDS = Counter("asyncrl_learner_eval_rounds_total", "Eval rounds recorded by the learner.")
LEARNER_EVAL_MISSING = Counter(
    "asyncrl_learner_eval_missing_groups_total", "Eval groups not back by their round's deadline (eval.deadline_s)."
)
LEARNER_REWARD = Gauge(
    "asyncrl_learner_reward",
    "Reward over every response of the last step's batch, by statistic (mean, std).",
    ["statistic"],
)
LEARNER_KL = Gauge(
    "asyncrl_learner_kl_nats",
    "KL estimates of the last step in nats: reference (policy to reference model), mismatch (behaviour μ to "
    "π_old), reward (the KL penalised in the reward), update (π_θ to π_old after the step).",
    ["kl"],
)
LEARNER_ENTROPY = Gauge(
    "asyncrl_learner_entropy_nats",
    "Policy entropy per response token in nats, from the training forward of the last step.",
    ["statistic"],
)
LEARNER_CLIPPED_RATIO = Gauge(
    "asyncrl_learner_clipped_tokens_ratio",
    "Fraction of response tokens clipped by the surrogate (ppo, dual) or by the band around the sampling policy "
    "(behaviour), or of sequences the mismatch guard dropped (mismatch_guard).",
    ["clip"],
)
LEARNER_GRAD_NORM = Gauge(
    "asyncrl_learner_grad_norm",
    "Gradient norm before clipping of the last step, by model (policy, critic).",
    ["model"],
)
LEARNER_LOSS = Gauge("asyncrl_learner_loss", "Loss of the last step, by model (policy, critic).", ["model"])
LEARNER_STALENESS = Gauge(
    "asyncrl_learner_staleness_versions",
    "Policy versions between the trained weights and the tokens of the last batch, by statistic (max, mean).",
    ["statistic"],
)
LEARNER_RESPONSE_LENGTH = Gauge(
    "asyncrl_learner_response_length_tokens",
    "Tokens per response in the last step's groups, by statistic (mean, p50, p95, max).",
    ["statistic"],
)
LEARNER_PROMPT_LENGTH = Gauge(
    "asyncrl_learner_prompt_length_tokens",
    "Tokens per prompt in the last step's groups, by statistic (mean, max).",
    ["statistic"],
)
LEARNER_GROUP_STAGE = Gauge(
    "asyncrl_learner_group_stage_seconds",
    "Mean seconds the last step's groups spent in each stage from issue to a complete batch (queued, generate, "
    "scoring, replay, total).",
    ["stage"],
)
LEARNER_GROUP_STAGE_DURATION = Histogram(
    "asyncrl_learner_group_stage_duration_seconds",
    "Seconds each trained group spent in one stage from issue to a complete batch (queued, generate, scoring, replay, "
    "total), one observation per group: the distribution behind asyncrl_learner_group_stage_seconds' means.",
    ["stage"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
)
LEARNER_ACTORS_WANTED = Gauge(
    "asyncrl_learner_actors_wanted",
    "Rollout actors the run wants now (learner/intake/autoscale.py): the live actors' busy share over one minus the "
    "learner's idle fraction; at least 1 while the run goes on, 0 once it has finished. What autoscalers follow.",
)
LEARNER_CHECKPOINT_BYTES = Gauge(
    "asyncrl_learner_checkpoint_bytes", "Bytes of the learner's newest checkpoint (every file of its step folder)."
)
LEARNER_CHECKPOINT_DISK_FREE = Gauge(
    "asyncrl_learner_checkpoint_disk_free_bytes",
    "Bytes the learner may still write on the disk that holds its checkpoints (read every step).",
)
LEARNER_TRUNCATED_RATIO = Gauge(
    "asyncrl_learner_truncated_ratio",
    "Share of the last step's responses cut by a token limit (finish reason length: rollout.max_new_tokens, or an "
    "episode's limits).",
)
LEARNER_GPU_MEMORY = Gauge(
    "asyncrl_learner_gpu_memory_bytes",
    "The learner's GPU memory at the end of the last step, by kind: allocated, reserved and peak (torch's allocator, "
    "this process), total (the device), used (the device, every process: NVML). Absent without CUDA.",
    ["kind"],
)
LEARNER_GPU_UTILIZATION = Gauge(
    "asyncrl_learner_gpu_utilization_ratio",
    "Share of NVML's last sample period in which a kernel ran on the learner's GPU. Absent without CUDA or NVML.",
)
LEARNER_QUEUE_DEPTH = Gauge(
    "asyncrl_learner_queue_depth_groups",
    "Queue depths sampled by the learner each step: prompts (queued), inflight (issued, not yet trained), "
    "replay (stream length, acknowledged entries included until trimmed), replay_pending (read, not acknowledged), "
    "replay_unread (not yet delivered to the learner; Redis >= 7 only), dead_letters.",
    ["queue"],
)
LEARNER_LIVE_PROCESSES = Gauge(
    "asyncrl_learner_live_processes", "Processes with a live heartbeat, by kind (actor, reward).", ["kind"]
)
LEARNER_LOST_PROCESSES = Gauge(
    "asyncrl_learner_lost_processes", "Registered processes whose heartbeat expired (died without leaving)."
)
LEARNER_ALERT_ACTIVE = Gauge(
    "asyncrl_learner_alert_active", "1 while the learner's health check holds the alert active, else 0.", ["alert"]
)

# ------------------------------------------------------------------ every process

AUDIT_FAILURES = Counter(
    "asyncrl_audit_failures_total",
    "Audit-trail operations that failed (the event is lost to the trail; the process goes on), by stage: queue "
    "(no room while Redis is away), record (an XADD to the audit stream), mirror (the learner copying the stream "
    "into audit.jsonl).",
    ["stage"],
)
AUDIT_SUPPRESSED = Counter(
    "asyncrl_audit_suppressed_refusals_total",
    "Refusals counted but not recorded in the audit trail (only the 1st, 10th, 100th, ... of a reason are), by event.",
    ["event"],
)
AUDIT_MIRRORED = Counter(
    "asyncrl_audit_mirrored_entries_total", "Audit-stream entries the learner appended to audit.jsonl."
)
PROCESS_INFO = Gauge(
    "asyncrl_process_info",
    "Always 1: which run, process and kind this endpoint belongs to.",
    ["run", "process", "kind"],
)
PROCESS_RSS = Gauge(
    "asyncrl_process_resident_memory_bytes",
    "Resident memory of this process (not of its children, e.g. vLLM's engine-core process).",
)


def resident_bytes() -> float:
    """Current RSS from /proc (Linux); elsewhere the peak, which is what getrusage offers."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


PROCESS_RSS.set_function(resident_bytes)


def set_alert(name: str, active: bool) -> None:
    """Set ``asyncrl_learner_alert_active{alert=name}`` (the health check calls this on every evaluation)."""
    LEARNER_ALERT_ACTIVE.labels(alert=name).set(1.0 if active else 0.0)


# ------------------------------------------------------------------ serving


class MetricsServer:
    """``/metrics`` of this process over HTTP. Discovery is the process's heartbeat, which carries :attr:`url`
    (``common/plane/process_registry.py``): a process killed with -9 drops out when its heartbeat expires. Use
    :func:`start_metrics_server`."""

    def __init__(self, server, thread: threading.Thread, host: str) -> None:
        self._server = server
        self._http_thread = thread
        self.host = host
        self._closed = False

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        """``http://host:port/metrics``, with the host others should use."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()


def start_metrics_server(
    run: str,
    process_id: str,
    kind: str,
    port: int = 0,
    *,
    addr: str = "127.0.0.1",
    registry: CollectorRegistry = REGISTRY,
) -> MetricsServer:
    """Serve ``/metrics`` on ``addr``:``port`` (0 = a free port); put its :attr:`MetricsServer.url` in the heartbeat.

    ``addr`` is ``monitoring.metrics_host``: loopback unless the config says otherwise (``0.0.0.0`` where Prometheus
    scrapes from another host or pod), so a run on a shared machine does not show its metrics to the network.

    A fixed port already taken on this machine (two workers with one ``monitoring.metrics_port``) falls back to a
    free port, with a warning: the heartbeat, not the configured number, says where the endpoint is. The advertised
    host is ``addr`` itself when it is one address (loopback by default), else (every interface)
    ``ASYNCRL_ADVERTISE_HOST`` when set (e.g. a pod IP), else this machine's host name.
    """
    try:
        server, thread = start_http_server(port, addr, registry=registry)
    except OSError as exc:
        if not port:
            raise
        log.warning("metrics port taken; serving on a free one", port=port, error=exc, action="see rl-top --targets")
        server, thread = start_http_server(0, addr, registry=registry)
    if registry is REGISTRY:
        PROCESS_INFO.labels(run=run, process=process_id, kind=kind).set(1)
    metrics_server = MetricsServer(server, thread, _metrics_host(addr))
    log.info("serving metrics", process=process_id, url=metrics_server.url, bound=addr)
    return metrics_server


def _metrics_host(addr: str) -> str:
    """The host of the advertised URL: ``advertise_host()`` for a server on every interface, else the one address it
    is bound to (a loopback server advertised by host name would be unreachable through it)."""
    if addr in ("", "0.0.0.0", "::"):
        return advertise_host()
    return f"[{addr}]" if ":" in addr else addr


def serve(port: int = 0, addr: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` over HTTP on ``port`` (0 = a free one) without registering it; returns the port."""
    server, _thread = start_http_server(port, addr)
    return int(server.server_port)
