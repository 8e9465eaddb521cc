"""Dead letters keep a refused payload's start, its size and digest, never all of it: the dead-letter stream is
bounded in bytes (entries × excerpt) however large the refused messages, on a real Redis."""

from __future__ import annotations

import hashlib
import json
import uuid

from asyncrl.common.plane import audit as audit_module
from asyncrl.common.plane.dead_letters import DEAD_LETTER_EXCERPT, DEAD_LETTER_REASON, dead_letter, dead_letters
from asyncrl.common.plane.keys import RunKeys

FORGED_BYTES = 19 * 2**20  # a forged group as large as the reward worker's refusals seen in a flood


def forged(n: int) -> bytes:
    """``FORGED_BYTES`` that differ from one message to the next (distinct digests)."""
    return bytes([n]) * 16 + b"\xab" * (FORGED_BYTES - 16)


def test_a_large_refused_payload_keeps_its_start_its_size_and_its_digest(redis_client) -> None:
    keys = RunKeys("big")
    payload = forged(1)
    dead_letter(redis_client, keys, "reward:refused", "task 'x' is not this run's task", payload)
    [(_, fields)] = redis_client.xrange(keys.dead)
    assert set(fields) == {b"source", b"reason", b"payload", b"size", b"digest", b"at"}
    assert fields[b"source"] == b"reward:refused" and fields[b"reason"] == b"task 'x' is not this run's task"
    assert fields[b"payload"] == payload[:DEAD_LETTER_EXCERPT]
    assert int(fields[b"size"]) == FORGED_BYTES
    assert fields[b"digest"].decode() == hashlib.blake2b(payload, digest_size=32).hexdigest()


def test_a_small_payload_is_kept_whole_and_a_long_reason_is_cut(redis_client) -> None:
    keys = RunKeys("small")
    reason = "task '" + "x" * 50_000 + "' is not this run's task"  # a reason that quotes what was sent
    dead_letters(redis_client, keys, [("replay:1-0", "bad field", b"not a message"), ("prompts", reason, b"")])
    (_, first), (_, second) = redis_client.xrange(keys.dead)
    assert first[b"payload"] == b"not a message" and first[b"size"] == b"13"
    assert first[b"digest"].decode() == hashlib.blake2b(b"not a message", digest_size=32).hexdigest()
    assert second[b"payload"] == b"" and second[b"size"] == b"0"
    assert len(second[b"reason"]) < DEAD_LETTER_REASON + 40 and second[b"reason"].endswith(b"(50030 characters)")


def test_the_dead_stream_is_bounded_in_bytes_by_its_excerpts(redis_client) -> None:
    """8 refused 19 MB groups add about 8 excerpts to Redis, not 152 MB; the audit trail keeps each one's true size."""
    keys = RunKeys(f"flood-{uuid.uuid4().hex[:8]}")  # refusals are rate-limited per run in this process: a fresh one
    before = redis_client.info("memory")["used_memory"]
    dead_letters(redis_client, keys, [("reward:refused", "forged", forged(n)) for n in range(4)])
    for n in range(4, 8):
        dead_letter(redis_client, keys, "reward:refused", "forged", forged(n))
    grown = redis_client.info("memory")["used_memory"] - before
    stream = redis_client.memory_usage(keys.dead, samples=0)
    print(f"dead stream after 8 refused {FORGED_BYTES} B payloads: {stream} B; used_memory grew {grown} B")
    assert redis_client.xlen(keys.dead) == 8
    assert stream < 8 * 2 * DEAD_LETTER_EXCERPT  # the excerpts, the other fields and the stream nodes
    assert grown < 2**20
    assert len({fields[b"digest"] for _, fields in redis_client.xrange(keys.dead)}) == 8
    assert audit_module.flush(30, redis_client)  # this server's writer only: earlier tests' servers are gone
    audit = [json.loads(f[b"data"]) for _, f in redis_client.xrange(keys.audit) if f[b"event"] == b"message.refused"]
    [refusal] = audit  # rate-limited: the 1st of one source's refusals
    assert refusal["bytes"] == FORGED_BYTES  # the whole payload's size, though its letter keeps 1 KiB
