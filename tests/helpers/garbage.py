"""Hostile messages for flood tests: every kind of bad input a peer can put on a ZeroMQ socket or in the replay stream.

:func:`bad_messages` draws undecodable messages (lists of frames) from one valid :class:`RolloutGroup` or
:class:`ScoredGroup`, round-robin over :data:`KINDS`. Map keys and list positions are the peer's to choose and differ
from message to message, so a receiver that labelled or logged by the full field path would grow without bound.
:func:`bad_blob` is one replay-stream value: the frames of a bad message packed into a blob, or a blob whose own
frame table is broken. Nothing made here is valid: a receiver must refuse every one.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np

from asyncrl.common.wire.messages import SCHEMA_VERSION, Heartbeat, RolloutGroup, ScoredGroup, encode, pack_frames

Frames = list[bytes]
KINDS = (
    "random_bytes",
    "truncated_msgpack",
    "wrong_version",
    "wrong_schema",
    "wrong_types",
    "huge_shapes",
    "oversized",
    "too_many_frames",
    "not_finite",
)
# Positions in a RolloutGroup's body (field order is the wire contract: common/wire/messages.py).
_GROUP_ID, _PROMPT_IDS, _TEXTS, _TIMINGS = 0, 3, 9, 13


def bad_messages(
    valid: RolloutGroup | ScoredGroup, max_bytes: int, seed: int = 0, weights: dict[str, int] | None = None
) -> Iterator[tuple[str, Frames]]:
    """``(kind, frames)`` forever, cycling through :data:`KINDS`, each ``weights[kind]`` times a cycle (default 1);
    ``max_bytes`` is the receiver's size limit."""
    rng = random.Random(seed)
    maker = _Maker(valid, max_bytes)
    cycle = [kind for kind in KINDS for _ in range((weights or {}).get(kind, 1))]
    while True:
        for kind in cycle:
            yield kind, getattr(maker, kind)(rng)


def bad_blob(frames: Frames, rng: random.Random) -> bytes:
    """A replay-stream value: mostly ``frames`` packed as a reward worker packs a group, sometimes a broken blob."""
    choice = rng.random()
    if choice < 0.05:
        return rng.randbytes(rng.randint(0, 64))  # not a blob at all
    blob = pack_frames(frames)
    if choice < 0.10:
        return blob[:4] + struct.pack("<I", 2**32 - 1) + blob[8:]  # claims four billion frames
    if choice < 0.15:
        return blob[: rng.randint(8, max(8, len(blob) - 1))]  # cut short
    return blob


class _Maker:
    def __init__(self, valid: RolloutGroup | ScoredGroup, max_bytes: int) -> None:
        self.scored = isinstance(valid, ScoredGroup)
        self.frames = [bytes(memoryview(f)) for f in encode(valid)]
        self.header = msgpack.unpackb(self.frames[0], raw=False, ext_hook=msgpack.ExtType)
        self.part = bytes(max_bytes // 3 + 1)  # three of them are above the limit; one buffer for all

    def _replace(self, index: int, value: Any, frames: Frames | None = None) -> Frames:
        """The valid message with field ``index`` of its rollout replaced by ``value`` (and other array frames)."""
        version, tag, body = self.header
        body = list(body)
        rollout = list(body[0]) if self.scored else body
        rollout[index] = value
        if self.scored:
            body[0] = rollout
        return [msgpack.packb([version, tag, body], use_bin_type=True), *(frames or self.frames[1:])]

    def random_bytes(self, rng: random.Random) -> Frames:
        return [rng.randbytes(rng.randint(1, 256))]

    def truncated_msgpack(self, rng: random.Random) -> Frames:
        return [self.frames[0][: rng.randint(1, len(self.frames[0]) - 1)], *self.frames[1:]]

    def wrong_version(self, rng: random.Random) -> Frames:
        version, tag, body = self.header
        return [msgpack.packb([version + rng.randint(1, 9), tag, body], use_bin_type=True), *self.frames[1:]]

    def wrong_schema(self, rng: random.Random) -> Frames:
        other = [bytes(memoryview(f)) for f in encode(Heartbeat(process_id="p", kind="reward", state="ready"))]
        short = [msgpack.packb([SCHEMA_VERSION, self.header[1], self.header[2][:1]], use_bin_type=True)]
        return rng.choice([other, short, [msgpack.packb({"not": "a list"})], [msgpack.packb([1, 2, 3, 4])]])

    def wrong_types(self, rng: random.Random) -> Frames:
        key = f"k{rng.getrandbits(64):x}"  # a fresh key every time: the field path it makes is the peer's choice
        texts = ["19"] * rng.randint(0, 2000) + [7]  # a wrong item at a position of the peer's choosing
        return rng.choice(
            [
                self._replace(_GROUP_ID, rng.randint(0, 9)),
                self._replace(_TIMINGS, {key: "not a float"}),
                self._replace(_TIMINGS, [1.0, 2.0]),
                self._replace(_TEXTS, texts),
            ]
        )

    def huge_shapes(self, rng: random.Random) -> Frames:
        shape = rng.choice([[2**40], [2**62], [2**31, 2**31], [2**64 - 1], [-1]])
        ref = msgpack.ExtType(1, msgpack.packb(["int32", shape, 1]))  # [dtype, shape, frame] over a 4-byte frame
        return self._replace(_PROMPT_IDS, ref, [b"\0\0\0\0", *self.frames[2:]])

    def oversized(self, rng: random.Random) -> Frames:
        """Every frame within the limit, all of them together above it (a single frame above the limit never reaches
        the process: libzmq refuses it, see common/transport/channel.py)."""
        return [self.frames[0], self.part, self.part, self.part]

    def too_many_frames(self, rng: random.Random) -> Frames:
        return [*self.frames, *([b""] * rng.randint(60, 200))]  # the limit is 64

    def not_finite(self, rng: random.Random) -> Frames:
        value = rng.choice([math.nan, math.inf, -math.inf])
        n = len(self.frames[3]) // 4  # logprobs: the third array, frame 3
        choices = [
            self._replace(_TIMINGS, {f"k{rng.getrandbits(32):x}": value}),
            [*self.frames[:3], np.full(n, value, np.float32).tobytes(), *self.frames[4:]],
        ]
        if self.scored:  # the rewards (the frame before the turn rewards, which are the last) and the scoring time
            version, tag, body = self.header
            rewards = np.full(len(self.frames[-2]) // 4, value, np.float32).tobytes()
            choices.append([*self.frames[:-2], rewards, self.frames[-1]])
            choices.append([msgpack.packb([version, tag, [*body[:4], value]], use_bin_type=True), *self.frames[1:]])
        return rng.choice(choices)
