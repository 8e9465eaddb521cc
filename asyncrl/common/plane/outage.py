"""Living through a Redis restart: every client waits for Redis, with back-off, for ``transport.redis_outage_s``; past
that the process exits with :data:`ExitCode.REDIS_OUTAGE` and says what to do.

A ``redis-server`` killed (even ``kill -9``) and started again on its AOF with the same port and password has every
key, stream entry and consumer-group pending list it had logged, and the embedded one (``common/plane/redis_server.py``)
logs every write before it acknowledges it (``appendfsync always``; ``everysec`` can lose writes acknowledged in the
last ~100 ms even when only the process dies — measured there), so a client only has to wait and reconnect. Keys with
a TTL keep their absolute expiry (Redis 6.2 logs ``SET … PX`` as ``PXAT``), so a heartbeat can expire while Redis is
down.

:func:`asyncrl.common.plane.keys.connect` gives every client an :class:`OutageRetry`. It retries a command that failed
with a connection error (refused, reset, ``LOADING`` while the AOF loads, a connect timeout) with jittered exponential
back-off (0.05 s doubling to 1 s), re-connecting (and re-subscribing a pub/sub client to its channels) as redis-py does,
until the outage has lasted ``limit_s`` — measured from the first failure of any connection of the client, not per
command — and then raises :class:`RedisUnavailable`. A wrong password is not an outage: it is not retried.

Which commands are safe to retry. While Redis is down a command fails before it reaches the server (the connection
is refused), so retrying it runs it once. Only the commands in flight at the moment the server dies are in doubt:
the server may have run one and logged it to the AOF without its reply getting out, and the retry runs it again.
For this system:

- idempotent, harmless twice: ``SET`` (config, version, manifest, heartbeats, summary, alerts), ``HSET``/``HDEL``
  (ledger, issue records, ``trained``/``unacked``), ``SADD``/``SREM`` (``done``), ``LREM``, ``XACK``, ``PUBLISH`` (an
  actor re-reads the manifest and finds nothing new), every read;
- tolerated twice: ``XADD`` to the replay stream (the learner drops the second copy of a group as a duplicate) or to
  the dead letters (a letter twice); ``LPUSH``/``RPUSH`` of prompt groups (a group queued twice is generated twice
  and its second copy dropped as a duplicate; retiring a group removes every queued copy);
- made exactly-once: the dispatcher's counters (``HINCRBY`` on ``dispatch``: ``created`` numbers group ids and
  ``released`` is admission — counted twice they would skip ids and starve admission), which
  :func:`asyncrl.common.plane.prompt_ledger.add_counts` applies under a one-time token, so a replayed transaction adds
  nothing;
- a lost reply of a read that takes something: ``XREADGROUP >`` delivered entries into the learner's pending list that
  it never received — :class:`asyncrl.common.plane.replay.ReplayReader` reads its own pending entries after the last one
  it has seen once the connection came back; ``BRPOP`` of a prompt group that no actor received — the group stays in the
  in-flight ledger and is re-issued at its deadline (``learner.group_deadline_s``), so it is late, not lost;
- the weight group's rendezvous (``INCRBY`` in ``common/weights/rendezvous.py``, only while a group forms) opens its own
  connection without these retries: a formation that Redis dies in fails and is formed again at the next sync.

After an outage, heartbeats that expired while Redis was down come back within a second (their threads retry like
everything else). Until a heartbeat TTL has passed since Redis came back (:func:`settling`), the learner takes a
missing heartbeat for one not renewed yet rather than for a lost process, and the time Redis was down does not count
against a group's deadline (:meth:`OutageClock.down_between`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis.exceptions
from redis.backoff import EqualJitterBackoff
from redis.exceptions import AuthenticationError
from redis.retry import Retry

from asyncrl.common.exit_codes import ExitCode
from asyncrl.common.observability.logs import get_logger

log = get_logger("redis")
T = TypeVar("T")

WHAT_TO_DO = (
    "restart Redis on its AOF with the same port and password (`rl-launch redis CONFIG` on the run folder does: "
    "it reuses runs/<name>/redis/url), then resume the run: `rl-learner train CONFIG --resume latest` (or "
    "`rl-launch run CONFIG --resume latest`) and start the rollout actors and reward workers again"
)


class RedisUnavailable(redis.exceptions.ConnectionError):
    """Redis did not answer for longer than the client's outage limit (``transport.redis_outage_s``)."""

    def __init__(self, address: str, down_s: float, limit_s: float, last_error: str) -> None:
        super().__init__(
            f"Redis at {address} unreachable for {down_s:.1f}s (limit {limit_s:g}s, "
            f"transport.redis_outage_s); last error: {last_error}"
        )
        self.address, self.down_s, self.limit_s = address, down_s, limit_s


class OutageClock:
    """One client's view of Redis: since when the current outage lasts (monotonic time), and the outages it lived
    through (wall-clock ``(start, end)``, so that ledger times — wall clock — can be compared with them).

    Shared by every connection of a client: an outage begins at the first failure of any of them and ends at the
    first success of a call that retried through it — or of any call once none is retrying (they gave up). A call
    that did not retry proves little while others do: redis-py's ``connect()`` "succeeds" at once on a socket that
    the dead server left open.
    """

    def __init__(self, limit_s: float, address: str) -> None:
        self.limit_s = limit_s
        self.address = address
        self.generation = 0
        """Outages survived so far (a reader compares it with the one it saw last)."""
        self.outages: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._down_since: float | None = None  # monotonic
        self._down_wall = 0.0
        self.retrying = 0
        """Calls retrying now (in :meth:`OutageRetry.call_with_retry`, after a failure)."""

    @property
    def down(self) -> bool:
        """Whether an outage is in progress (a connection failed and none has succeeded since)."""
        return self._down_since is not None

    def failed(self) -> float:
        """A connection failed: the seconds the outage has lasted (0 at its first failure)."""
        with self._lock:
            now = time.monotonic()
            if self._down_since is None:
                self._down_since, self._down_wall = now, time.time()
                log.warning(
                    "Redis unreachable; retrying with back-off",
                    redis=self.address,
                    limit_s=self.limit_s,
                    action="restart Redis on its AOF with the same port and password (rl-launch redis CONFIG)",
                )
            return now - self._down_since

    def retry_started(self) -> None:
        with self._lock:
            self.retrying += 1

    def retry_ended(self) -> None:
        with self._lock:
            self.retrying -= 1

    def succeeded(self, retried: bool = True) -> None:
        """A call went through (``retried``: after failing in this outage): an outage in progress is over."""
        if self._down_since is None:  # the common case: no lock taken
            return
        with self._lock:
            if self._down_since is None or (not retried and self.retrying):
                return
            down_s = time.monotonic() - self._down_since
            self.outages.append((self._down_wall, time.time()))
            self._down_since = None
            self.generation += 1
        log.warning("Redis reachable again; carrying on", redis=self.address, down_s=round(down_s, 2))

    def check(self) -> None:
        """Raise :class:`RedisUnavailable` once the outage in progress has lasted past the limit: for a loop that may
        not call Redis itself for a while (a reward worker waiting for rollouts) while its heartbeats fail."""
        since = self._down_since
        down_s = time.monotonic() - since if since is not None else 0.0
        if down_s >= self.limit_s:
            raise RedisUnavailable(self.address, down_s, self.limit_s, "no command has gone through since")

    def recovered_within(self, seconds: float, now: float | None = None) -> bool:
        """Whether an outage ended less than ``seconds`` ago (wall clock)."""
        now = time.time() if now is None else now
        return bool(self.outages) and now - self.outages[-1][1] < seconds

    def down_between(self, start: float, end: float) -> float:
        """Seconds of wall-clock time in ``[start, end]`` during which this client could not reach Redis."""
        with self._lock:
            spans = [*self.outages, *([(self._down_wall, end)] if self._down_since is not None else [])]
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


class OutageRetry(Retry):
    """redis-py's retry policy bounded by time, not by a count: retry connection errors with back-off until the
    client's outage (:class:`OutageClock`) has lasted ``clock.limit_s``, then raise :class:`RedisUnavailable`.

    redis-py copies the policy into every connection (``copy.deepcopy``); the copies share the clock.
    """

    def __init__(self, clock: OutageClock) -> None:
        super().__init__(EqualJitterBackoff(cap=1.0, base=0.025), retries=-1)
        self.clock = clock
        self._generation = clock.generation  # the outages over when this connection last worked

    def __deepcopy__(self, memo: dict[int, Any]) -> OutageRetry:
        return OutageRetry(self.clock)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutageRetry) and other.clock is self.clock

    __hash__ = Retry.__hash__

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        failures = 0
        try:
            while True:
                try:
                    result = do()
                except (RedisUnavailable, AuthenticationError):
                    raise  # a nested retry (connect inside a command) gave up already; a wrong password is no outage
                except self._supported_errors as error:
                    if is_retryable and not is_retryable(error):
                        raise
                    failures += 1
                    if failures == 1:
                        self.clock.retry_started()
                    if not self.clock.down and self._generation != self.clock.generation:
                        # A connection from before an outage that is over (idle through it) only finds out now: no
                        # new outage, just reconnect.
                        self._generation = self.clock.generation
                        fail(error, failures) if with_failure_count else fail(error)
                        continue
                    down_s = self.clock.failed()  # before fail(): a pub/sub client reconnects in it
                    fail(error, failures) if with_failure_count else fail(error)
                    if down_s >= self.clock.limit_s:
                        raise RedisUnavailable(self.clock.address, down_s, self.clock.limit_s, str(error)) from error
                    if self.clock.down:
                        time.sleep(min(self._backoff.compute(failures), self.clock.limit_s - down_s))
                else:
                    self.clock.succeeded(retried=failures > 0)
                    self._generation = self.clock.generation
                    return result
        finally:
            if failures:
                self.clock.retry_ended()


def outage_clock(client: redis.Redis) -> OutageClock | None:
    """The outage clock of a client made by :func:`asyncrl.common.plane.keys.connect` (None for any other client)."""
    retry = client.get_connection_kwargs().get("retry")
    return retry.clock if isinstance(retry, OutageRetry) else None


def settling(client: redis.Redis, window_s: float) -> bool:
    """Redis came back from an outage less than ``window_s`` (a heartbeat TTL) ago: a heartbeat that expired while it
    was down may not have been renewed yet, so a missing one does not yet mean a lost process."""
    clock = outage_clock(client)
    return clock is not None and clock.recovered_within(window_s)


def outage_in(exc: BaseException | None) -> RedisUnavailable | None:
    """The :class:`RedisUnavailable` that caused ``exc`` (itself, a cause or context, or inside an exception group)."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, RedisUnavailable):
            return current
        stack += [current.__cause__, current.__context__, *getattr(current, "exceptions", ())]
    return None


def exit_for_outage(outage: RedisUnavailable, process: str) -> int:
    """Say that ``process`` stops because Redis stayed down past the limit, and what to do; the exit status."""
    log.error(
        "Redis unreachable for longer than transport.redis_outage_s; stopping",
        process=process,
        redis=outage.address,
        down_s=round(outage.down_s, 1),
        limit_s=outage.limit_s,
        exit_code=ExitCode.REDIS_OUTAGE,
        action=WHAT_TO_DO,
    )
    return ExitCode.REDIS_OUTAGE
