"""The rollout actor: prompt groups from Redis in, rollout groups over ZeroMQ out, weights followed live.

Started with only a Redis URL and a run name, it reads the run's config, starts its vLLM engine,
registers with a heartbeat, and then runs three loops side by side:

- **work**: while its weights are recent enough (version ≥ published − max_staleness), keep up
  to ``rollout.max_groups_in_flight`` groups generating; push each finished group to a reward
  worker (a PUSH socket per live worker, dealt round-robin: ``actors/reward_peers.py``) and record that
  worker in the ledger as the group's scorer, so that the worker's death re-issues it at once;
- **weights**: take part in the learner's weight broadcasts (:class:`asyncrl.actors.weights_follower.WeightsFollower`);
- **peers**: follow reward workers joining and leaving.

SIGTERM or SIGINT: stop taking groups, abort the ones generating and give them back to the
front of the prompt queue, leave the registry, shut the engine down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING

import redis.exceptions

from asyncrl.actors import liveness
from asyncrl.actors.environments.remote import RemoteEnvironments
from asyncrl.actors.environments.service import serves_environments
from asyncrl.actors.faults import faulted_episodes, settle_faulted
from asyncrl.actors.reward_peers import PeerDiscovery, RewardPeers
from asyncrl.actors.weights_follower import WeightsFollower
from asyncrl.actors.workflows import WorkflowContext, check_workflow
from asyncrl.common.config import RunConfig
from asyncrl.common.exit_codes import ExitCode
from asyncrl.common.net import advertise_host
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.metrics import (
    ACTOR_GENERATED_GROUPS,
    ACTOR_GENERATED_TOKENS,
    ACTOR_GENERATION_SECONDS,
    ACTOR_POLICY_VERSION,
    ACTOR_RUNNING_GROUPS,
    MetricsServer,
    start_metrics_server,
)
from asyncrl.common.plane.audit import Audit
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.heartbeat import HeartbeatThread
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.outage import exit_for_outage, outage_in
from asyncrl.common.plane.run_secret import run_seal
from asyncrl.common.staleness import StalenessBound
from asyncrl.common.transport.channel import ChannelBlocked
from asyncrl.common.wire.messages import Heartbeat, PromptGroup, RolloutGroup

if TYPE_CHECKING:
    from asyncrl.actors.engine import RolloutEngine

log = get_logger("actor")
_PEER_REFRESH_S = 2.0


class RolloutActor:
    def __init__(self, config: RunConfig, redis_url: str, actor_id: str | None = None) -> None:
        self.config = config
        self.redis_url = redis_url  # the weight group's rendezvous is in the run's Redis (common/weights/rendezvous.py)
        self.bound = StalenessBound.of(config)
        self.actor_id = actor_id or f"actor-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.plane = ControlPlane(connect(redis_url, config.transport.redis_outage_s), config.run.name)
        self.audit = Audit(self.plane.client, config.run.name, self.actor_id, "actor")
        self.weights = WeightsFollower(config, self.plane, redis_url, self.actor_id, self.audit)
        self.engine: RolloutEngine | None = None  # from run() until _shutdown
        self.workflow = check_workflow(config.rollout.workflow)  # how a prompt group becomes a rollout
        # Every message is sealed with the run secret: reward workers refuse anything else before decoding it.
        seal = run_seal(self.plane.client, self.plane.keys, "rollouts")
        self.push = RewardPeers(hwm=config.transport.zmq_hwm, send_timeout_s=30, seal=seal)
        self.environments: RemoteEnvironments | None = None  # episodes' environments on the reward workers
        if serves_environments(config):
            self.environments = RemoteEnvironments(
                config.environment, run_seal(self.plane.client, self.plane.keys, "environments")
            )
        # A ZeroMQ socket is not thread-safe: every send goes through this one thread, in order.
        self._sender = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="push")
        self.peers = PeerDiscovery(config, self.plane, self.push, self._sender, self.environments)
        self._running: dict[str, tuple[PromptGroup, asyncio.Task]] = {}
        self._tasks: set[asyncio.Task] = set()  # every generation task, including ones still delivering
        self._tokens = _Rate()
        self._stopping = asyncio.Event()
        self._behind = False
        self.engine_died = False  # vLLM's engine process is gone: the actor stops and exits with an error
        self.metrics: MetricsServer | None = None
        self.heartbeat = HeartbeatThread(
            self.plane, self._heartbeat, config.transport.heartbeat_s, config.transport.heartbeat_ttl_s
        )

    @property
    def state(self) -> str:
        """What the actor is doing, as rl-top and the learner see it."""
        if self._stopping.is_set():
            return "draining"
        if self.engine is None:
            return "starting"
        if self.weights.syncing:
            return "syncing"
        if self._running:
            return "generating"
        if self._behind:
            return "waiting-weights"
        return "idle" if self.peers.connected else "waiting-reward"

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            process_id=self.actor_id,
            kind="actor",
            state=self.state,
            version=self.weights.version,
            tokens_per_s=self._tokens.per_second(),
            host=advertise_host(),
            pid=os.getpid(),
            metrics_url=self.metrics.url if self.metrics is not None else "",
            weights_digest=self.weights.digest,
            weight_ranks=self.config.rollout.tensor_parallel_size,
        )

    def _serve_metrics(self) -> None:
        """/metrics on ``monitoring.metrics_port`` (0 = a free one); the heartbeat advertises it."""
        port = self.config.monitoring.metrics_port
        self.metrics = start_metrics_server(
            self.config.run.name, self.actor_id, "actor", port, addr=self.config.monitoring.metrics_host
        )
        ACTOR_POLICY_VERSION.set_function(lambda: self.weights.version)
        ACTOR_RUNNING_GROUPS.set_function(lambda: len(self._running))

    async def run(self) -> None:
        from asyncrl.actors.engine import RolloutEngine

        self._serve_metrics()
        self.heartbeat.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            seed = self.config.run.seed + os.getpid()
            self.engine = await asyncio.to_thread(RolloutEngine, self.config, seed, lambda: self.weights.version)
            await self._first_token()
            self.heartbeat.beat()
            log.info("actor ready", actor=self.actor_id, run=self.config.run.name, model=self.config.model.path)
            stopped = self._stopping.is_set
            threading.Thread(target=self.weights.listen, args=(stopped,), daemon=True).start()
            follow = self.weights.follow(self.engine, stopped, self._stop_if_engine_died)
            await asyncio.gather(self._work_loop(), follow, self._peers_loop(), self._liveness_loop())
        finally:
            await self._shutdown()

    async def _first_token(self) -> None:
        """:meth:`RolloutEngine.first_token`, or :class:`EngineRefused` saying the engine cannot generate."""
        from asyncrl.actors.engine import error_line

        try:
            await self.started_engine.first_token()
        except Exception as exc:
            raise EngineRefused(
                f"model.path: vLLM started an engine for {self.config.model.path} but could not generate one token "
                f"with the run's [rollout] settings: {error_line(exc)}; `rl-learner check-model CONFIG` runs the same "
                "check on its own"
            ) from exc

    # ------------------------------------------------------------------ work

    def _in_sync(self) -> bool:
        """Generate only with weights the learner can still use (avoid producing groups it would drop)."""
        self._behind = not self.bound.may_generate(self.weights.version, self.plane.run.version())
        return not self._behind

    async def _work_loop(self) -> None:
        limit = self.config.rollout.max_groups_in_flight
        while not self._stopping.is_set():
            free = limit - len(self._running)
            if free <= 0 or not self.peers.connected or not await asyncio.to_thread(self._in_sync):
                await self._sleep(0.05)
                continue
            # Every free slot at once: a batch the dispatcher released together reaches the engine together.
            groups = await asyncio.to_thread(self.plane.prompts.take_prompts, self.actor_id, free, 0.5)
            if groups and self._stopping.is_set():
                await asyncio.to_thread(self.plane.prompts.return_prompts, groups)
                continue
            for group in groups:
                request_id = f"{group.group_id}-{uuid.uuid4().hex[:6]}"
                task = asyncio.create_task(self._generate(group, request_id))
                self._running[request_id] = (group, task)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _generate(self, group: PromptGroup, request_id: str) -> None:
        taken_at = time.time()  # wall clock, as the learner's issue time: the group's timeline spans hosts
        try:
            await self._catch_up(group)
            turn = WorkflowContext.of(self.config, self.actor_id, request_id, self.environments)
            rollout = await self.workflow(self.started_engine, group, turn)
            rollout = dataclasses.replace(rollout, timings={**rollout.timings, "taken_at": taken_at})
        except asyncio.CancelledError:
            raise  # _shutdown aborted it and hands the group back
        except Exception as exc:
            log.error("generation failed; returning the group", group=group.group_id, error=repr(exc))
            self._running.pop(request_id, None)
            self._stop_if_engine_died(exc)
            await asyncio.to_thread(self.plane.prompts.return_prompts, [group])
            return
        # Finished work is delivered even during shutdown: it leaves _running first, so it is not also returned.
        self._running.pop(request_id, None)
        self._count(rollout)
        if faulted := faulted_episodes(rollout):  # an environment fault is never trained (actors/faults.py)
            attempts = self.config.environment.fault_attempts
            await asyncio.to_thread(settle_faulted, self.plane, group, faulted, attempts)
            return
        try:
            worker = await self._on_sender(self.push.send, rollout)
        except ChannelBlocked as exc:
            log.warning("reward workers not keeping up; returning the group", group=group.group_id, error=exc)
            await asyncio.to_thread(self.plane.prompts.return_prompts, [group])
            return
        await asyncio.to_thread(self.plane.prompts.pushed, group.group_id, self.actor_id, worker)

    def _weights_for(self, group: PromptGroup) -> int:
        """The weights ``group`` is generated with. An eval group evaluates the policy it was issued at; a training
        group waits for the weights of its release when they are on their way (:meth:`StalenessBound.sampling_version`:
        with ``weight_sync.overlap`` the learner releases version r's groups while it still sends r, and sampled with
        r − 1 they would be dropped as stale)."""
        if group.purpose == "eval":
            return group.issued_version
        return self.bound.sampling_version(group.issued_version, self.plane.run.sending())

    async def _catch_up(self, group: PromptGroup) -> None:
        """Wait for the weights :meth:`_weights_for` names (at most ``weight_sync.timeout_s``; the tokens' versions say
        what generated them either way, and the learner judges them by those). Asked again every half second: a sync
        that failed says at once that its version is not coming; a version this actor refused is not coming either
        (with one actor, waiting for the next would wait for a step that needs this group)."""
        deadline = time.monotonic() + self.config.weight_sync.timeout_s
        wanted, asked = await asyncio.to_thread(self._weights_for, group), time.monotonic()
        while self._awaits(wanted) and time.monotonic() < deadline and not self._stopping.is_set():
            await self._sleep(0.05)
            if time.monotonic() - asked >= 0.5:
                wanted, asked = await asyncio.to_thread(self._weights_for, group), time.monotonic()

    def _awaits(self, wanted: int) -> bool:
        """Whether to wait before sampling for weights ``wanted``: newer than those served, and still coming."""
        return self.weights.version < wanted and self.weights.coming(wanted)

    def _count(self, rollout: RolloutGroup) -> None:
        """A finished group into the heartbeat's tokens/s and the Prometheus counters."""
        tokens = int(rollout.lengths.sum())
        self._tokens.add(tokens)
        ACTOR_GENERATED_TOKENS.inc(tokens)
        ACTOR_GENERATED_GROUPS.inc()
        if "generate" in rollout.timings:
            ACTOR_GENERATION_SECONDS.observe(rollout.timings["generate"])

    # ------------------------------------------------------------------ peers

    async def _peers_loop(self) -> None:
        """Follow reward workers joining and leaving (:class:`PeerDiscovery`); stop the actor once the run has
        finished (its learner took the last step)."""
        while not self._stopping.is_set():
            if (finished := await asyncio.to_thread(self.plane.run.finished)) is not None:
                log.info("run finished; the actor stops", run=self.config.run.name, step=finished)
                self._stopping.set()
                return
            await self.peers.refresh()
            await self._sleep(_PEER_REFRESH_S)

    async def _liveness_loop(self) -> None:
        """Touch the alive file while the engine makes progress (``actors/liveness.py``)."""
        path = liveness.alive_file()
        stall_s = liveness.stall_limit_s(self.config.environment.step_timeout_s)
        settled_at, warned = time.monotonic(), False  # the last moment the engine was idle or loading weights
        while path is not None and not self._stopping.is_set():
            now, running, syncing = time.monotonic(), len(self._running), self.weights.syncing
            if not running or syncing:
                settled_at = now
            since = now - max(self.started_engine.last_output, settled_at)
            if liveness.engine_progressing(running, syncing, since, stall_s):
                try:
                    await asyncio.to_thread(liveness.touch, path)
                except OSError as exc:  # said once; the next touch may work (a full /tmp freed)
                    if not warned:
                        log.warning("cannot touch the alive file", path=str(path), error=repr(exc))
                    warned = True
            else:
                log.error(
                    "engine made no progress; the liveness check will fail",
                    actor=self.actor_id,
                    running=running,
                    seconds_without_progress=round(since),
                    action="none: the kubelet restarts the actor and its groups are re-issued",
                )
            await self._sleep(liveness.TOUCH_S)

    async def _on_sender(self, fn, *args):
        """Run ``fn(*args)`` on the one thread that owns the PUSH socket."""
        return await asyncio.get_running_loop().run_in_executor(self._sender, fn, *args)

    @property
    def started_engine(self) -> RolloutEngine:
        """The engine, which :meth:`run` starts before anything that generates."""
        if self.engine is None:
            raise RuntimeError(f"{self.actor_id}: the rollout engine is not running (not started, or shut down)")
        return self.engine

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    # ------------------------------------------------------------------ shutdown

    def _stop_if_engine_died(self, exc: BaseException) -> None:
        """vLLM's engine process died (its error is in this actor's log above): stop and exit with an error, so
        that the unfinished groups go back to the queue and a supervisor restarts the actor."""
        dead = type(exc).__name__ == "EngineDeadError" or (self.engine is not None and self.engine.dead)
        if not dead or self.engine_died:
            return
        self.engine_died = True
        log.error(
            "vLLM engine died; stopping this actor",
            actor=self.actor_id,
            action="see the EngineCore traceback above in this log; start the actor again",
        )
        self._stopping.set()

    async def _shutdown(self) -> None:
        self._stopping.set()
        unfinished = [group for group, _ in self._running.values()]
        for request_id, (_, task) in list(self._running.items()):
            if self.engine is not None and not self.engine_died:
                with contextlib.suppress(Exception):
                    await self.engine.abort(request_id)
            task.cancel()
        if unfinished:
            try:
                self.plane.prompts.return_prompts(unfinished)
                log.info("returned unfinished groups to the queue", count=len(unfinished))
            except redis.exceptions.RedisError as exc:  # Redis gone for good: their deadline re-issues them
                log.warning(
                    "could not give unfinished groups back; the learner re-issues them",
                    count=len(unfinished),
                    error=exc,
                )
        if self._tasks:  # let finished groups finish sending before the socket closes
            await asyncio.wait(self._tasks, timeout=self.push.send_timeout_s + 5)
        self.heartbeat.stop(leave=True)
        self._sender.shutdown(wait=True)
        self.push.close()
        if self.environments is not None:
            self.environments.close()
        if self.engine is not None:
            if not self.engine_died:
                with contextlib.suppress(Exception):  # best effort: the learner evicts a member that is gone anyway
                    await asyncio.wait_for(self.engine.leave_weight_group(), 10)
            with contextlib.suppress(Exception):
                self.engine.shutdown()
            self.engine = None
        if self.metrics is not None:
            self.metrics.close()
        log.info("actor stopped", actor=self.actor_id)


class _Rate:
    """Tokens per second over a sliding window (added to by the event loop, read by the heartbeat thread)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:
            self._events.append((time.monotonic(), tokens))

    def per_second(self) -> float:
        cutoff = time.monotonic() - self.window_s
        with self._lock:
            self._events = [e for e in self._events if e[0] >= cutoff]
            return sum(n for _, n in self._events) / self.window_s


class EngineRefused(RuntimeError):
    """The actor's engine started but cannot generate with the run's settings (:meth:`RolloutActor._first_token`)."""


def run_actor(config: RunConfig, redis_url: str, actor_id: str | None = None) -> int:
    """Run one rollout actor until SIGTERM/SIGINT; the exit code (1 when its vLLM engine died, 2 when it cannot
    generate one token with the run's settings, 75 when Redis was unreachable for longer than
    ``transport.redis_outage_s``)."""
    actor = RolloutActor(config, redis_url, actor_id)
    try:
        asyncio.run(actor.run())
    except EngineRefused as exc:  # a setting no restart will change: exit 2, as a refused config
        log.error("actor refused the run's settings", actor=actor.actor_id, problem=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    except Exception as exc:
        if (outage := outage_in(exc)) is None:
            raise
        return exit_for_outage(outage, actor.actor_id)  # 75: Redis down for longer than transport.redis_outage_s
    return 1 if actor.engine_died else 0
