"""Membership of a run on the data plane: every message a run's process sends over ZeroMQ carries a seal, a MAC
keyed by the run's secret, and a receiver refuses a message whose seal does not verify before decoding a byte of it.

The secret also keys the channels' CURVE key pairs (:meth:`Seal.key_seed`, used by
``common/transport/curve.py``): a connection is admitted only from a process that holds it, before libzmq queues a
byte it sends. The seal stays the per-message check: it needs no key files, binds a message to its channel, and holds
where the operator's CURVE keys admit a client that does not hold the secret. It costs a keyed hash over the message
(HMAC-SHA-256, which SHA extensions of current CPUs run at GB/s; ``bench/seal.py`` measures it).

The run secret is 32 random bytes kept in the run's Redis (``asyncrl:<run>:secret``; ``common/plane/run_secret.py``),
made by the first process that asks (``SET NX``) and read by every other at start: whoever can reach the run's Redis
— which needs its password — is a member; nobody else can seal a message. The secret is never logged, published in
``config.json``, a metric or the audit trail.

Seal of a message of frames ``f_1 … f_n`` on channel ``c``::

    tag = HMAC-SHA-256(secret, "asyncrl-seal-v1" ‖ len(c) ‖ c ‖ (len(f_i) ‖ f_i for each i) ‖ n), first 16 bytes

(RFC 2104; lengths as 8-byte little-endian, so no two framings of the same bytes share a tag). The tag travels as an
extra first frame. The secret also keys :func:`group_tag`, which makes a run's group ids unpredictable.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable, Sequence
from typing import Any

TAG_BYTES = 16
SECRET_BYTES = 32
_PERSON = b"asyncrl-seal-v1"
_GROUP_PERSON = b"asyncrl-group-v1"
_CURVE_PERSON = b"asyncrl-curve-v1"
_LENGTH = struct.Struct("<Q")


class Seal:
    """Seals and verifies messages of one channel with the run secret (see the module docstring)."""

    def __init__(self, secret: bytes, channel: str) -> None:
        if len(secret) < 16:
            raise ValueError(f"a run secret needs at least 16 bytes, got {len(secret)}")
        self._channel = channel
        prefix = channel.encode()
        self._primed = hmac.new(secret, _PERSON + _LENGTH.pack(len(prefix)) + prefix, "sha256")
        # The root of this channel's CURVE keys (common/transport/curve.py: MemberCurve), kept instead of the secret.
        self._curve_root = hashlib.blake2b(prefix, key=secret, digest_size=32, person=_CURVE_PERSON).digest()

    def __repr__(self) -> str:  # never the secret
        return f"Seal(channel={self._channel!r})"

    def hasher(self) -> Any:
        """A keyed hash primed for one message of this channel; feed each frame with :func:`absorb`, then take the
        tag with :func:`finish` (frames can be hashed as they arrive and dropped)."""
        return self._primed.copy()

    def tag(self, frames: Sequence[Any]) -> bytes:
        """The seal of ``frames`` (bytes, memoryviews or zmq frames)."""
        h = self.hasher()
        for frame in frames:
            absorb(h, frame)
        return finish(h, len(frames))

    def seal(self, frames: Sequence[Any]) -> list[Any]:
        """``frames`` with their seal as a new first frame."""
        return [self.tag(frames), *frames]

    def key_seed(self, role: str) -> bytes:
        """32 bytes that only a holder of the run secret can compute, one per channel and ``role`` (e.g. the
        channel's CURVE server or client secret key)."""
        return hashlib.blake2b(role.encode(), key=self._curve_root, digest_size=32).digest()

    def verifies(self, tag: Any, digest: bytes) -> bool:
        """Whether a received tag frame equals the digest computed over the frames that followed it (constant time)."""
        return hmac.compare_digest(bytes(memoryview(getattr(tag, "buffer", tag))), digest)


def absorb(hasher: Any, frame: Any) -> None:
    """Feed one frame, with its length, into a seal's hasher."""
    view = memoryview(getattr(frame, "buffer", frame))  # a zmq frame's buffer, else the bytes-like itself
    hasher.update(_LENGTH.pack(view.nbytes))
    hasher.update(view)


def finish(hasher: Any, frame_count: int) -> bytes:
    """The tag of the ``frame_count`` frames fed into ``hasher``."""
    hasher.update(_LENGTH.pack(frame_count))
    return hasher.digest()[:TAG_BYTES]


def group_tag(secret: bytes, parts: Iterable[str | int]) -> str:
    """16 hex digits that only a holder of the run secret can compute from ``parts`` (e.g. a group's number): a
    group id that carries it cannot be predicted from the run's name, seed or counters."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return hashlib.blake2b(text, key=secret, digest_size=8, person=_GROUP_PERSON).hexdigest()


def numbered_group_id(run: str, number: int, secret: bytes) -> str:
    """The id of a run's ``number``-th training group: readable (run and number) and unpredictable (its tag)."""
    return f"{run}-{number:08d}-{group_tag(secret, ('group', number))}"
