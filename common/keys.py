"""The names of a run's Redis keys, the connection every process opens, and the dead-letter stream.

Every key of a run lives under ``asyncrl:<run>:`` (:class:`RunKeys`), so several runs can share one Redis and
``redis-cli --scan --pattern 'asyncrl:<run>:*'`` shows everything of one. Anything a process cannot accept goes to
the ``dead`` stream with its source and the reason (:func:`dead_letter`), never silently dropped.

A dead letter keeps the start of the refused payload, not all of it (:data:`DEAD_LETTER_EXCERPT`), with the whole
payload's size and digest: the stream is bounded in bytes as well as in entries, so a flood of large forged
messages cannot fill Redis, and a copy of a message kept elsewhere is still matched to its letter by the digest.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

DEAD_LETTER_MAXLEN = 10_000
"""Approximate cap of the dead-letter stream's entries (``XADD MAXLEN ~``)."""
DEAD_LETTER_EXCERPT = 1024
"""Most bytes of a refused payload its dead letter keeps (the start: what was sent); the size and BLAKE2b digest of
the whole payload are kept beside it. With :data:`DEAD_LETTER_REASON` this bounds the stream to about
``DEAD_LETTER_MAXLEN × 3 KiB`` (≈ 30 MB) however large the refused messages were (measured: 8 letters of 19 MB
payloads take 13 KB of Redis memory)."""
DEAD_LETTER_REASON = 1024
"""Most characters of a dead letter's reason kept (a reason may quote what was sent, e.g. a forged task name)."""


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
    def secret(self) -> str:
        """The run secret that seals data-plane messages and keys group ids (``common/seal.py``); never published."""
        return self._k("secret")

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
    def digests(self) -> str:
        """Hash: policy version → the digest of the weights sent as that version (``WeightManifest.digest``)."""
        return self._k("digests")

    @property
    def samples(self) -> str:
        """JSON list of the newest rows of samples.jsonl (``learner/samples.py``)."""
        return self._k("samples")

    @property
    def trained(self) -> str:
        """Hash: group id → the step that trained it (``learner/trained.py``)."""
        return self._k("trained")

    @property
    def unacked(self) -> str:
        """Hash: replay entry id → ``[step, group id]`` of a trained entry whose acknowledgement waits for the
        checkpoint that holds its step (``learner/trained.py``)."""
        return self._k("unacked")

    @property
    def processes(self) -> str:
        return self._k("processes")

    def heartbeat(self, process_id: str) -> str:
        return self._k(f"heartbeat:{process_id}")

    @property
    def prompts(self) -> str:
        return self._k("prompts")

    @property
    def eval_prompts(self) -> str:
        """The eval prompt queue: actors pop it before ``prompts`` (``common/prompt_ledger.py: take_prompt``)."""
        return self._k("eval_prompts")

    @property
    def eval(self) -> str:
        """JSON list of the newest eval rounds' ``eval/*`` figures (``learner/evaluation.py``), for rl-top."""
        return self._k("eval")

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

    def once(self, token: str) -> str:
        """One-time token of a change to the dispatcher's counters, so a retried one adds nothing
        (``common/prompt_ledger.py: add_counts``); expires after a day."""
        return self._k(f"once:{token}")

    @property
    def done(self) -> str:
        """Set of the ids of completed groups (to tell a late duplicate of a re-issued group)."""
        return self._k("done")

    @property
    def summary(self) -> str:
        """JSON of the learner's latest step (a subset of its metrics.jsonl row), for rl-top."""
        return self._k("summary")

    @property
    def alerts(self) -> str:
        """JSON list of the alerts the learner's health check holds active now."""
        return self._k("alerts")

    @property
    def audit(self) -> str:
        """Stream of the run's audit trail (``common/audit.py``), mirrored by the learner into ``audit.jsonl``."""
        return self._k("audit")


def connect(url: str, outage_s: float | None = None) -> redis.Redis:
    """The Redis client of every process: it lives through a Redis restart and gives up after ``outage_s``.

    A command that fails on a connection error (Redis killed, restarting, loading its AOF) is retried with back-off
    until Redis answers again, for at most ``outage_s`` seconds of outage (default: ``transport.redis_outage_s``'s);
    then it raises :class:`common.outage.RedisUnavailable` (see ``common/outage.py`` for why retrying is safe).

    Replies are parsed by hiredis when it is installed (fast for the replay stream's large
    entries), but commands are always packed by redis-py's Python serializer: it sends values
    above 6 kB as separate buffers, where hiredis's packer copies every 100 kB group once more.
    """
    import redis
    from redis.connection import Encoder, PythonRespSerializer

    from common.config import TransportSection
    from common.outage import OutageClock, OutageRetry

    limit_s = TransportSection().redis_outage_s if outage_s is None else outage_s
    retry = OutageRetry(OutageClock(limit_s, address=url.rpartition("@")[2]))
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    return redis.Redis.from_url(
        url, socket_connect_timeout=5, health_check_interval=30, command_packer=packer, retry=retry
    )


def dead_letter(client: redis.Redis, keys: RunKeys, source: str, reason: str, payload: bytes) -> None:
    """Keep an unacceptable message with where it came from and why it was refused (:func:`letter_fields`: the
    payload's start, size and digest); the audit trail notes the refusal (source, reason and size, never the payload;
    rate-limited per source)."""
    from common.audit import dead_lettered

    fields = letter_fields(source, reason, payload, f"{time.time():.3f}")
    client.xadd(keys.dead, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
    dead_lettered(client, keys.run, source, fields["reason"], len(payload))


def dead_letters(client: redis.Redis, keys: RunKeys, letters: Sequence[tuple[str, str, bytes]]) -> None:
    """:func:`dead_letter` for each ``(source, reason, payload)`` in one round trip: a flood of bad input costs one
    per batch, not one per message."""
    from common.audit import dead_lettered

    if not letters:
        return
    pipe, at = client.pipeline(transaction=False), f"{time.time():.3f}"
    kept = [letter_fields(source, reason, payload, at) for source, reason, payload in letters]
    for fields in kept:
        pipe.xadd(keys.dead, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
    pipe.execute()
    for fields, (source, _, payload) in zip(kept, letters, strict=True):
        dead_lettered(client, keys.run, source, fields["reason"], len(payload))


def letter_fields(source: str, reason: str, payload: bytes, at: str) -> dict[str, str | bytes]:
    """The fields of one dead letter: ``source``, ``reason`` (its first :data:`DEAD_LETTER_REASON` characters),
    ``payload`` (its first :data:`DEAD_LETTER_EXCERPT` bytes: a small message whole), ``size`` (of the whole payload,
    in bytes), ``digest`` (BLAKE2b-256 of the whole payload, hex) and ``at`` (Unix time)."""
    view = memoryview(payload).cast("B")
    if len(reason) > DEAD_LETTER_REASON:
        reason = f"{reason[:DEAD_LETTER_REASON]}… ({len(reason)} characters)"
    return {
        "source": source,
        "reason": reason,
        "payload": bytes(view[:DEAD_LETTER_EXCERPT]),
        "size": str(view.nbytes),
        "digest": hashlib.blake2b(view, digest_size=32).hexdigest(),
        "at": at,
    }
