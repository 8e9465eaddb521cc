"""The outage retry policy on its own: bounded by time, not by a count; one clock per client; what it never retries."""

from __future__ import annotations

import copy
import time

import pytest
from redis.exceptions import AuthenticationError, BusyLoadingError, ConnectionError

from asyncrl.common.plane.outage import OutageClock, OutageRetry, RedisUnavailable, outage_in
from asyncrl.common.plane.prompt_ledger import LedgerEntry
from asyncrl.learner.intake.dispatcher import overdue_reason


def failing(times: int, error: Exception | None = None):
    """A call that fails ``times`` times with ``error`` (a refused connection), then answers "ok"."""
    calls = {"n": 0}

    def do() -> str:
        calls["n"] += 1
        if calls["n"] <= times:
            raise error or ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
        return "ok"

    return do, calls


def test_connection_errors_are_retried_until_redis_answers_and_the_outage_is_recorded() -> None:
    clock = OutageClock(limit_s=10, address="127.0.0.1:1/0")
    do, calls = failing(5, BusyLoadingError("Redis is loading the dataset in memory"))
    started = time.monotonic()
    assert OutageRetry(clock).call_with_retry(do, lambda error: None) == "ok"
    assert calls["n"] == 6 and time.monotonic() - started < 2  # back-off starts at a few tens of milliseconds
    assert clock.generation == 1 and not clock.down and clock.recovered_within(1.0)
    assert 0 < clock.down_between(0, time.time()) < 2


def test_past_the_limit_it_raises_redis_unavailable_and_every_copy_shares_the_clock() -> None:
    clock = OutageClock(limit_s=0.5, address="127.0.0.1:1/0")
    retry = OutageRetry(clock)
    started = time.monotonic()
    with pytest.raises(RedisUnavailable, match=r"127.0.0.1:1/0 unreachable for 0\.\ds \(limit 0.5s") as raised:
        retry.call_with_retry(failing(10**6)[0], lambda error: None)
    assert 0.5 <= time.monotonic() - started < 1.5
    assert raised.value.down_s >= 0.5 and outage_in(RuntimeError("wrapped")) is None
    try:
        raise RuntimeError("a step failed") from raised.value
    except RuntimeError as wrapped:
        assert outage_in(wrapped) is raised.value  # found through the cause
    other = copy.deepcopy(retry)  # redis-py copies the policy into each connection
    assert other.clock is clock
    with pytest.raises(RedisUnavailable):  # the outage is the client's, not the call's: past the limit at once
        other.call_with_retry(failing(1)[0], lambda error: None)
    with pytest.raises(RedisUnavailable):  # what a reward worker waiting for rollouts looks at
        clock.check()


def test_a_wrong_password_is_not_an_outage() -> None:
    do, calls = failing(1, AuthenticationError("invalid password"))
    with pytest.raises(AuthenticationError):
        OutageRetry(OutageClock(10, "x")).call_with_retry(do, lambda error: None)
    assert calls["n"] == 1


def test_a_call_that_did_not_retry_does_not_end_an_outage_others_retry_through() -> None:
    """redis-py's connect() returns at once on a socket the dead server left open: no proof that Redis is back."""
    clock = OutageClock(10, "x")
    clock.failed()
    clock.retry_started()  # another thread is retrying
    clock.succeeded(retried=False)
    assert clock.down and clock.generation == 0
    clock.retry_ended()  # it gave up: now any success ends the outage
    clock.succeeded(retried=False)
    assert not clock.down and clock.generation == 1


def test_an_outage_pauses_the_deadline_and_suspends_the_holder_rule() -> None:
    entry = LedgerEntry(issued_at=100.0, version=0, actor="actor-0")
    # 40 s after issue, 15 s of it with Redis down: 25 s counts against a 30 s deadline
    assert overdue_reason(entry, {"actor-0"}, 30.0, now=140.0, paused_s=15.0) is None
    assert "not back 40.0s" in overdue_reason(entry, {"actor-0"}, 30.0, now=140.0)
    assert "is gone" in overdue_reason(entry, set(), 30.0, now=101.0)
    assert overdue_reason(entry, None, 30.0, now=101.0) is None  # heartbeats not judged while Redis settles
