"""ZeroMQ PUSH/PULL channels that carry wire messages between processes.

Delivery semantics (ZeroMQ PUSH/PULL, https://zguide.zeromq.org/docs/chapter2/):

- **Fan-out / fan-in**: a PUSH socket connected to several PULL peers deals messages round-robin
  among them (load balancing); a PULL socket fair-queues from all its PUSH peers. Messages from
  one sender arrive in order; there is no order across senders.
- **Back-pressure**: each side queues at most ``hwm`` messages; beyond that ``send`` blocks, up to
  ``send_timeout_s``, then raises :class:`ChannelBlocked` — nothing is dropped silently.
- **No durability**: messages queued in a process die with it, and ``close`` discards what is
  still queued (linger 0, so a dead peer can never hang a shutdown). At-least-once delivery of
  prompt groups is the in-flight ledger's job (a lost group is re-issued), not the channel's.
- **Bad input**: a message that does not decode is counted
  (``asyncrl_wire_malformed_messages_total``, by channel and the field's schema path), handed to
  ``on_malformed`` (the reward worker dead-letters it), logged at the 1st, 10th, 100th, … of each
  field, and skipped; the receiver keeps running. A frame above ``max_bytes`` is refused inside
  libzmq, which drops the connection (the sender reconnects): that message never reaches the
  process, so it is not counted.
- **Who may connect** (a channel with a :class:`~asyncrl.common.wire.seal.Seal`, loopback included): CURVE with keys
  every process of the run derives from the run secret (:class:`~asyncrl.common.transport.curve.MemberCurve`), or
  the operator's keys where they are given (required beyond loopback; the binding side then accepts only the client
  public keys in its authorised-keys folder, re-read when an unknown key knocks, and its public key is advertised in
  the server's heartbeat). libzmq reads nothing but the handshake from a peer until it completes, so a peer without
  the credential gets no message queued: libzmq queues a whole multi-frame message before its first frame can be
  read, and bounds each frame, not their number, so admitting strangers to the queue would let one message of many
  frames take any amount of memory. What such a peer can hold is the one frame it sends before the handshake fails.
  Every failed handshake is counted (``asyncrl_channel_refused_handshakes_total``), logged at the 1st, 10th, 100th, …
  and handed to ``on_refused_handshake`` (the reward worker's audit trail); a refused operator key also to
  ``CurveServer.on_refused``. Encryption and authentication run in libzmq's I/O threads (``bench/seal.py``).
- **Membership of each message**: a sealed channel sends every message with the run secret's MAC as an extra first
  frame, and its receiving end refuses a message whose seal does not verify before decoding any of it: counted
  (``asyncrl_channel_unsealed_messages_total``), logged at the 1st, 10th, 100th, …, handed to ``on_unsealed``,
  never dead-lettered (a stranger's bytes are not the run's to keep). Where the run's own CURVE keys admit the
  connection it cannot fail; it is what holds against a client with an authorised operator key but not the secret.
- A channel without a seal (tests, benchmarks) binds only on loopback and admits anyone who connects.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import zmq

from asyncrl.common.net import is_loopback
from asyncrl.common.observability.logs import get_logger, worth_logging
from asyncrl.common.observability.metrics import (
    CHANNEL_RECEIVED,
    CHANNEL_REFUSED_HANDSHAKES,
    CHANNEL_SENT,
    CHANNEL_SENT_BYTES,
    CHANNEL_UNSEALED,
    WIRE_MALFORMED,
)
from asyncrl.common.transport.curve import AuthorizedKeys, CurveClient, CurveServer, MemberCurve, MemberKey
from asyncrl.common.wire.messages import Decoder, Limits, WireError, encode
from asyncrl.common.wire.seal import Seal, absorb, finish

log = get_logger("channel")
_FAILED_HANDSHAKES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def events(socket: zmq.Socket) -> int:
    """``socket``'s ``ZMQ_EVENTS``: whether it can receive (``zmq.POLLIN``) or send (``zmq.POLLOUT``) now, read without
    a poll. pyzmq types every option's value as ``int | bytes | str``; this one is an int."""
    return cast(int, socket.get(zmq.EVENTS))


class ChannelBlocked(TimeoutError):
    """The peer's queue stayed full (high-water mark) for longer than the send timeout."""


class InsecureBindError(PermissionError):
    """Refused to bind beyond loopback without CURVE keys."""


class _Channel:
    def __init__(self, kind: int, name: str, hwm: int, seal: Seal | None = None) -> None:
        self.name = name
        self.seal = seal
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(kind)
        self.socket.linger = 0
        self.socket.sndhwm = hwm
        self.socket.rcvhwm = hwm
        self._authenticator: Any = None
        self._refusals: Any = None  # a bound socket's monitor of failed handshakes (see refused_handshakes)
        self.refused_handshakes = 0
        self.on_refused_handshake: Callable[[int], None] | None = None
        self.endpoint = ""
        self.curve_public_key = ""
        """The server public key (Z85) a socket bound with the operator's CURVE keys advertises to its clients; empty
        otherwise (a run's own keys are derived by every member, never advertised)."""
        self.authorized: AuthorizedKeys | None = None  # a CURVE server's ZAP check

    def bind(self, endpoint: str, curve: CurveServer | None = None) -> str:
        """Bind (``tcp://host:0`` picks a free port); returns the endpoint actually bound."""
        if curve is None and not is_loopback(endpoint):
            raise InsecureBindError(
                f"channel {self.name!r}: binding {endpoint} beyond loopback needs CURVE keys "
                "(set transport.curve_server_key and transport.curve_client_keys)"
            )
        if curve is not None:
            self._serve_curve(curve)
        elif self.seal is not None:
            self._serve_members(MemberCurve.of(self.seal))
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = self.socket.bind_to_random_port(endpoint.rsplit(":", 1)[0])
            self.endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"
        else:
            self.socket.bind(endpoint)
            self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def _serve_curve(self, curve: CurveServer) -> None:
        """Serve with the operator's keys: clients whose public key is in the authorised folder."""
        import zmq.auth

        public, secret = zmq.auth.load_certificate(str(curve.secret_key_file))
        if secret is None:
            raise ValueError(f"{curve.secret_key_file} holds no secret key")
        self.authorized = AuthorizedKeys(self.name, Path(curve.authorized_clients), curve.on_refused)
        self._serve(public, secret, self.authorized)
        self.curve_public_key = public.decode()

    def _serve_members(self, keys: MemberCurve) -> None:
        """Serve with the run's own keys: only a process that holds the run secret completes the handshake."""
        self._serve(keys.server_public, keys.server_secret, MemberKey(self.name, keys.client_public))

    def _serve(self, public: bytes, secret: bytes, provider: AuthorizedKeys | MemberKey) -> None:
        """CURVE server with a ZAP thread that asks ``provider`` about each client key; failed handshakes counted."""
        from zmq.auth.thread import ThreadAuthenticator

        self._own_context()
        self._authenticator = ThreadAuthenticator(self.context)
        self._authenticator.start()
        self._authenticator.configure_curve_callback(domain="*", credentials_provider=provider)
        self.socket.curve_publickey = public
        self.socket.curve_secretkey = secret
        self.socket.curve_server = True
        self._refusals = self.socket.get_monitor_socket(_FAILED_HANDSHAKES)

    def count_refused_handshakes(self) -> int:
        """Count the handshakes that failed since the last call (a peer without the run's keys, or with keys the
        operator did not authorise); logs the 1st, 10th, 100th, … and calls ``on_refused_handshake``. Returns the
        refusals so far. Cheap: one socket option read when none failed."""
        monitor = self._refusals
        if monitor is None:
            return 0
        while events(monitor) & zmq.POLLIN:
            monitor.recv_multipart()  # (event and value, endpoint): which peer is not known to the socket
            self.refused_handshakes += 1
            CHANNEL_REFUSED_HANDSHAKES.labels(self.name).inc()
            if self.on_refused_handshake is not None:
                self.on_refused_handshake(self.refused_handshakes)
            if worth_logging(self.refused_handshakes):
                log.warning(
                    "refused a connection that failed the CURVE handshake; nothing it sent was read",
                    channel=self.name,
                    refused=self.refused_handshakes,
                    action="only the run's processes (which reach its Redis, and so its secret) or clients with an "
                    "authorised key may connect; a flood of these is a peer that is neither",
                )
        return self.refused_handshakes

    def _own_context(self) -> None:
        """Move the (not yet bound) socket into a context of its own: a CURVE server's ZAP handler binds
        ``inproc://zeromq.zap.01`` once per context, so two servers in one process (or one closed and the next
        opened at once) must not share the process-wide context."""
        old = self.socket
        self.context = zmq.Context()
        self.socket = self.context.socket(cast(int, old.type))  # an int, whatever pyzmq's option type says
        for option in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM, zmq.SNDTIMEO, zmq.RCVTIMEO, zmq.MAXMSGSIZE):
            self.socket.setsockopt(option, old.getsockopt(option))
        old.close(linger=0)

    def connect(self, endpoint: str, curve: CurveClient | None = None) -> None:
        """Connect; with ``curve`` (the operator's keys) or a seal (the run's own keys), this connection is encrypted
        and authenticated (options are read per connect, so one socket may reach several servers, each with its own
        key)."""
        if curve is not None:
            import zmq.auth

            public, secret = zmq.auth.load_certificate(str(curve.secret_key_file))
            if secret is None:
                raise ValueError(f"{curve.secret_key_file} holds no secret key")
            self.socket.curve_publickey = public
            self.socket.curve_secretkey = secret
            self.socket.curve_serverkey = curve.server_key()
        elif self.seal is not None:
            keys = MemberCurve.of(self.seal)
            self.socket.curve_publickey = keys.client_public
            self.socket.curve_secretkey = keys.client_secret
            self.socket.curve_serverkey = keys.server_public
        self.socket.connect(endpoint)
        self.endpoint = endpoint

    def close(self) -> None:
        """Close at once (linger 0): queued messages are discarded, a dead peer cannot block us."""
        if self._refusals is not None:
            self.socket.disable_monitor()
            self._refusals.close(linger=0)
            self._refusals = None
        self.socket.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
            self.context.destroy(linger=0)  # the server's own context (see _own_context)

    def __enter__(self) -> _Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PushChannel(_Channel):
    """The sending end; blocks at the high-water mark for up to ``send_timeout_s`` (None = forever)."""

    def __init__(self, name: str, hwm: int = 64, send_timeout_s: float | None = None, seal: Seal | None = None) -> None:
        super().__init__(zmq.PUSH, name, hwm, seal)
        self.socket.sndtimeo = -1 if send_timeout_s is None else int(send_timeout_s * 1000)

    def send(self, message: Any) -> None:
        self.send_frames(encode(message))

    def send_frames(self, frames: Sequence[Any]) -> None:
        """Send already-encoded frames (sealed first when the channel has a seal); arrays go out without a copy."""
        if self.seal is not None:
            frames = self.seal.seal(frames)
        try:
            self.socket.send_multipart(frames, copy=False)
        except zmq.Again:
            raise ChannelBlocked(
                f"channel {self.name!r}: peer queue full for {self.socket.sndtimeo} ms; "
                "is the receiving side alive and keeping up?"
            ) from None
        CHANNEL_SENT.labels(self.name).inc()
        CHANNEL_SENT_BYTES.labels(self.name).inc(sum(len(memoryview(f)) for f in frames))


class PullChannel(_Channel):
    """The receiving end: decodes into ``expected`` and skips (and counts) anything malformed.

    ``on_malformed(frames, error)`` is called with every message that does not decode (the frames kept of it: at
    most ``limits.max_frames + 1`` of them, about ``limits.max_bytes`` in all), e.g. to dead-letter it.
    """

    def __init__(
        self,
        name: str,
        expected: type,
        hwm: int = 64,
        limits: Limits | None = None,
        on_malformed: Callable[[list[Any], WireError], None] | None = None,
        seal: Seal | None = None,
        on_unsealed: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(zmq.PULL, name, hwm, seal)
        self.limits = limits or Limits()
        self.decoder = Decoder(expected, self.limits)
        # Refuse oversized frames inside libzmq, before they are even buffered (the limit is per frame there).
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_bytes)
        self.on_malformed = on_malformed
        self.malformed = 0
        self._malformed_by_label: dict[str, int] = {}  # keys: WireError.label, bounded by the schema
        self.on_unsealed = on_unsealed
        self.unsealed = 0

    def recv(self, timeout_s: float | None = None) -> Any | None:
        """The next well-formed message, or None when none arrived within ``timeout_s`` (malformed ones are counted
        and skipped meanwhile: a flood of them cannot keep the caller from checking for a stop past its timeout)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.count_refused_handshakes()
        while True:
            # A message already queued is read without a poll: pyzmq's poll costs tens of microseconds per call.
            if not events(self.socket) & zmq.POLLIN:
                wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
                if not self.socket.poll(wait_ms, zmq.POLLIN):
                    return None
            frames, sealed = self._recv_frames()
            if not sealed:
                self._count_unsealed()
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            try:
                message = self.decoder.decode(frames)
            except WireError as exc:
                self._count_malformed(frames, exc)
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue  # skip it and keep waiting for a good one
            CHANNEL_RECEIVED.labels(self.name).inc()
            return message

    def _recv_frames(self) -> tuple[list[Any], bool]:
        """The frames of the next message, and whether its seal verified (always True on a channel without a seal).

        Past ``max_frames`` frames or ``max_bytes`` in all, the rest are read and dropped: the decoder refuses what was
        kept (too many frames, too large) without this process holding more. (libzmq itself queues a whole message
        before its first frame can be read, and bounds only each frame.) The seal covers every frame, dropped ones
        included, so membership is known for the whole message while only a bounded part of it is kept.
        """
        first = self.socket.recv(copy=False)
        hasher = self.seal.hasher() if self.seal is not None else None
        frames = [] if hasher is not None else [first]  # a sealed message's first frame is its tag
        size, more, count = sum(len(f) for f in frames), first.more, 0
        while more:
            frame = self.socket.recv(copy=False)
            more, count = frame.more, count + 1
            if hasher is not None:
                absorb(hasher, frame)
            if len(frames) <= self.limits.max_frames and size <= self.limits.max_bytes:
                frames.append(frame)
                size += len(frame)
        if hasher is None:
            return frames, True
        assert self.seal is not None
        return frames, self.seal.verifies(first, finish(hasher, count))

    def _count_unsealed(self) -> None:
        """A message without a valid seal: refused before decoding, counted, logged at the 1st, 10th, 100th, …"""
        self.unsealed += 1
        CHANNEL_UNSEALED.labels(self.name).inc()
        if self.on_unsealed is not None:
            self.on_unsealed(self.unsealed)
        if worth_logging(self.unsealed):
            log.warning(
                "refused a message without a valid seal",
                channel=self.name,
                refused=self.unsealed,
                action="only processes that reach the run's Redis (and so its secret) may send here; "
                "a flood of these is a local or remote peer that is not one of the run's processes",
            )

    def _count_malformed(self, frames: list[Any], exc: WireError) -> None:
        """Count (by field label), hand to ``on_malformed``, and log the 1st, 10th, 100th, … of each field."""
        self.malformed += 1
        WIRE_MALFORMED.labels(self.name, exc.label).inc()
        if self.on_malformed is not None:
            self.on_malformed(frames, exc)
        count = self._malformed_by_label[exc.label] = self._malformed_by_label.get(exc.label, 0) + 1
        if worth_logging(count):
            log.warning(
                "dropped a malformed message",
                channel=self.name,
                field=exc.field,
                reason=exc.reason,
                count=count,
                action="check that every process runs the same asyncrl version; a flood of these is a peer that is "
                "not one of the run's processes (bind beyond loopback only with CURVE keys)",
            )
