"""The registry of a run's processes in Redis: a heartbeat per process with a TTL — the one mechanism by which a
process says it is alive, what it is, and where it serves ``/metrics``.

Keys (:class:`asyncrl.common.plane.keys.RunKeys`): ``heartbeat:<id>`` (an encoded
:class:`~asyncrl.common.wire.messages.Heartbeat`, expiring after the TTL) and the hash ``processes`` (id → kind) of
every process ever seen — an entry whose heartbeat expired died (or was killed) without saying goodbye, and its kind
says what was lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.plane import replies
from asyncrl.common.plane.audit import Audit
from asyncrl.common.wire.messages import Decoder, Heartbeat, Limits, WireError, decode_blob, encode_blob

if TYPE_CHECKING:
    import redis

    from asyncrl.common.plane.keys import RunKeys

log = get_logger("control")


class ProcessRegistry:
    """Who is part of the run (``plane.registry``)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, limits: Limits | None = None) -> None:
        self.client = client
        self.keys = keys
        self._heartbeat_decoder = Decoder(Heartbeat, limits)

    def beat(self, heartbeat: Heartbeat, ttl_s: float) -> None:
        """Store ``heartbeat`` for ``ttl_s``. A process's first beat is a ``process.joined`` in the audit trail; so is
        its first after its heartbeat expired (``rejoined``), and the first of another process under the same id
        (a restart within the TTL: ``replaced_pid``)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.heartbeat(heartbeat.process_id), encode_blob(heartbeat), px=int(ttl_s * 1000), get=True)
        pipe.hset(self.keys.processes, heartbeat.process_id, heartbeat.kind)
        previous, added = pipe.execute()
        before = self._readable(previous)
        if before is not None and (before.pid, before.host) == (heartbeat.pid, heartbeat.host):
            return
        replaced = {"replaced_pid": before.pid} if before is not None else {}
        audit = Audit(self.client, self.keys.run, heartbeat.process_id, heartbeat.kind)
        audit.record("process.joined", version=heartbeat.version, state=heartbeat.state, rejoined=not added, **replaced)

    def _readable(self, blob: bytes | None) -> Heartbeat | None:
        try:
            return decode_blob(self._heartbeat_decoder, blob) if blob is not None else None
        except WireError:
            return None

    def leave(self, process_id: str) -> None:
        """A clean goodbye: the process is removed from the registry at once (``process.left`` in the audit trail)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(self.keys.processes, process_id)
        pipe.delete(self.keys.heartbeat(process_id))
        pipe.hdel(self.keys.processes, process_id)
        kind, _, _ = pipe.execute()
        Audit(self.client, self.keys.run, process_id, kind.decode() if kind else "unknown").record("process.left")

    def processes(self) -> tuple[list[Heartbeat], dict[str, str]]:
        """(live heartbeats, id → kind of every process whose heartbeat expired), sorted by id."""
        kinds = {
            k.decode(): v.decode()
            for k, v in sorted(replies.blob_map(self.client.hgetall(self.keys.processes)).items())
        }
        blobs = replies.maybe_blobs(self.client.mget([self.keys.heartbeat(i) for i in kinds])) if kinds else []
        live, lost = [], {}
        for (pid, kind), blob in zip(kinds.items(), blobs, strict=True):
            if blob is None:
                lost[pid] = kind
                continue
            try:
                live.append(decode_blob(self._heartbeat_decoder, blob))
            except WireError as exc:
                log.warning("unreadable heartbeat", process=pid, field=exc.field, reason=exc.reason)
                lost[pid] = kind
        return live, lost

    def forget(self, process_ids: Iterable[str]) -> None:
        ids = list(process_ids)
        if ids:
            self.client.hdel(self.keys.processes, *ids)

    def metrics_endpoints(self) -> list[dict[str, Any]]:
        """Where every live process serves ``/metrics``, from its heartbeat (the one mechanism that advertises a
        process): ``process_id``, ``kind``, ``host``, ``port``, ``pid``, ``address`` and ``url``, sorted by id."""
        live, _ = self.processes()
        return [endpoint for beat in live if (endpoint := metrics_endpoint(beat)) is not None]


def metrics_endpoint(beat: Heartbeat) -> dict[str, Any] | None:
    """Where the process of ``beat`` serves ``/metrics`` (see :meth:`ProcessRegistry.metrics_endpoints`), or None."""
    url = urlsplit(beat.metrics_url)
    if not (url.hostname and url.port):
        return None
    address = f"{url.hostname}:{url.port}"
    return {
        "process_id": beat.process_id,
        "kind": beat.kind,
        "host": url.hostname,
        "port": url.port,
        "pid": beat.pid,
        "address": address,
        "url": beat.metrics_url,
    }
