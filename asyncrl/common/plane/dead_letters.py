"""The dead-letter stream: anything a process cannot accept goes to the run's ``dead`` stream with its source and
the reason (:func:`dead_letter`), never silently dropped, and the audit trail notes the refusal.

A dead letter keeps the start of the refused payload, not all of it (:data:`DEAD_LETTER_EXCERPT`), with the whole
payload's size and digest: the stream is bounded in bytes as well as in entries, so a flood of large forged
messages cannot fill Redis, and a copy of a message kept elsewhere is still matched to its letter by the digest.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.common.plane import replies
from asyncrl.common.plane.audit import dead_lettered
from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.wire.messages import WireError, pack_frames

if TYPE_CHECKING:
    import redis
    from redis.typing import EncodableT, FieldT

DEAD_LETTER_MAXLEN = 10_000
"""Approximate cap of the dead-letter stream's entries (``XADD MAXLEN ~``)."""
DEAD_LETTER_EXCERPT = 1024
"""Most bytes of a refused payload its dead letter keeps (the start: what was sent); the size and BLAKE2b digest of
the whole payload are kept beside it. With :data:`DEAD_LETTER_REASON` this bounds the stream to about
``DEAD_LETTER_MAXLEN × 3 KiB`` (≈ 30 MB) however large the refused messages were (measured: 8 letters of 19 MB
payloads take 13 KB of Redis memory)."""
DEAD_LETTER_REASON = 1024
"""Most characters of a dead letter's reason kept (a reason may quote what was sent, e.g. a forged task name)."""


def dead_letter(client: redis.Redis, keys: RunKeys, source: str, reason: str, payload: bytes) -> None:
    """Keep an unacceptable message with where it came from and why it was refused (:func:`letter_fields`: the
    payload's start, size and digest); the audit trail notes the refusal (source, reason and size, never the payload;
    rate-limited per source)."""
    fields = letter_fields(source, reason, payload, f"{time.time():.3f}")
    client.xadd(keys.dead, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
    dead_lettered(client, keys.run, source, clipped_reason(reason), len(payload))


def dead_letters(client: redis.Redis, keys: RunKeys, letters: Sequence[tuple[str, str, bytes]]) -> None:
    """:func:`dead_letter` for each ``(source, reason, payload)`` in one round trip: a flood of bad input costs one
    per batch, not one per message."""
    if not letters:
        return
    pipe, at = client.pipeline(transaction=False), f"{time.time():.3f}"
    kept = [letter_fields(source, reason, payload, at) for source, reason, payload in letters]
    for fields in kept:
        pipe.xadd(keys.dead, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
    pipe.execute()
    for source, reason, payload in letters:
        dead_lettered(client, keys.run, source, clipped_reason(reason), len(payload))


def newest_reason(client: redis.Redis, keys: RunKeys) -> str | None:
    """The reason of the newest dead letter of the run, or None when there is none."""
    newest = replies.stream_range(client.xrevrange(keys.dead, count=1))
    return newest[0][1].get(b"reason", b"").decode(errors="replace") if newest else None


def letter_fields(source: str, reason: str, payload: bytes, at: str) -> dict[FieldT, EncodableT]:
    """The fields of one dead letter: ``source``, ``reason`` (its first :data:`DEAD_LETTER_REASON` characters),
    ``payload`` (its first :data:`DEAD_LETTER_EXCERPT` bytes: a small message whole), ``size`` (of the whole payload,
    in bytes), ``digest`` (BLAKE2b-256 of the whole payload, hex) and ``at`` (Unix time)."""
    view = memoryview(payload).cast("B")
    return {
        "source": source,
        "reason": clipped_reason(reason),
        "payload": bytes(view[:DEAD_LETTER_EXCERPT]),
        "size": str(view.nbytes),
        "digest": hashlib.blake2b(view, digest_size=32).hexdigest(),
        "at": at,
    }


def clipped_reason(reason: str) -> str:
    """``reason`` as its dead letter keeps it: its first :data:`DEAD_LETTER_REASON` characters."""
    if len(reason) > DEAD_LETTER_REASON:
        return f"{reason[:DEAD_LETTER_REASON]}… ({len(reason)} characters)"
    return reason


DEAD_PAYLOAD_BYTES = 1024
"""Most bytes of an undecodable message kept in its dead letter: its header's start shows what was sent (the reason
says what is wrong), and a flood stays cheap for Redis (a 16 KiB dead letter costs it ten times a 1 KiB one here)."""


class MalformedLetters:
    """Dead-letters the rollout messages that did not decode (source ``reward:malformed``), ``batch`` per round trip.

    Each keeps its frames as one blob (``pack_frames``), every frame cut so that at most :data:`DEAD_PAYLOAD_BYTES`
    are kept in all: enough to see what was sent, while a flood of large garbage stays small in the dead-letter
    stream (``MAXLEN ~`` bounds its entries). The worker flushes whenever it writes scored groups or goes idle.
    """

    def __init__(self, client: Any, keys: RunKeys, batch: int = 64) -> None:
        self.client = client
        self.keys = keys
        self.batch = batch
        self._pending: list[tuple[str, str, bytes]] = []  # (source, reason, payload)

    def add(self, frames: list[Any], exc: WireError) -> None:
        budget, kept, size = DEAD_PAYLOAD_BYTES, [], 0
        for frame in frames:
            view = memoryview(getattr(frame, "buffer", frame)).cast("B")
            size += view.nbytes
            kept.append(bytes(view[: max(budget, 0)]))
            budget -= view.nbytes
        reason = str(exc) if budget >= 0 else f"{exc} (payload cut to {DEAD_PAYLOAD_BYTES} of {size} bytes)"
        self._pending.append(("reward:malformed", reason, pack_frames(kept)))
        if len(self._pending) >= self.batch:
            self.flush()

    def flush(self) -> None:
        dead_letters(self.client, self.keys, self._pending)
        self._pending.clear()
