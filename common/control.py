"""The run's control plane in Redis: config, policy version, process registry, prompt queue, ledger.

Every key of a run lives under ``asyncrl:<run>:`` (see :class:`RunKeys`), so several runs can
share one Redis and ``redis-cli --scan --pattern 'asyncrl:<run>:*'`` shows everything of one.

Delivery semantics:

- **prompt queue** (a list): FIFO; ``take_prompt`` pops atomically, so each group goes to one
  actor. A group that an actor gives back (SIGTERM) goes to the *front*. A group popped by an
  actor that then dies is not in the queue any more: the in-flight ledger (issue time, actor)
  is what lets the dispatcher find and re-issue it.
- **registry**: a heartbeat key per process with a TTL, plus a set of every process ever seen.
  A member of the set whose key has expired has died (or was killed) without saying goodbye.
- **dead letters**: anything undecodable goes to the ``dead`` stream with its source and the
  reason, never silently dropped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.config import RunConfig
from common.logs import get_logger
from common.wire import (
    Decoder,
    Heartbeat,
    Limits,
    PromptGroup,
    WeightManifest,
    WireError,
    decode_blob,
    encode_blob,
    unpack_frames,
)

if TYPE_CHECKING:
    import redis

log = get_logger("control")
DEAD_LETTER_MAXLEN = 10_000


class RunNotFoundError(LookupError):
    """The run has no published config in this Redis."""


@dataclass(frozen=True)
class RunKeys:
    """The names of every Redis key of one run."""

    run: str

    def _k(self, name: str) -> str:
        return f"asyncrl:{self.run}:{name}"

    @property
    def config(self) -> str:
        return self._k("config")

    @property
    def version(self) -> str:
        return self._k("version")

    @property
    def manifest(self) -> str:
        return self._k("manifest")

    @property
    def manifest_channel(self) -> str:
        """Pub/sub channel on which a new manifest is announced (its payload is the version)."""
        return self._k("manifest:announce")

    @property
    def processes(self) -> str:
        return self._k("processes")

    def heartbeat(self, process_id: str) -> str:
        return self._k(f"heartbeat:{process_id}")

    @property
    def prompts(self) -> str:
        return self._k("prompts")

    @property
    def inflight(self) -> str:
        return self._k("inflight")

    @property
    def replay(self) -> str:
        return self._k("replay")

    @property
    def dead(self) -> str:
        return self._k("dead")

    @property
    def groups(self) -> str:
        """Hash: group id → encoded :class:`PromptGroup` of every issued group not yet completed or lost."""
        return self._k("groups")

    @property
    def dispatch(self) -> str:
        """Hash of the dispatcher's counters (see ``learner/dispatcher.py``)."""
        return self._k("dispatch")

    @property
    def done(self) -> str:
        """Set of the ids of completed groups (to tell a late duplicate of a re-issued group)."""
        return self._k("done")

    def metrics_endpoint(self, process_id: str) -> str:
        """JSON of where ``process_id`` serves ``/metrics`` (TTL, refreshed while it runs)."""
        return self._k(f"metrics:{process_id}")

    @property
    def metrics_endpoints(self) -> str:
        """Set of every process id that ever registered a ``/metrics`` endpoint."""
        return self._k("metrics-endpoints")

    @property
    def summary(self) -> str:
        """JSON of the learner's latest step (a subset of its metrics.jsonl row), for rl-top."""
        return self._k("summary")

    @property
    def alerts(self) -> str:
        """JSON list of the alerts the learner's health check holds active now."""
        return self._k("alerts")


def connect(url: str) -> redis.Redis:
    """A Redis client with sane time limits (a dead server raises instead of hanging forever).

    Replies are parsed by hiredis when it is installed (fast for the replay stream's large
    entries), but commands are always packed by redis-py's Python serializer: it sends values
    above 6 kB as separate buffers, where hiredis's packer copies every 100 kB group once more.
    """
    import redis
    from redis.connection import Encoder, PythonRespSerializer

    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    return redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30, command_packer=packer)


def dead_letter(client: redis.Redis, keys: RunKeys, source: str, reason: str, payload: bytes) -> None:
    """Keep an unacceptable message with where it came from and why it was refused."""
    fields = {"source": source, "reason": reason, "payload": payload, "at": f"{time.time():.3f}"}
    client.xadd(keys.dead, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)


@dataclass(frozen=True)
class LedgerEntry:
    """Where one issued prompt group is: when and at which version it was issued, and by whom it is held."""

    issued_at: float
    version: int
    actor: str = ""
    attempts: int = 1


class ControlPlane:
    """Typed access to one run's control keys."""

    def __init__(self, client: redis.Redis, run: str, limits: Limits | None = None) -> None:
        self.client = client
        self.keys = RunKeys(run)
        self._prompt_decoder = Decoder(PromptGroup, limits)
        self._heartbeat_decoder = Decoder(Heartbeat, limits)
        self._manifest_decoder = Decoder(WeightManifest, limits)

    # -- config and version
    def publish_config(self, config: RunConfig) -> None:
        self.client.set(self.keys.config, config.to_json())

    def read_config(self) -> RunConfig:
        raw = self.client.get(self.keys.config)
        if raw is None:
            raise RunNotFoundError(
                f"no run {self.keys.run!r} in this Redis: start `rl-learner` for it first, or check --run and --redis"
            )
        return RunConfig.from_json(raw)

    def version(self) -> int:
        return int(self.client.get(self.keys.version) or 0)

    def set_version(self, version: int) -> None:
        self.client.set(self.keys.version, version)

    # -- weight manifests
    def publish_manifest(self, manifest: WeightManifest) -> None:
        """Store the manifest, then announce it (subscribers re-read the key, so a missed announcement only delays)."""
        self.client.set(self.keys.manifest, encode_blob(manifest))
        self.client.publish(self.keys.manifest_channel, str(manifest.version))

    def read_manifest(self) -> tuple[WeightManifest, list[memoryview]] | None:
        """The current manifest and its frames (to hand on to a vLLM worker), or None before the first."""
        blob = self.client.get(self.keys.manifest)
        if blob is None:
            return None
        frames = unpack_frames(blob)
        return self._manifest_decoder.decode(frames), frames

    # -- process registry
    def beat(self, heartbeat: Heartbeat, ttl_s: float) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(heartbeat.process_id), encode_blob(heartbeat), px=int(ttl_s * 1000))
        pipe.sadd(self.keys.processes, heartbeat.process_id)
        pipe.execute()

    def leave(self, process_id: str) -> None:
        """A clean goodbye: the process is removed from the registry at once."""
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.keys.heartbeat(process_id))
        pipe.srem(self.keys.processes, process_id)
        pipe.execute()

    def processes(self) -> tuple[list[Heartbeat], list[str]]:
        """(live heartbeats, ids of processes whose heartbeat expired)."""
        ids = sorted(m.decode() for m in self.client.smembers(self.keys.processes))
        blobs = self.client.mget([self.keys.heartbeat(i) for i in ids]) if ids else []
        live, lost = [], []
        for pid, blob in zip(ids, blobs, strict=True):
            if blob is None:
                lost.append(pid)
                continue
            try:
                live.append(decode_blob(self._heartbeat_decoder, blob))
            except WireError as exc:
                log.warning("unreadable heartbeat", process=pid, field=exc.field, reason=exc.reason)
                lost.append(pid)
        return live, lost

    def forget(self, process_ids: Iterable[str]) -> None:
        ids = list(process_ids)
        if ids:
            self.client.srem(self.keys.processes, *ids)

    # -- prompt queue
    def push_prompts(self, groups: Iterable[PromptGroup]) -> int:
        blobs = [encode_blob(g) for g in groups]
        return self.client.lpush(self.keys.prompts, *blobs) if blobs else self.queue_depth()

    def take_prompt(self, actor: str, timeout_s: float = 1.0) -> PromptGroup | None:
        """Pop the oldest prompt group (blocking up to ``timeout_s``) and record ``actor`` as its holder."""
        item = self.client.brpop([self.keys.prompts], timeout=timeout_s)
        if item is None:
            return None
        blob = item[1]
        try:
            group = decode_blob(self._prompt_decoder, blob)
        except WireError as exc:
            log.warning("dead-lettered a malformed prompt group", field=exc.field, reason=exc.reason)
            dead_letter(self.client, self.keys, "prompts", str(exc), blob)
            return None
        self._update_ledger(group.group_id, actor=actor)
        return group

    def return_prompts(self, groups: Iterable[PromptGroup]) -> None:
        """Give unfinished groups back; they are taken next (front of the queue)."""
        for group in groups:
            self.client.rpush(self.keys.prompts, encode_blob(group))
            self._update_ledger(group.group_id, actor="")

    def queue_depth(self) -> int:
        return int(self.client.llen(self.keys.prompts))

    # -- in-flight ledger
    def record_issued(self, groups: Iterable[PromptGroup]) -> None:
        mapping = {g.group_id: json.dumps(LedgerEntry(g.issued_at, g.issued_version).__dict__) for g in groups}
        if mapping:
            self.client.hset(self.keys.inflight, mapping=mapping)

    def _update_ledger(self, group_id: str, **changes: Any) -> None:
        raw = self.client.hget(self.keys.inflight, group_id)
        if raw is None:
            return  # issued by someone who keeps no ledger (e.g. a test or a tool)
        entry = {**json.loads(raw), **changes}
        self.client.hset(self.keys.inflight, group_id, json.dumps(entry))

    def complete(self, group_ids: Iterable[str]) -> None:
        ids = list(group_ids)
        if ids:
            self.client.hdel(self.keys.inflight, *ids)

    def ledger(self) -> dict[str, LedgerEntry]:
        return {k.decode(): LedgerEntry(**json.loads(v)) for k, v in self.client.hgetall(self.keys.inflight).items()}

    def ledger_size(self) -> int:
        """Groups in the in-flight ledger (without reading them)."""
        return int(self.client.hlen(self.keys.inflight))

    # -- dispatcher state: payloads of issued groups, counters, completed ids
    def save_groups(self, groups: Iterable[PromptGroup], counts: Mapping[str, int]) -> None:
        """Store the payloads of issued groups and add ``counts`` to the dispatcher's counters, in one transaction.

        This is the dispatcher's commit point: a counter never claims a group whose payload is missing.
        """
        payloads = {g.group_id: encode_blob(g) for g in groups}
        pipe = self.client.pipeline(transaction=True)
        if payloads:
            pipe.hset(self.keys.groups, mapping=payloads)
        for name, delta in counts.items():
            pipe.hincrby(self.keys.dispatch, name, delta)
        pipe.execute()

    def has_group(self, group_id: str) -> bool:
        """Whether an issued group's payload is stored (issued, neither completed nor lost)."""
        return bool(self.client.hexists(self.keys.groups, group_id))

    def load_group(self, group_id: str) -> PromptGroup | None:
        """The stored payload of an issued group; None when there is none (or it is unreadable: dead-lettered)."""
        blob = self.client.hget(self.keys.groups, group_id)
        if blob is None:
            return None
        try:
            return decode_blob(self._prompt_decoder, blob)
        except WireError as exc:
            log.warning("dead-lettered an unreadable stored prompt group", group=group_id, field=exc.field)
            dead_letter(self.client, self.keys, "groups", str(exc), blob)
            return None

    def replace_issued(self, group: PromptGroup, entry: LedgerEntry) -> int:
        """Give an issued group a new payload and ledger entry, removing its old copy from the queue.

        The old copy (if still queued) is removed so that re-issuing a group nobody has taken yet moves it
        instead of duplicating it. Returns how many queued copies were removed. Queue the new copy with
        :meth:`return_prompts` (front of the queue) afterwards.
        """
        old = self.client.hget(self.keys.groups, group.group_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.groups, group.group_id, encode_blob(group))
        pipe.hset(self.keys.inflight, group.group_id, json.dumps(entry.__dict__))
        if old is not None:
            pipe.lrem(self.keys.prompts, 0, old)
        replies = pipe.execute()
        return int(replies[2]) if old is not None else 0

    def retire_groups(
        self, group_ids: Iterable[str], counts: Mapping[str, int] | None = None, completed: bool = False
    ) -> int:
        """Remove groups from the ledger, the payload store and the queue in one transaction.

        ``completed`` also remembers their ids as done (:meth:`was_completed`); ``counts`` are added to the
        dispatcher's counters in the same transaction. Returns how many of them were in the ledger.
        """
        ids = list(group_ids)
        if not ids:
            return 0
        queued = [b for b in self.client.hmget(self.keys.groups, ids) if b is not None]
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(self.keys.inflight, *ids)
        pipe.hdel(self.keys.groups, *ids)
        for blob in queued:  # a re-issued copy nobody took yet would be wasted work
            pipe.lrem(self.keys.prompts, 0, blob)
        if completed:
            pipe.sadd(self.keys.done, *ids)
        for name, delta in (counts or {}).items():
            pipe.hincrby(self.keys.dispatch, name, delta)
        return int(pipe.execute()[0])

    def was_completed(self, group_id: str) -> bool:
        return bool(self.client.sismember(self.keys.done, group_id))

    def completed_count(self) -> int:
        return int(self.client.scard(self.keys.done))

    def dispatch_counts(self) -> dict[str, int]:
        """The dispatcher's counters (a missing one is 0)."""
        return {k.decode(): int(v) for k, v in self.client.hgetall(self.keys.dispatch).items()}

    def add_dispatch_counts(self, counts: Mapping[str, int]) -> None:
        pipe = self.client.pipeline(transaction=True)
        for name, delta in counts.items():
            pipe.hincrby(self.keys.dispatch, name, delta)
        pipe.execute()

    # -- observability: metrics endpoints, queue depths, the learner's summary, alerts
    def register_metrics_endpoint(self, process_id: str, endpoint: Mapping[str, Any], ttl_s: float) -> None:
        """Store where a process serves ``/metrics`` (``host``, ``port``, ``kind``, …) for ``ttl_s`` seconds."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.metrics_endpoint(process_id), json.dumps(dict(endpoint)), px=int(ttl_s * 1000))
        pipe.sadd(self.keys.metrics_endpoints, process_id)
        pipe.execute()

    def unregister_metrics_endpoint(self, process_id: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.keys.metrics_endpoint(process_id))
        pipe.srem(self.keys.metrics_endpoints, process_id)
        pipe.execute()

    def metrics_endpoints(self) -> list[dict[str, Any]]:
        """Every live registration, sorted by process id; expired ones are dropped from the index."""
        ids = sorted(m.decode() for m in self.client.smembers(self.keys.metrics_endpoints))
        blobs = self.client.mget([self.keys.metrics_endpoint(i) for i in ids]) if ids else []
        live, expired = [], []
        for pid, blob in zip(ids, blobs, strict=True):
            if blob is None:
                expired.append(pid)
                continue
            try:
                live.append(json.loads(blob))
            except json.JSONDecodeError:
                log.warning("unreadable metrics endpoint", process=pid)
        if expired:
            self.client.srem(self.keys.metrics_endpoints, *expired)
        return live

    def queue_depths(self) -> dict[str, int]:
        """Groups queued (``prompts``), issued and not yet trained (``inflight``), entries in the replay stream
        (``replay``: its length, acknowledged entries included until trimmed), read but not acknowledged
        (``replay_pending``), dead letters, and — where Redis ≥ 7 reports the consumer group's lag — entries not yet
        delivered to the learner (``replay_unread``). Two round trips."""
        pipe = self.client.pipeline(transaction=False)
        pipe.llen(self.keys.prompts)
        pipe.hlen(self.keys.inflight)
        pipe.xlen(self.keys.replay)
        pipe.xlen(self.keys.dead)
        prompts, inflight, replay, dead = (int(n) for n in pipe.execute())
        depths = {"prompts": prompts, "inflight": inflight, "replay": replay, "replay_pending": 0, "dead_letters": dead}
        if replay or self.client.exists(self.keys.replay):
            groups = self.client.xinfo_groups(self.keys.replay)
            depths["replay_pending"] = sum(int(g["pending"]) for g in groups)
            lags = [g.get("lag") for g in groups]
            if lags and all(isinstance(lag, int) for lag in lags):
                depths["replay_unread"] = max(lags)
        return depths

    def publish_summary(self, summary: Mapping[str, Any]) -> None:
        self.client.set(self.keys.summary, json.dumps(dict(summary)))

    def summary(self) -> dict[str, Any] | None:
        """The learner's latest-step summary, or None before its first step."""
        raw = self.client.get(self.keys.summary)
        return json.loads(raw) if raw is not None else None

    def set_alerts(self, alerts: Iterable[Mapping[str, Any]]) -> None:
        """Replace the run's active alerts. Each is a JSON object with ``name`` (str) and, by convention,
        ``severity`` (``warning``/``critical``), ``message`` (for a person) and ``since`` (Unix time)."""
        items = [dict(a) for a in alerts]
        for item in items:
            if not isinstance(item.get("name"), str) or not item["name"]:
                raise ValueError(f"an alert needs a non-empty string 'name': {item!r}")
        self.client.set(self.keys.alerts, json.dumps(items))

    def alerts(self) -> list[dict[str, Any]]:
        """The active alerts (empty when none, or when no health check has written any)."""
        raw = self.client.get(self.keys.alerts)
        return json.loads(raw) if raw is not None else []
