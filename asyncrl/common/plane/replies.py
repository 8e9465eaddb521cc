"""Replies of the plane's Redis clients, typed as they arrive.

redis-py annotates each command for every client it can build at once: ``bytes | str`` for a string reply (``str``
under ``decode_responses=True``), and for a stream read a union of RESP2 lists and RESP3 maps. Every client here is
built like :func:`asyncrl.common.plane.keys.connect`'s (RESP2, ``decode_responses=False``), so a string reply is
always ``bytes`` and a stream read is a list of ``[stream, entries]`` pairs. These functions narrow a reply to that
shape in this one place instead of a cast at each command; they cost nothing at run time (no check, no copy).
"""

from __future__ import annotations

from typing import cast

StreamEntry = tuple[bytes, dict[bytes, bytes] | None]
"""One stream entry: (its id, its fields); the fields are None for a pending entry that was trimmed away."""


def blob(reply: bytes | str) -> bytes:
    """A string reply (``SET … GET``, a list element, an ``XADD`` id)."""
    return cast(bytes, reply)


def maybe_blob(reply: bytes | str | None) -> bytes | None:
    """A string reply that is nil for a missing key or field (``GET``, ``HGET``)."""
    return cast("bytes | None", reply)


def maybe_blobs(reply: list[bytes | str | None]) -> list[bytes | None]:
    """A list of string replies, nil for each missing key (``MGET``)."""
    return cast("list[bytes | None]", reply)


def blob_map(reply: dict[bytes | str, bytes | str]) -> dict[bytes, bytes]:
    """A hash (``HGETALL``)."""
    return cast("dict[bytes, bytes]", reply)


def stream_read(reply: object) -> list[tuple[bytes, list[StreamEntry]]] | None:
    """An ``XREAD``/``XREADGROUP`` reply: (stream, its entries) for each stream with entries; empty, or None on a
    timeout, when none has any."""
    return cast("list[tuple[bytes, list[StreamEntry]]] | None", reply)


def stream_range(reply: object) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """An ``XRANGE``/``XREVRANGE`` reply: (id, fields) of each entry, none of them trimmed."""
    return cast("list[tuple[bytes, dict[bytes, bytes]]]", reply)
