"""The run's audit trail: who started or resumed it with which config, which processes joined, left or were lost,
which weights were published and loaded, which checkpoints were written, verified, restored or rolled back, and
what was refused.

Every process records through :class:`Audit` — one ``XADD`` per event to the stream ``asyncrl:<run>:audit``
(:attr:`asyncrl.common.plane.keys.RunKeys.audit`, trimmed at about :data:`AUDIT_MAXLEN` entries). The learner's rank 0
copies the stream into ``runs/<name>/audit.jsonl`` (:class:`AuditMirror`): append-only, one JSON object per line, e.g.::

    {"id": "1718000000123-0", "time": "2024-06-10T06:13:20.123Z", "unix": 1718000000.123, "event": "process.joined",
     "who": {"process": "actor-0", "kind": "actor", "host": "node-3", "pid": 4242}, "version": 0}

``who`` is the process that recorded the event; the event's own fields sit beside the reserved ``id``, ``time``,
``unix``, ``event`` and ``who`` (a field named like one of those gets a trailing ``_``). The events are
:data:`EVENTS`.

- **Never in the way.** :meth:`Audit.record` never raises and never waits for Redis: it queues the entry for the
  process's writer thread for that Redis server, which adds it with one ``XADD`` (in the order recorded). While Redis
  is away the writer waits with the client's outage retries (``common/plane/outage.py``) and up to :data:`QUEUE_MAX`
  entries wait with it (entries for another server do not); an entry the queue has no room for, or whose ``XADD``
  failed in the end, is counted (``asyncrl_audit_failures_total{stage="queue"|"record"}``), logged (the 1st, 10th,
  100th, …) and lost to the trail. :func:`flush` waits until what was recorded so far is written (at exit, for a
  few seconds, by itself).
- **No secret in it** (:func:`scrub`): a field whose name says it holds a secret is redacted, a URL's password becomes
  ``***``, and the recording client's Redis password is replaced wherever it appears in a value.
- **Floods stay small.** Refusals come in floods when a hostile peer sends garbage: :meth:`Audit.refused` records
  the 1st, 10th, 100th, … refusal of each (event, reason) with the count so far, for at most :data:`MAX_REASONS`
  reasons per event (later reasons share one, ``(other)``); the rest are only counted
  (``asyncrl_audit_suppressed_refusals_total``). A message refused anywhere is recorded by
  :func:`asyncrl.common.plane.dead_letters.dead_letter`, without its payload.
- **Trust.** The trail is as trustworthy as the Redis password: any holder of it can add entries.
"""

from __future__ import annotations

import atexit
import json
import numbers
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from asyncrl.common.observability.logs import get_logger, worth_logging
from asyncrl.common.observability.metrics import AUDIT_FAILURES, AUDIT_SUPPRESSED
from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.redact import redact

if TYPE_CHECKING:
    import redis
    from redis.typing import EncodableT, FieldT

log = get_logger("audit")

AUDIT_MAXLEN = 100_000
"""About how many entries the stream keeps (``MAXLEN ~``); the mirror copies them long before that."""
MAX_REASONS = 100
"""Distinct reasons counted apart per refusal event; beyond, they share the reason ``(other)``."""
MAX_TEXT = 500
"""Characters kept of one string value (a refused message's reason is an attacker's text)."""
MAX_DATA = 16_384
"""Bytes of one event's fields as JSON; a larger event keeps only the names of its fields."""
QUEUE_MAX = 10_000
"""Entries that may wait for the writer (while Redis is away) before new ones are dropped."""
EXIT_FLUSH_S = 5.0
"""How long a process that exits waits for its queued entries to be written."""
REDACTED = "[redacted]"
RESERVED = ("id", "time", "unix", "event", "who")

EVENTS = {
    "run.started": "the learner started the run from model.path: config hash, config.json's sha256, user",
    "run.resumed": "the learner resumed the run from a checkpoint: config hash, the checkpoint and its step",
    "run.finished": "the learner stopped: completed, stopped (SIGTERM) or failed, at which version",
    "process.joined": "a process's first heartbeat, its first after it expired (rejoined) or after a restart under "
    "its id (replaced_pid): its version",
    "process.left": "a process said goodbye (removed its heartbeat)",
    "process.lost": "the learner found a process's heartbeat expired (it died without leaving)",
    "weights.published": "the learner sent a policy version: its digest and the members of the weight group",
    "weights.failed": "a policy version's transfer failed: it was not published as the actors' version; the actors "
    "it evicted",
    "weights.loaded": "an actor loaded a policy version: its digest",
    "weights.refused": "an actor refused a policy version (its digest did not match)",
    "checkpoint.written": "a checkpoint folder is complete: step, reason, files, bytes, manifest sha256",
    "checkpoint.verified": "every file of a checkpoint matched its manifest (before a restore)",
    "checkpoint.restored": "the learner went back to a checkpoint: step, groups trained again or lost",
    "checkpoint.rolled_back": "health rolled back to the newest checkpoint before non-finite steps",
    "message.refused": "a message was dead-lettered: source, reason, size (rate-limited, never the payload)",
    "key.refused": "a CURVE client key was refused by a reward worker (rate-limited per key)",
}
"""Every event name and what its entry says."""

_SECRET_NAME = re.compile(r"passw(or)?d|secret|credential|(?<![a-z])token(?![a-z])|(?<![a-z])(api|private)_?key", re.I)


# --------------------------------------------------------------------------- scrubbing


def scrub(value: Any, secrets: tuple[str, ...] = (), name: str = "") -> Any:
    """``value`` (a JSON value: dicts and lists are walked) with every secret-looking part replaced.

    A value under a name that says it holds a secret (``password``, ``secret``, ``key_secret``, ``token``,
    ``credential``, ``api_key``, ``private_key``) becomes :data:`REDACTED`; in strings
    (:func:`asyncrl.common.redact.redact`) a URL's password, a ``password=…`` query value and each of
    ``secrets`` (e.g. the Redis password) become ``***``. Strings are cut at :data:`MAX_TEXT` characters.
    """
    if value is None or isinstance(value, bool):
        return value
    if name and _SECRET_NAME.search(name) and not (isinstance(value, str) and not value):
        return REDACTED
    if isinstance(value, Mapping):
        return {str(k): scrub(v, secrets, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [scrub(v, secrets) for v in value]
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    text = redact(value.decode(errors="replace") if isinstance(value, bytes) else str(value), secrets)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


def client_secrets(client: redis.Redis) -> tuple[str, ...]:
    """The password the client authenticates with (too short a one would redact ordinary text: ignored)."""
    try:
        password = client.connection_pool.connection_kwargs.get("password")
    except AttributeError:
        return ()
    return (str(password),) if password and len(str(password)) >= 6 else ()


# --------------------------------------------------------------------------- recording


class _RefusalCounts:
    """Refusals so far in this process, by (run, event) and reason, shared by every :class:`Audit` of the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], dict[str, int]] = {}

    def add(self, run: str, event: str, reason: str) -> tuple[str, int]:
        """(the reason it counts under, its count including this one)."""
        with self._lock:
            reasons = self._counts.setdefault((run, event), {})
            if reason not in reasons and len(reasons) >= MAX_REASONS:
                reason = "(other)"
            reasons[reason] = count = reasons.get(reason, 0) + 1
            return reason, count


class _Writer:
    """The process's audit writer for one Redis server: a daemon thread that adds the queued entries in order
    (started at the first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._cond = threading.Condition()
        self._items: deque[tuple[redis.Redis, str, dict[str, str]]] = deque()
        self._queued = self._done = 0
        self._thread: threading.Thread | None = None

    def put(self, client: redis.Redis, key: str, entry: dict[str, str]) -> bool:
        """Queue one entry; False when the queue is full (Redis has been away for long)."""
        with self._cond:
            if len(self._items) >= self.capacity:
                return False
            self._items.append((client, key, entry))
            self._queued += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every entry queued so far was written (or failed); False after ``timeout_s``."""
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._done >= target, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._items))
                client, key, entry = self._items[0]
            try:
                # redis-py asks for a dict[FieldT, EncodableT]; a dict is invariant in its types, so dict[str, str]
                # does not match it, but it is what XADD sends.
                fields = cast("dict[FieldT, EncodableT]", entry)
                client.xadd(key, fields, maxlen=AUDIT_MAXLEN, approximate=True)
            except Exception as exc:  # given up on (past the client's outage limit), or refused by Redis
                failed("record", entry.get("event", ""), exc)
            with self._cond:
                self._items.popleft()
                self._done += 1
                self._cond.notify_all()


class _Writers:
    """One :class:`_Writer` per Redis server (host, port, db) the process records to: entries for a server that is
    away wait for it alone, never in front of entries for a live one (a test, a tool, a process with two runs)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._by_server: dict[tuple[object, ...], _Writer] = {}

    def put(self, client: redis.Redis, key: str, entry: dict[str, str]) -> bool:
        with self._lock:
            writer = self._by_server.setdefault(_server_of(client), _Writer(self.capacity))
        return writer.put(client, key, entry)

    def flush(self, timeout_s: float, client: redis.Redis | None = None) -> bool:
        """Wait for the entries queued so far for ``client``'s server (every server when None), within one deadline."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            writers = list(self._by_server.values()) if client is None else [self._by_server.get(_server_of(client))]
        return all(w is None or w.flush(max(0.0, deadline - time.monotonic())) for w in writers)

    def after_fork(self) -> None:
        """In a forked child: no writers (the parent's threads did not come along; a lock may be held)."""
        self._lock = threading.Lock()
        self._by_server = {}


def _server_of(client: redis.Redis) -> tuple[object, ...]:
    """Which server a client talks to: (host, port or socket path, db); the client itself when that is not known."""
    try:
        kwargs = client.connection_pool.connection_kwargs
    except AttributeError:
        return (id(client),)
    return (kwargs.get("host"), kwargs.get("port") or kwargs.get("path"), kwargs.get("db", 0))


_REFUSALS = _RefusalCounts()
_WRITERS = _Writers(QUEUE_MAX)
_VOICES: dict[str, Audit] = {}  # run -> the Audit constructed last for it in this process
_failures = 0


def flush(timeout_s: float = 5.0, client: redis.Redis | None = None) -> bool:
    """Wait until every event this process recorded so far (to ``client``'s server, or to any) is in the stream or
    failed; False after ``timeout_s``."""
    return _WRITERS.flush(timeout_s, client)


atexit.register(flush, EXIT_FLUSH_S)
os.register_at_fork(after_in_child=_WRITERS.after_fork)


def failed(stage: str, event: str, exc: BaseException | str) -> None:
    global _failures
    AUDIT_FAILURES.labels(stage).inc()
    _failures += 1
    if worth_logging(_failures):
        log.warning("audit trail: could not record", stage=stage, audit_event=event, error=exc, failures=_failures)


class Audit:
    """Records the events of one process (``process_id`` of ``kind``) in the audit stream of ``run``.

    Constructing one is free (no I/O); each :meth:`record` queues one ``XADD`` for the process's writer thread. The
    last one constructed for a run in a process also speaks for it where the caller knows no process (:func:`voice`:
    the dead letters).
    """

    def __init__(self, client: redis.Redis, run: str, process_id: str, kind: str) -> None:
        self.client = client
        self.run = run
        self.key = RunKeys(run).audit
        self.who = {"process": process_id, "kind": kind, "host": socket.gethostname(), "pid": os.getpid()}
        self._secrets = client_secrets(client)
        _VOICES[run] = self

    def record(self, event: str, /, **fields: Any) -> None:
        """Queue one entry (see :data:`EVENTS`) for the writer thread; never raises, never waits for Redis."""
        try:
            if not _WRITERS.put(self.client, self.key, self.entry(event, fields)):
                failed("queue", event, f"{QUEUE_MAX} entries wait for Redis already")
        except Exception as exc:  # the trail must never stop the process that records it
            failed("record", event, exc)

    def refused(self, event: str, reason: str, /, **fields: Any) -> bool:
        """A rate-limited :meth:`record` for refusals: the 1st, 10th, 100th, … of each ``reason``, with ``count``
        (the refusals of that reason so far in this process). Returns whether this one was recorded."""
        reason, count = _REFUSALS.add(self.run, event, reason)
        if not worth_logging(count):
            AUDIT_SUPPRESSED.labels(event).inc()
            return False
        self.record(event, **fields, reason=reason, count=count)
        return True

    def entry(self, event: str, fields: Mapping[str, Any]) -> dict[str, str]:
        """The stream entry of one event: ``event``, ``time`` (UTC, ISO 8601), ``unix``, the ``who`` fields and
        ``data`` (the event's fields as JSON, scrubbed)."""
        now = time.time()
        data = json.dumps(
            scrub({f"{k}_" if k in RESERVED else k: v for k, v in fields.items()}, self._secrets), default=str
        )
        if len(data) > MAX_DATA:
            data = json.dumps({"oversize_fields": sorted(fields)[:50]})
        stamp = datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        who = {k: str(v) for k, v in scrub(self.who | {"pid": os.getpid()}, self._secrets).items()}  # after a fork too
        return {"event": event, "time": stamp, "unix": f"{now:.3f}", **who, "data": data}


def voice(client: redis.Redis, run: str) -> Audit:
    """The process's :class:`Audit` for ``run`` (the last constructed), or an ``unknown`` one with this process's
    host and pid (on ``client``'s connections; a pipeline's commands run only at its ``execute``, so not on it)."""
    import redis.client

    if run not in _VOICES and isinstance(client, redis.client.Pipeline):
        client = redis.Redis(connection_pool=client.connection_pool)
    return _VOICES.get(run) or Audit(client, run, "unknown", "unknown")


def dead_lettered(client: redis.Redis, run: str, source: str, reason: str, size: int) -> None:
    """Record that a message was dead-lettered (:func:`asyncrl.common.plane.dead_letters.dead_letter`): counted per
    source kind (the source without a stream entry id), so a flood of one kind adds a handful of entries."""
    kind = re.sub(r":\d+-\d+$", "", source)
    voice(client, run).refused("message.refused", kind, source=source, detail=reason, bytes=size)
