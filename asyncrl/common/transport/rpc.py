"""Requests and replies over ZeroMQ: a ROUTER socket that serves (:class:`ReplySocket`) and a DEALER per client
(:class:`RequestSocket`), each message one JSON object.

They carry what the channels of :mod:`asyncrl.common.transport.channel` carry, with the same guarantees: a seal with the
run secret on every message both ways (a message that does not verify is dropped and counted before it is parsed), CURVE
on every connection (the run's derived keys, or the operator's beyond loopback) so that a peer without the credential
gets nothing queued, a size limit enforced inside libzmq, linger 0. A request is ``{"id": n,
...}`` and its reply repeats the id; nothing is retried here (the caller owns time limits and retries). Neither class is
thread-safe: one thread owns each socket.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import zmq

from asyncrl.common.observability.logs import get_logger, worth_logging
from asyncrl.common.transport.channel import _Channel, events
from asyncrl.common.transport.curve import CurveClient, CurveServer
from asyncrl.common.wire.seal import Seal, absorb, finish

log = get_logger("rpc")
MAX_MESSAGE_BYTES = 4 * 2**20
"""A request or reply larger than this is refused inside libzmq (observations are capped well below it)."""


def _pack(seal: Seal | None, body: dict[str, Any]) -> list[bytes]:
    frame = json.dumps(body, separators=(",", ":")).encode()
    return seal.seal([frame]) if seal is not None else [frame]


def _unpack(seal: Seal | None, frames: list[Any]) -> dict[str, Any] | None:
    """The JSON object the frames carry, or None when the seal does not verify or the body is not an object."""
    if seal is not None:
        if len(frames) != 2:
            return None
        hasher = seal.hasher()
        absorb(hasher, frames[1])
        if not seal.verifies(frames[0], finish(hasher, 1)):
            return None
        frames = frames[1:]
    if len(frames) != 1:
        return None
    try:
        body = json.loads(bytes(frames[0]))
    except ValueError:
        return None
    return body if isinstance(body, dict) and isinstance(body.get("id"), int) else None


class _Refusals:
    def __init__(self, name: str, on_refused: Callable[[], None] | None = None) -> None:
        self.name, self.count, self.on_refused = name, 0, on_refused

    def refused(self) -> None:
        self.count += 1
        if self.on_refused is not None:
            self.on_refused()
        if worth_logging(self.count):
            log.warning(
                "refused a message without a valid seal or body",
                channel=self.name,
                refused=self.count,
                action="only the run's processes may send here; check that every process runs the same asyncrl",
            )


class ReplySocket(_Channel):
    """The serving end: :meth:`recv` gives ``(client, request)``; :meth:`reply` answers that client."""

    def __init__(
        self, name: str, seal: Seal | None, hwm: int = 1000, on_refused: Callable[[], None] | None = None
    ) -> None:
        super().__init__(zmq.ROUTER, name, hwm, seal)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.refusals = _Refusals(name, on_refused)

    def bind(self, endpoint: str, curve: CurveServer | None = None) -> str:
        bound = super().bind(endpoint, curve)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a client that is gone raises, not vanishes
        return bound

    def recv(self, timeout_s: float) -> tuple[bytes, dict[str, Any]] | None:
        """The next request within ``timeout_s`` (refused ones are counted and skipped), or None."""
        self.count_refused_handshakes()
        if not self.socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        client, *frames = self.socket.recv_multipart(copy=False)
        body = _unpack(self.seal, frames)
        if body is None:
            self.refusals.refused()
            return None
        return bytes(client.buffer), body

    def reply(self, client: bytes, body: dict[str, Any]) -> bool:
        """Send ``body`` to ``client``; False when that client is gone (its reply is dropped)."""
        try:
            self.socket.send_multipart([client, *_pack(self.seal, body)], flags=zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            return False
        return True


class RequestSocket(_Channel):
    """A client's end, connected to one server: :meth:`send` a request, :meth:`recv` its replies."""

    def __init__(self, name: str, seal: Seal | None, endpoint: str, curve: CurveClient | None = None) -> None:
        super().__init__(zmq.DEALER, name, hwm=1000, seal=seal)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.refusals = _Refusals(name)
        self.connect(endpoint, curve)

    def send(self, body: dict[str, Any]) -> bool:
        """Queue ``body`` without blocking; False when the server's queue is full."""
        try:
            self.socket.send_multipart(_pack(self.seal, body), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def recv_ready(self) -> list[dict[str, Any]]:
        """Every reply already queued (refused ones counted and skipped)."""
        replies = []
        while events(self.socket) & zmq.POLLIN:
            body = _unpack(self.seal, self.socket.recv_multipart(copy=False))
            if body is None:
                self.refusals.refused()
            else:
                replies.append(body)
        return replies
