"""The reward worker: pulls rollout groups over ZeroMQ, scores them, writes them to the replay stream.

One worker, one loop (:meth:`RewardWorker.run`)::

    PULL rollouts ──► score every response with reward.functions ──► XADD replay (in small batches)
                         │ a call past reward.timeout_s, or raising, is retried reward.retries times
                         └─ still failing, or an episode its replay refuses ──► dead-letter stream
                            (source "reward", the reason, the group)

Nothing is dropped silently: a group taken off the socket ends in the replay stream or in the
dead-letter stream; a message that does not decode is counted, logged (rate-limited), dead-lettered (source
``reward:malformed``, ``common/plane/dead_letters.py: MalformedLetters``) and skipped (``common/transport/channel.py``).
Groups are scored one at a time; run more workers to score more (actors' PUSH sockets deal groups
round-robin among every live worker's PULL socket).

Registry and health: a heartbeat every ``transport.heartbeat_s`` (TTL ``transport.heartbeat_ttl_s``)
says where the PULL socket is bound (``endpoint``) and the worker's state, which is its health answer:

=============  ==========================================================================
``starting``   registered, not yet bound
``ready``      scoring; the last call of every reward function succeeded
``degraded``   scoring, but the last call of some reward function failed or timed out
``draining``   SIGTERM/SIGINT received: finishing the group in hand, taking no new one
=============  ==========================================================================

Environments: with ``environment.isolation = "workers"`` in a multi-turn run the worker also serves the episodes'
environments to every actor (``actors/environments/service.py``), on a port of its own that its heartbeat advertises
(``environment_endpoint``), with the public key of the Ed25519 key pair it made at start
(``environment_signing_key``; the private key never leaves this process). It signs what an environment that cannot be
replayed says, and scores such an environment's episodes by checking the signatures, made with a key some reward
worker of the run advertised since this one started (``common/wire/attestation.py``), instead of replaying them.

A finished run (its learner took the last step) stops the worker as SIGTERM does, within a few seconds.

Stopping (SIGTERM/SIGINT): finish and write the group in hand, leave the registry, close the socket,
exit 0. Groups still queued in the socket die with it; the in-flight ledger re-issues them. A worker whose reward
calls keep hanging (``actors/timed_calls.py: MAX_ABANDONED_CALLS`` abandoned and still running) dead-letters the group
in hand and exits 1: only a new process frees those threads.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

from asyncrl.actors.environments.notary import Notary
from asyncrl.actors.environments.service import EnvironmentService, serves_environments
from asyncrl.actors.episode_scoring import EpisodeMismatch
from asyncrl.actors.episodes import environment_host
from asyncrl.actors.timed_calls import CallTimedOut, TimedCalls, WorkerStalled
from asyncrl.common.config import RewardFunction, RunConfig
from asyncrl.common.data.tasks import task_label
from asyncrl.common.environments.protocol import is_replayable
from asyncrl.common.net import advertise_host, advertised_endpoint
from asyncrl.common.observability.logs import get_logger, worth_logging
from asyncrl.common.observability.metrics import (
    REWARD_DEAD_LETTERED_GROUPS,
    REWARD_FAILED_CALLS,
    REWARD_REFUSED_GROUPS,
    REWARD_REPLACED_TEXTS,
    REWARD_SCORED_GROUPS,
    REWARD_SCORING_SECONDS,
    REWARD_TIMED_OUT_CALLS,
    MetricsServer,
    start_metrics_server,
)
from asyncrl.common.plane.audit import Audit
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.dead_letters import MalformedLetters, dead_letter
from asyncrl.common.plane.heartbeat import HeartbeatThread
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.outage import exit_for_outage, outage_clock, outage_in
from asyncrl.common.plane.replay import ReplayWriter
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.rewards.functions import (
    RewardError,
    Score,
    bind_functions,
    combine,
    episode_options,
    score,
    time_limit,
)
from asyncrl.common.rewards.response_text import ResponseTexts
from asyncrl.common.transport.channel import PullChannel
from asyncrl.common.transport.curve import CurveServer
from asyncrl.common.wire.attestation import KnownSigners, Signer
from asyncrl.common.wire.messages import (
    Heartbeat,
    Limits,
    RolloutGroup,
    ScoredGroup,
    encode_blob,
)
from asyncrl.common.wire.provenance import episode_tokens, issue_mismatch

log = get_logger("reward")

WRITE_BATCH = 8
"""Most scored groups written in one Redis round trip (fewer when no more groups are waiting)."""
POLL_S = 0.2
"""How long the loop waits for a group before checking for a stop request."""
FINISHED_CHECK_S = 2.0
"""How often an idle worker asks Redis whether the run has finished (then it exits 0)."""


class RewardWorker:
    """Scores rollout groups for one run; see the module docstring for the loop and its states.

    Use :func:`run_until_stopped` from a command line; in code: ``start()``, ``run()`` (returns after
    ``stop()``), ``close()``.
    """

    def __init__(self, config: RunConfig, redis_url: str, worker_id: str) -> None:
        self.task = task_label(config.task)
        self.config = config
        self.worker_id = worker_id
        self.client = connect(redis_url, config.transport.redis_outage_s)
        self.plane = ControlPlane(self.client, config.run.name)
        # Made here, kept here: only its public key is ever shown (the heartbeat's environment_signing_key).
        self.signer = Signer() if serves_environments(config) else None
        self.signers = KnownSigners(self._advertised_signing_keys, [self.signer.public_hex] if self.signer else [])
        self._signers_read = 0.0
        # Resolved now, from the config: an unknown function or verifier fails here, not on every group.
        episodes = {**episode_options(config), "signers": self.signers}
        self.functions = bind_functions(config.reward.functions, self.task, episodes)
        self.audit = Audit(self.client, config.run.name, worker_id, "reward")
        self.replay = ReplayWriter(self.client, self.plane.keys, maxlen=config.transport.replay_maxlen)
        limits = Limits(max_bytes=int(config.transport.max_message_mb * 2**20))
        self.malformed = MalformedLetters(self.client, self.plane.keys)
        self.channel = PullChannel(
            "rollouts",
            RolloutGroup,
            hwm=config.transport.zmq_hwm,
            limits=limits,
            on_malformed=self.malformed.add,
            seal=run_seal(self.client, self.plane.keys, "rollouts"),
            on_unsealed=self._unsealed,
        )
        self.channel.on_refused_handshake = functools.partial(self._handshake_refused, "rollouts")
        # What is scored is the decode of the token ids the learner trains, never the texts a message carries.
        self.texts = ResponseTexts.load(config.model.path)
        self.calls = TimedCalls()
        self.endpoint = ""
        self.environments: EnvironmentService | None = None  # environment.isolation = "workers": served to actors
        self.metrics: MetricsServer | None = None
        self._ready = False
        self._failing: set[str] = set()  # functions whose last call failed
        self._refused: dict[str, int] = {}  # groups refused so far, by reason (logged at 1, 10, 100, ...)
        self._stop = threading.Event()
        self._finished_checked = 0.0
        transport = config.transport
        self.heartbeats = HeartbeatThread(self.plane, self.heartbeat, transport.heartbeat_s, transport.heartbeat_ttl_s)

    # -- lifecycle
    def start(self) -> str:
        """Register, bind the PULL socket, serve /metrics; returns the endpoint advertised in the heartbeat."""
        self.heartbeats.start()  # "starting": visible in rl-top before the socket is up
        bound = self.channel.bind(self.config.transport.zmq_endpoint, self._curve())
        self.endpoint = advertised_endpoint(bound)
        if serves_environments(self.config):
            self._serve_environments(bound)
        monitoring = self.config.monitoring
        self.metrics = start_metrics_server(
            self.config.run.name, self.worker_id, "reward", monitoring.metrics_port, addr=monitoring.metrics_host
        )
        self._ready = True
        self.heartbeats.beat()  # "ready", with the endpoint: actors may connect now
        log.info(
            "reward worker ready",
            worker=self.worker_id,
            run=self.config.run.name,
            endpoint=self.endpoint,
            task=self.task,
            functions=",".join(f"{f.name}*{f.weight:g}" for f in self.functions),
            timeout_s=self.config.reward.timeout_s,
            retries=self.config.reward.retries,
        )
        return self.endpoint

    def stop(self) -> None:
        """Ask :meth:`run` to return after the group in hand (safe to call from a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        """Leave the registry (stopping heartbeats first) and close the socket and the Redis connection."""
        try:
            self.heartbeats.stop(leave=True)
        finally:
            if self.metrics is not None:
                self.metrics.close()
            if self.environments is not None:
                self.environments.close()
            self.channel.close()
            self.client.close()

    @property
    def state(self) -> str:
        """The health answer published in the heartbeat: starting, ready, degraded or draining."""
        if self._stop.is_set():
            return "draining"
        if not self._ready:
            return "starting"
        return "degraded" if self._failing else "ready"

    # -- the loop
    def run(self) -> None:
        """Score groups until :meth:`stop`; scored groups are written before it returns."""
        pending: list[ScoredGroup] = []
        outages = outage_clock(self.client)  # its heartbeats tell it Redis is gone even while no rollout comes
        try:
            while not self._stop.is_set():
                if outages is not None:
                    outages.check()
                group = self.channel.recv(timeout_s=0 if pending else POLL_S)
                if group is None:  # nothing more waiting: write what we have now rather than wait for a batch
                    self._flush(pending)
                    self._stop_if_finished()
                    self._read_signers()
                    continue
                scored = self._score(group)
                if scored is not None:
                    pending.append(scored)
                if len(pending) >= WRITE_BATCH:
                    self._flush(pending)
        finally:
            self._flush(pending)

    def _stop_if_finished(self) -> None:
        """Stop once the run has finished (its learner took the last step): looked at every few seconds, when idle."""
        now = time.monotonic()
        if now - self._finished_checked < FINISHED_CHECK_S:
            return
        self._finished_checked = now
        if (step := self.plane.run.finished()) is not None:
            log.info("run finished; the reward worker stops", run=self.config.run.name, step=step)
            self._stop.set()

    def _read_signers(self) -> None:
        """Learn the signing keys the run's reward workers advertise now, every few seconds while idle: one that
        serves an episode and leaves before the episode is scored is known (a key is also read when first seen)."""
        now = time.monotonic()
        if self.signer is None or now - self._signers_read < FINISHED_CHECK_S:
            return
        self._signers_read = now
        self.signers.refresh()

    def _advertised_signing_keys(self) -> list[str]:
        live, _ = self.plane.registry.processes()
        return [beat.environment_signing_key for beat in live if beat.kind == "reward"]

    def _flush(self, pending: list[ScoredGroup]) -> None:
        self.malformed.flush()
        if pending:
            self.replay.add(pending)
            self.plane.prompts.stored(g.rollout.group_id for g in pending)  # in the stream: this worker holds none
            REWARD_SCORED_GROUPS.inc(len(pending))
            pending.clear()

    def _score(self, group: RolloutGroup) -> ScoredGroup | None:
        """The scored group, or None when it was dead-lettered; re-raises :class:`WorkerStalled`."""
        refusal = self._refusal(group)
        if refusal is not None:
            self._refuse(group, *refusal)
            return None
        self._hold(group)
        group, replaced = self.texts.rewrite(group)
        if replaced:
            REWARD_REPLACED_TEXTS.inc(replaced)
        started = time.perf_counter()
        try:
            rewards, details, turn_rewards = combine(group, self.functions, call=self._call)
        except RewardError as exc:
            self._dead_letter(group, exc)
            if isinstance(exc, WorkerStalled):
                raise
            return None
        REWARD_SCORING_SECONDS.observe(time.perf_counter() - started)
        rewards_array = np.asarray(rewards, dtype=np.float32)
        if group.attestations:  # checked: the learner trusts this worker's scores, and needs none of their bytes
            group = dataclasses.replace(group, attestations=[])
        return ScoredGroup(
            rollout=group, rewards=rewards_array, details=details, scorer_id=self.worker_id, turn_rewards=turn_rewards
        )

    def _call(self, function: RewardFunction, group: RolloutGroup) -> list[Score]:
        """One function on one group: up to ``1 + reward.retries`` attempts, each within ``reward.timeout_s``."""
        attempts, timeout_s = 1 + self.config.reward.retries, time_limit(function, self.config.reward.timeout_s)
        error = ""
        for attempt in range(1, attempts + 1):
            try:
                scores = self.calls.run(function.name, score, (function, group), timeout_s)
            except CallTimedOut as exc:
                REWARD_TIMED_OUT_CALLS.labels(function.name).inc()
                error = str(exc)
            except WorkerStalled:
                raise
            except EpisodeMismatch as exc:  # the function did its job, on a forged group: no retry, not degraded
                self._mark(function.name, failed=False)
                raise RewardError(function.name, f"refused: {exc}") from exc
            except Exception as exc:  # whatever a user's function raises is its failure, to retry
                REWARD_FAILED_CALLS.labels(function.name).inc()
                error = f"{type(exc).__name__}: {exc}"
            else:
                self._mark(function.name, failed=False)
                return scores
            log.warning(
                "reward call failed",
                function=function.name,
                group=group.group_id,
                attempt=f"{attempt}/{attempts}",
                error=error,
                action="retrying" if attempt < attempts else "dead-lettering the group",
            )
            self._mark(function.name, failed=True)
        raise RewardError(function.name, f"failed {attempts} attempt(s), the last: {error}")

    def _mark(self, function: str, failed: bool) -> None:
        """Record the outcome of a function's last call; publish a change of state at once."""
        import redis.exceptions

        before = self.state
        if failed:
            self._failing.add(function)
        else:
            self._failing.discard(function)
        if self.state == before:
            return
        log.info("reward worker state changed", worker=self.worker_id, state=self.state, was=before)
        try:
            self.heartbeats.beat()
        except redis.exceptions.RedisError as exc:  # the heartbeat thread publishes it at its next beat
            log.warning("could not publish the new state now", worker=self.worker_id, error=exc)

    def _refusal(self, group: RolloutGroup) -> tuple[str, str] | None:
        """(reason, detail) when ``group`` is not this run's to score (``common/wire/provenance.py``), else None.

        Every sealed message goes through the same checks in the same order, whatever its id's state: the id's
        standing (a group already trained is refused: its re-issued twin won, and nothing more is learnt from
        scoring it), then the issue record (id, task, prompt, K, versions), then the payload's bounds. Membership
        (the seal) was checked before the message was decoded (``common/transport/channel.py``).
        """
        standing = self.plane.prompts.lookup([group.group_id])[group.group_id]
        if standing.completed:
            return "trained", "its id was already trained"
        if group.task != self.task:
            return "task", f"task {group.task[:80]!r} is not this run's task {self.task!r}"
        mismatch = issue_mismatch(
            standing.issued, group, self.config.rollout.max_new_tokens, episode_tokens=episode_tokens(self.config)
        )
        return ("issue_record", mismatch) if mismatch is not None else None

    def _hold(self, group: RolloutGroup) -> None:
        """This worker alone holds ``group`` now (the ledger's scorer): if it dies before the group is in the replay
        stream, the learner re-issues it once this worker's heartbeat expires (``common/plane/prompt_ledger.py``)."""
        self.plane.prompts.received(group.group_id, self.worker_id)

    def _refuse(self, group: RolloutGroup, reason: str, detail: str) -> None:
        """Dead-letter a group that is not this run's to score; count it; log the 1st, 10th, 100th, … of a reason."""
        dead_letter(self.client, self.plane.keys, "reward:refused", detail, encode_blob(group))
        REWARD_REFUSED_GROUPS.labels(reason).inc()
        count = self._refused[reason] = self._refused.get(reason, 0) + 1
        if worth_logging(count):
            log.warning(
                "refused a rollout group without scoring it",
                group=group.group_id[:80],
                actor=group.actor_id[:80],
                reason=detail,
                refused=count,
                action="a peer that is not one of this run's actors may be sending to this worker: "
                "bind beyond loopback only with CURVE keys (transport.curve_*)",
            )

    def _dead_letter(self, group: RolloutGroup, exc: RewardError) -> None:
        dead_letter(self.client, self.plane.keys, "reward", str(exc), encode_blob(group))
        # Final (the group passed its issue record and still cannot be scored: a replay that differs, a function
        # that kept failing): the learner frees its slot at once. Not a refusal before that check — a group under a
        # hijacked id must not retire the real one — nor a stalled worker's, re-issued when the worker is replaced.
        if not isinstance(exc, WorkerStalled):
            self.plane.prompts.note_refused(group.group_id)
        REWARD_DEAD_LETTERED_GROUPS.labels(exc.function).inc()
        log.warning(
            "dead-lettered a rollout group that could not be scored",
            group=group.group_id,
            function=exc.function,
            reason=exc.reason,
            action=f"inspect with XRANGE {self.plane.keys.dead} - +; fix the function, "
            "or raise reward.timeout_s / reward.retries",
        )

    # -- registry and metrics
    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            process_id=self.worker_id,
            kind="reward",
            state=self.state,
            host=advertise_host(),
            pid=os.getpid(),
            metrics_url=self.metrics.url if self.metrics is not None else "",
            endpoint=self.endpoint,
            curve_public_key=self.channel.curve_public_key,
            environment_endpoint="" if self.environments is None else advertised_endpoint(self.environments.endpoint),
            environment_signing_key="" if self.environments is None or self.signer is None else self.signer.public_hex,
        )

    def _serve_environments(self, pull_endpoint: str) -> None:
        """Serve the run's environments to actors on a port of their own, on the host the PULL socket is bound to,
        with the same CURVE keys; they live in this worker's environment process, as its replays' do."""
        section = self.config.environment
        seal = run_seal(self.client, self.plane.keys, "environments")
        assert self.signer is not None  # made for a worker that serves environments
        notary = None if is_replayable(section.name) else Notary(self.signer, self.config.run.name)
        host = environment_host(section)
        host.start()  # before the endpoint is advertised: no actor's request is charged the start
        self.environments = EnvironmentService(section, seal, host, notary)
        self.environments.socket.on_refused_handshake = functools.partial(self._handshake_refused, "environments")
        self.environments.start(pull_endpoint.rsplit(":", 1)[0] + ":0", self._curve())

    def _curve(self) -> CurveServer | None:
        transport = self.config.transport
        if not transport.curve_server_key:
            return None  # channel.bind refuses an endpoint beyond loopback without keys
        if not transport.curve_client_keys:
            raise ValueError("transport.curve_client_keys must name the folder of authorised client public keys")
        return CurveServer(Path(transport.curve_server_key), Path(transport.curve_client_keys), self._key_refused)

    def _unsealed(self, count: int) -> None:
        """A message without a valid seal was refused: in the audit trail, the 1st, 10th, 100th, … of them."""
        self.audit.refused("message.unsealed", "no valid seal", channel=self.channel.name, refused=count)

    def _handshake_refused(self, channel: str, count: int) -> None:
        """A connection failed the CURVE handshake (no run credential): in the audit trail, the 1st, 10th, 100th, …"""
        self.audit.refused("connection.refused", f"failed CURVE handshake on {channel}", channel=channel, refused=count)

    def _key_refused(self, client_key: str) -> None:
        """A CURVE client key was refused: in the audit trail, the 1st, 10th, 100th, … refusal of each key."""
        self.audit.refused("key.refused", client_key, channel=self.channel.name, client_key=client_key)


def run_until_stopped(worker: RewardWorker) -> int:
    """Run ``worker`` until SIGTERM or SIGINT, then finish the group in hand, leave and close.

    Returns the exit status: 0 after a requested stop, 1 when the worker stalled on hung reward calls, 75 when Redis
    was unreachable for longer than ``transport.redis_outage_s``.
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    try:
        worker.start()
        worker.run()
    except WorkerStalled as exc:
        log.error(
            "reward worker stalled",
            worker=worker.worker_id,
            function=exc.function,
            reason=exc.reason,
            action="restart it; make the function finish within reward.timeout_s",
        )
        return 1
    except Exception as exc:
        if (outage := outage_in(exc)) is None:
            raise
        return exit_for_outage(outage, worker.worker_id)
    finally:
        worker.close()
    log.info("reward worker stopped", worker=worker.worker_id)
    return 0
