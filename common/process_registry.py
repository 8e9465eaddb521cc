"""The registry of a run's processes in Redis: heartbeats with a TTL, and where each serves ``/metrics``.

Keys (:class:`common.control.RunKeys`): ``heartbeat:<id>`` (an encoded :class:`~common.wire.Heartbeat`, expiring
after the TTL) and the set ``processes`` of every process ever seen — a member whose heartbeat expired died (or was
killed) without saying goodbye; ``metrics:<id>`` and the set ``metrics-endpoints`` likewise for ``/metrics``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from common.logs import get_logger
from common.wire import Decoder, Heartbeat, Limits, WireError, decode_blob, encode_blob

if TYPE_CHECKING:
    import redis

    from common.keys import RunKeys

log = get_logger("control")


class ProcessRegistry:
    """Who is part of the run (``plane.registry``)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, limits: Limits | None = None) -> None:
        self.client = client
        self.keys = keys
        self._heartbeat_decoder = Decoder(Heartbeat, limits)

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
