"""The sections of how a run's processes keep in step and stay healthy: the staleness bound, transports (Redis,
ZeroMQ, CURVE), weight sync, checkpoints, monitoring and the learner's health checks."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from asyncrl.common.config.base import MAX_STEPS, WEEK_S, Int, Section


class OffPolicyCorrection(Section):
    """The off-policy correction by w = π_old/μ: the fields of ``[staleness]`` that the policy losses read
    (``learner/algorithms/losses.py``), one class for both."""

    correction: Literal["none", "truncate", "mask"] = "truncate"
    """Off-policy correction by w = π_old/μ: ``none``: w = 1, μ stands in for π_old (the ratio is then π_θ/μ);
    ``truncate``: w ← min(w, cap); ``mask``: w ← 0 outside [1/cap, cap]."""
    level: Literal["token", "sequence"] = "token"
    """Level of the importance weight: ``token``, w per token; ``sequence``, every token of a sequence gets
    exp(Σ_t (log π_old − log μ))."""
    cap: float = Field(default=2.0, gt=1.0, le=1e6)
    """Upper cap (truncate) or upper band edge (mask) of the importance weight."""
    max_sequence_kl: float = Field(default=0.5, ge=0.0, le=1e6)
    """Mismatch guard: drop from the loss each sequence whose mean per-token k3 estimate of KL(μ ‖ π_old) is above
    this (counted in ``train/offpolicy/dropped_frac``); 0 = off. Normal runs stay below 0.5 (bench/stability.py:
    ≤ 0.01% of a run's sequences dropped; at most 3% of one step's, the first update from a warm start); a bad weight
    load does not (tests/e2e/test_mismatch_guard.py)."""
    veto: float = Field(default=1e-4, ge=0.0, lt=1.0)
    """Token veto: drop each sequence with a token whose π_old/μ is below this (one token μ sampled but π_old all but
    forbids; verl's rollout correction and slime veto such sequences too); 0 = off."""
    behaviour_clip: bool = True
    """Clip against μ as well as π_old (``ppo_clip`` losses: GRPO, DAPO, PPO): a token whose π_old/μ has already left
    [1 − clip_low, 1 + clip_high] in the direction its advantage pushes gets no gradient, so a stale sample cannot
    push a token further once per version of lag. Off, heavy-tailed counting collapsed at staleness 4 (3 runs in 3)
    and lost accuracy at 2 (bench/stability.py); without lag it changes nothing (π_old = μ)."""

    @property
    def recompute_proximal(self) -> bool:
        """Whether the loss reads π_old (otherwise μ stands in for it)."""
        return self.correction != "none"


class StalenessSection(OffPolicyCorrection):
    max_staleness: Int = Field(default=1, ge=0, le=1000)
    """Versions a token may lag the policy being trained; 0 = synchronous on-policy training."""


class TransportSection(Section):
    redis_url: str = ""
    """Redis URL without a password (the config is written to config.json and published to every process; give a
    password through ``--redis-url-file`` or ``$ASYNCRL_REDIS_URL``); empty = an embedded redis-server in the run
    folder."""
    zmq_endpoint: str = "tcp://127.0.0.1:0"
    """Where reward workers bind their PULL socket for rollouts (port 0 = pick a free one)."""
    zmq_hwm: Int = Field(default=64, ge=1, le=1_000_000)
    """ZeroMQ high-water mark in messages: senders block beyond it (back-pressure)."""
    curve_server_key: str = ""
    """Path of the CURVE server secret key file (required when binding beyond loopback)."""
    curve_client_keys: str = ""
    """Folder of authorised CURVE client public keys."""
    curve_client_key: str = ""
    """Path of a rollout actor's CURVE client secret key file (``name.key_secret``); needed to send to reward workers
    that bind with CURVE (their public key comes from their heartbeat)."""
    max_message_mb: float = Field(default=64.0, gt=0, le=4096)
    """Largest accepted message; a bigger one is refused and counted, except one single frame over it, which ZeroMQ
    itself drops with the sender's connection (``ZMQ_MAXMSGSIZE``): the process never sees it."""
    replay_maxlen: Int = Field(default=10_000, ge=10, le=100_000_000)
    """Approximate cap of the replay stream (``XADD MAXLEN ~``)."""
    redis_maxmemory_mb: Int = Field(default=2048, ge=0, le=2**24)
    """Memory limit of the embedded redis-server (``maxmemory``, with ``noeviction``: past it a write fails loudly, nothing of the run is evicted); 0 = none. Size it above ``replay_maxlen`` × a scored group's bytes, plus about 30 MB for the dead-letter stream."""  # noqa: E501
    heartbeat_s: float = Field(default=2.0, gt=0, le=3600)
    """Seconds between heartbeats."""
    heartbeat_ttl_s: float = Field(default=10.0, gt=0, le=86_400)
    """A process whose heartbeat is older than this is considered dead."""
    redis_outage_s: float = Field(default=60.0, gt=0, le=86_400)
    """How long every process waits for Redis when it stops answering (killed, restarting on its AOF), retrying with back-off; past this it exits with status 75 and says what to do (restart Redis, then resume with ``--resume latest``)."""  # noqa: E501

    @field_validator("redis_url")
    @classmethod
    def _no_password(cls, url: str) -> str:
        from urllib.parse import urlsplit

        if url and urlsplit(url).password:
            raise ValueError(
                "holds a password, and the config is written to config.json and published to every process: "
                "give the URL through --redis-url-file FILE (mode 0600) or $ASYNCRL_REDIS_URL instead"
            )
        return url

    @model_validator(mode="after")
    def _ttl_exceeds_period(self) -> TransportSection:
        if self.heartbeat_ttl_s <= self.heartbeat_s:
            raise ValueError("heartbeat_ttl_s must exceed heartbeat_s, or live processes would expire")
        return self


class WeightSyncSection(Section):
    sync_every: Int = Field(default=1, ge=1, le=1000)
    """Broadcast new weights every this many optimizer steps (actors reload that much less often); needs
    ``staleness.max_staleness`` ≥ sync_every − 1, or ≥ sync_every with ``overlap``: the versions the actors' weights
    may trail."""
    bucket_mb: float = Field(default=256.0, gt=0, le=65536)
    """Size of one flat broadcast bucket."""
    timeout_s: float = Field(default=60.0, gt=0, le=WEEK_S)
    """Time limit of one collective; an actor that misses it is evicted."""
    overlap: bool = True
    """Send a copy of the new weights while the next step trains (needs ``staleness.max_staleness`` ≥ 1; with 0
    the learner waits for every broadcast, since the next batch must come from the new weights)."""
    digests: bool = True
    """Seal every version with a BLAKE3 digest per bucket, which each actor verifies before it loads any (a mismatch
    is refused); off saves the hashing on both sides (about 1 s per 4 GB on one CPU core)."""


class CheckpointSection(Section):
    every: Int = Field(default=0, ge=0, le=MAX_STEPS)
    """Save every this many steps (0 = only at the end and on SIGTERM); a resume re-trains the steps after it."""
    keep: Int = Field(default=2, ge=1, le=10_000)
    """Most recent checkpoints kept (plus the best by reward)."""
    keep_best: bool = True
    """Also keep the checkpoint with the highest mean reward over its steps (those since the one before)."""
    export_hf: bool = True
    """Write the policy into each checkpoint as a Hugging Face folder (``hf/``) that transformers and vLLM load; with
    ``[lora]``, the adapters merged in (the adapters alone are always in ``adapter/``)."""


class MonitoringSection(Section):
    metrics_port: Int = Field(default=0, ge=0, le=65535)
    """Prometheus /metrics port; 0 = pick a free one and register it in Redis."""
    metrics_host: str = "127.0.0.1"
    """Address the /metrics servers bind: loopback by default; ``0.0.0.0`` (every interface) where Prometheus scrapes from another host or pod (the Kubernetes manifests set it)."""  # noqa: E501
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of every process."""
    samples_every: Int = Field(default=5, ge=0, le=MAX_STEPS)
    """Every this many steps, append responses the learner trained on to samples.jsonl (0 = never)."""
    samples_per_step: Int = Field(default=4, ge=0, le=1000)
    """Responses drawn at random for samples.jsonl each time, besides the step's worst and best."""
    trackers: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list, max_length=2)
    """Experiment trackers that mirror each step's metrics row and the samples: ``tensorboard`` (event files in ``<run>/tensorboard/``), ``wandb`` (Weights & Biases, in ``<run>/wandb/``). Optional packages: ``pip install 'asyncrl[trackers]'``."""  # noqa: E501
    wandb_project: str = Field(default="asyncrl", pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    """The W&B project of the ``wandb`` tracker."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline``: W&B writes the run to disk only (``wandb sync`` uploads it later); ``online``: sends as it goes, with the credentials W&B reads itself (``WANDB_API_KEY``)."""  # noqa: E501


class HealthSection(Section):
    """Run health (``learner/health/monitor.py``): non-finite steps are skipped, repeated ones roll the run back, and
    alert rules watch each step's metrics. An alert's threshold of 0 turns it off."""

    max_skipped_steps: Int = Field(default=3, ge=1, le=10_000)
    """Consecutive optimizer steps skipped for a non-finite loss or gradient (their update is never applied) after which the learner rolls back to the last healthy checkpoint."""  # noqa: E501
    rollback_lr_factor: float = Field(default=0.5, gt=0.0, le=1.0)
    """Each rollback multiplies the learning rate by this (cumulative: after two rollbacks at 0.5 the run trains at 0.25 × the schedule)."""  # noqa: E501
    max_rollbacks: Int = Field(default=3, ge=0, le=1000)
    """Rollbacks allowed in one run; when one more is due the learner stops with an error instead."""
    kl_ref_max: float = Field(default=0.5, ge=0.0, le=1e6)
    """Alert ``kl_ref_high`` while the per-token KL to the reference policy (``train/loss/kl_ref``, or ``train/kl_reward/kl`` with the KL in the reward) is above this."""  # noqa: E501
    mismatch_kl_max: float = Field(default=0.1, ge=0.0, le=1e6)
    """Alert ``mismatch_kl_high`` while KL(μ ‖ π_old) between the actors' sampling policy and the learner's (``train/offpolicy/mismatch_kl``) is above this."""  # noqa: E501
    entropy_floor: float = Field(default=0.01, ge=0.0, le=1e6)
    """Alert ``entropy_collapse`` while the mean token entropy (``train/loss/entropy``, nats) is below this."""
    entropy_drop_factor: float = Field(default=10.0, ge=0.0, le=1e6)
    """Alert ``entropy_collapse`` also while the entropy is below 1/this of its highest value in the last ``entropy_window`` steps (0 = off; else above 1)."""  # noqa: E501
    entropy_window: Int = Field(default=20, ge=2, le=1_000_000)
    """Steps over which ``entropy_drop_factor`` compares."""
    reward_flat_window: Int = Field(default=20, ge=2, le=1_000_000)
    """Alert ``reward_flat`` while the standard deviation of the last this many steps' mean rewards (``rollout/reward_mean``) is below ``reward_flat_epsilon``."""  # noqa: E501
    reward_flat_epsilon: float = Field(default=1e-3, ge=0.0, le=1e6)
    """See ``reward_flat_window``."""
    reward_error_rate: float = Field(default=0.05, ge=0.0, le=1.0)
    """Alert ``reward_errors`` while the reward service's failures (dead-lettered groups, failed calls) since the last step exceed this fraction of them plus the step's groups."""  # noqa: E501
    stale_drop_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    """Alert ``stale_drops`` while the groups a step dropped as too stale (``groups/dropped_stale``) exceed this fraction of them plus the groups it trained."""  # noqa: E501
    starving_idle_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Alert ``learner_starving`` while the learner's mean idle fraction (``step/idle_fraction``, time spent waiting for a batch) over the last ``starving_window`` steps is above this (not in a synchronous run, ``staleness.max_staleness = 0``, which waits by design)."""  # noqa: E501
    starving_window: Int = Field(default=10, ge=1, le=1_000_000)
    """Steps averaged by ``starving_idle_fraction``."""
    webhook_url: str = Field(default="", pattern=r"^(https?://\S+)?$")
    """POST each alert transition as JSON (``alert``, ``state``, ``step``, ``value``, ``message``) to this URL from a background thread; empty = none. Failures are logged, never raised."""  # noqa: E501
    webhook_timeout_s: float = Field(default=2.0, gt=0.0, le=30.0)
    """Time limit of one webhook POST."""

    @model_validator(mode="after")
    def _drop_factor_off_or_above_one(self) -> HealthSection:
        if 0.0 < self.entropy_drop_factor <= 1.0:
            raise ValueError("entropy_drop_factor must be 0 (off) or above 1 (entropy fell to 1/factor of its peak)")
        return self
