"""The replay queue: scored groups in a Redis stream, read by the learner through a consumer group.

Delivery semantics (Redis streams, https://redis.io/docs/latest/develop/data-types/streams/):

- **Order**: entries are read in the order they were added (stream ids grow monotonically).
- **At least once**: an entry read with ``XREADGROUP`` stays in the consumer's pending list
  until :meth:`ReplayReader.ack` — call it only after the step that used the entry has been
  applied. A consumer that restarts under the same name gets its own pending entries back
  first; a consumer that died under another name has its entries claimed (``XAUTOCLAIM``)
  once they have been idle for ``claim_idle_s``.
- **Durability**: with AOF a restarted Redis keeps every entry and every pending list; with
  ``appendfsync always`` (the embedded server's) every acknowledged write, even through a
  ``kill -9`` of the server or a crash of the machine (``everysec`` may lose the last second).
- **Redis restarts**: a client from :func:`asyncrl.common.plane.keys.connect` retries through the outage; a
  delivery whose reply was lost when the server died stays in this consumer's pending list,
  and :meth:`ReplayReader.read` takes it back once the connection came back (``common/plane/outage.py``).
- **Bound**: ``XADD MAXLEN ~ n`` trims the oldest entries once the stream holds about ``n``.
  Trimming also removes entries that were read but not acknowledged — size ``n`` well above
  what the learner holds in flight.
- **Redis full**: past Redis's ``maxmemory`` (``noeviction``: nothing is evicted) an ``XADD`` fails
  with ``OOM command not allowed``; :meth:`ReplayWriter.add` logs which setting to raise and
  re-raises it (the worker exits rather than dropping scored groups).
- **Bad entries**: an entry that does not decode is copied to the dead-letter stream with the
  reason, acknowledged, counted (``asyncrl_replay_dead_letters_total``, by field) and skipped
  (logged at the 1st, 10th, 100th, … of each field); the reader keeps going.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.common.observability.logs import get_logger, worth_logging
from asyncrl.common.observability.metrics import REPLAY_DEAD_LETTERS, REPLAY_ENTRIES_ADDED, REPLAY_ENTRIES_READ
from asyncrl.common.plane.dead_letters import dead_letters
from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.plane.replies import StreamEntry, blob, stream_read
from asyncrl.common.wire.messages import Decoder, Limits, ScoredGroup, WireError, decode_blob, encode_blob

if TYPE_CHECKING:
    import redis

log = get_logger("replay")
_BLOB_FIELD = b"m"


@dataclass(frozen=True)
class ReplayEntry:
    entry_id: str
    group: ScoredGroup


class ReplayWriter:
    """Appends scored groups to the run's replay stream (used by reward workers)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, maxlen: int = 10_000) -> None:
        self.client = client
        self.keys = keys
        self.maxlen = maxlen

    def add(self, groups: Sequence[ScoredGroup]) -> list[str]:
        """XADD every group in one round trip; returns their stream ids."""
        import redis.exceptions  # lazy: keeps --help fast

        pipe = self.client.pipeline(transaction=False)
        for group in groups:
            pipe.xadd(self.keys.replay, {_BLOB_FIELD: encode_blob(group)}, maxlen=self.maxlen, approximate=True)
        try:
            replies = pipe.execute()
        except redis.exceptions.OutOfMemoryError:
            log.error(
                "Redis is full (maxmemory): it refused the scored groups",
                stream=self.keys.replay,
                groups=len(groups),
                action="raise Redis's maxmemory: now with redis-cli CONFIG SET maxmemory, and "
                "transport.redis_maxmemory_mb for its next start (or lower transport.replay_maxlen)",
            )
            raise
        ids = [blob(i).decode() for i in replies]
        REPLAY_ENTRIES_ADDED.inc(len(ids))
        return ids


class ReplayReader:
    """Reads scored groups as one consumer of the learner's consumer group."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        consumer: str = "learner-0",
        group: str = "learner",
        limits: Limits | None = None,
        claim_idle_s: float = 30.0,
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.group = group
        self.claim_idle_s = claim_idle_s
        self.decoder = Decoder(ScoredGroup, limits)
        self._rejected: dict[str, int] = {}  # entries dead-lettered, by WireError.label (bounded by the schema)
        self._last_id = "0-0"  # the newest entry handed out: a delivery after it that never came back was lost
        self._outages = self._outages_survived()
        self._create_group()

    def _create_group(self) -> None:
        import redis.exceptions

        try:
            self.client.xgroup_create(self.keys.replay, self.group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def recover(self, count: int = 1000) -> list[ReplayEntry]:
        """Entries read before but never acknowledged: this consumer's own, then idle ones of others."""
        own = stream_read(self.client.xreadgroup(self.group, self.consumer, {self.keys.replay: "0"}, count=count))
        self._note(own[0][1] if own else [])
        entries = self._decode_all(own[0][1] if own else [])
        entries += self._claim_idle(count)
        if entries:
            log.info("recovered unacknowledged replay entries", count=len(entries), consumer=self.consumer)
        return entries

    def _claim_idle(self, count: int) -> list[ReplayEntry]:
        entries: list[ReplayEntry] = []
        start = "0-0"
        idle_ms = int(self.claim_idle_s * 1000)
        while True:
            reply = self.client.xautoclaim(
                self.keys.replay, self.group, self.consumer, idle_ms, start_id=start, count=count
            )
            start, claimed = reply[0], reply[1]
            self._note(claimed)
            entries += self._decode_all(claimed)
            if start in (b"0-0", "0-0") or len(entries) >= count:
                return entries

    def read(self, count: int, block_ms: int = 1000) -> list[ReplayEntry]:
        """Up to ``count`` new entries, waiting at most ``block_ms`` for the first; after Redis came back from an
        outage, also those delivered to this consumer while it was dying whose reply never arrived."""
        last = self._last_id
        reply = stream_read(
            self.client.xreadgroup(self.group, self.consumer, {self.keys.replay: ">"}, count=count, block=block_ms)
        )
        raw = list(reply[0][1]) if reply else []
        raw += self._lost_deliveries(last, {entry_id for entry_id, _ in raw})
        self._note(raw)
        return self._decode_all(raw)

    def _lost_deliveries(self, last: str, received: set[bytes]) -> list[StreamEntry]:
        """Entries after ``last`` in this consumer's pending list that it never received: an ``XREADGROUP`` that the
        server ran (and logged) just before it was killed, whose reply was lost and whose retry read the next ones.
        Looked for only once after each outage (one round trip); they come after the new entries."""
        outages = self._outages_survived()
        if outages == self._outages:
            return []
        self._outages = outages
        pending = stream_read(self.client.xreadgroup(self.group, self.consumer, {self.keys.replay: last}))
        lost = [entry for entry in (pending[0][1] if pending else []) if entry[0] not in received]
        if lost:
            log.warning("took back replay entries whose delivery was cut by a Redis restart", count=len(lost))
        return lost

    def _outages_survived(self) -> int:
        from asyncrl.common.plane.outage import outage_clock

        clock = outage_clock(self.client)
        return clock.generation if clock is not None else 0

    def _note(self, raw: Iterable[tuple[bytes, object]]) -> None:
        """Remember the newest entry id handed out (stream ids order as (milliseconds, sequence))."""
        for entry_id, _ in raw:
            eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if _stream_order(eid) > _stream_order(self._last_id):
                self._last_id = eid

    def ack(self, entry_ids: Iterable[str]) -> int:
        ids = list(entry_ids)
        return int(self.client.xack(self.keys.replay, self.group, *ids)) if ids else 0

    def _decode_all(self, raw: list[StreamEntry]) -> list[ReplayEntry]:
        entries, done, rejected = [], [], []
        for entry_id, fields in raw:
            eid = entry_id.decode()
            if fields is None:  # the entry was trimmed away while it was pending
                done.append(eid)
                continue
            try:
                entries.append(ReplayEntry(eid, decode_blob(self.decoder, fields.get(_BLOB_FIELD, b""))))
            except WireError as exc:
                done.append(eid)
                rejected.append((eid, fields.get(_BLOB_FIELD, b""), exc))
        # A flood of bad entries costs two round trips per read: the dead letters, then their acknowledgement.
        dead_letters(self.client, self.keys, [(f"replay:{eid}", str(exc), payload) for eid, payload, exc in rejected])
        self.ack(done)
        for eid, _, exc in rejected:
            self._count_rejected(eid, exc)
        REPLAY_ENTRIES_READ.inc(len(entries))
        return entries

    def _count_rejected(self, entry_id: str, exc: WireError) -> None:
        """Count a dead-lettered entry (by field label); log the 1st, 10th, 100th, … of each field."""
        REPLAY_DEAD_LETTERS.labels(field=exc.label).inc()
        count = self._rejected[exc.label] = self._rejected.get(exc.label, 0) + 1
        if worth_logging(count):
            log.warning(
                "dead-lettered an undecodable replay entry",
                entry=entry_id,
                field=exc.field,
                reason=exc.reason,
                count=count,
                action=f"inspect with XRANGE {self.keys.dead} - +",
            )

    def depth(self) -> dict[str, int]:
        """Stream length and entries pending (read, not yet acknowledged) in this consumer group."""
        pending = self.client.xpending(self.keys.replay, self.group)
        return {"length": int(self.client.xlen(self.keys.replay)), "pending": int(pending["pending"])}


def _stream_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
