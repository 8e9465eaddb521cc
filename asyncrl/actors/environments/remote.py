"""An actor's episodes' environments on the run's reward workers (``environment.isolation = "workers"``).

:class:`RemoteEnvironments` has the interface of :class:`~asyncrl.actors.environments.host.EnvironmentHost`
(``call_async``, ``forget``), so :class:`~asyncrl.actors.environments.host.HostedEnvironment` and the episode loop use
either. Each episode's environment is made on the live worker holding the fewest of this actor's episodes, and every
later request of that episode goes to the same worker. The actor tells it which workers serve environments
(:meth:`set_servers`, from the heartbeats it reads anyway); a request to a worker that has left, whose heartbeat expired
or whose connection dropped (a worker that dies drops it at once) fails with
:class:`~asyncrl.common.environments.protocol.EnvironmentLost`, and
:class:`~asyncrl.actors.environments.host.HostedEnvironment` then makes the environment again on another worker and
replays the episode's steps there (or, for an environment that cannot be replayed, fails the episode). Every request
has ``environment.step_timeout_s``.

One thread owns the sockets (ZeroMQ sockets are not thread-safe): it sends what the episodes queue, polls for
replies, and hands each to the future its request waits on.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future, InvalidStateError
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncrl.common.config import EnvironmentSection
from asyncrl.common.environments.protocol import EnvironmentFailed, EnvironmentLost
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.transport.curve import CurveClient
from asyncrl.common.transport.rpc import RequestSocket
from asyncrl.common.wire.seal import Seal

log = get_logger("remote_environments")
POLL_S = 0.005


class RemoteEnvironments:
    """Environments on reward workers, for one actor (module docstring)."""

    restarts = 0  # what EnvironmentHost counts; a worker's own environment process restarts inside the worker

    def __init__(self, section: EnvironmentSection, seal: Seal | None) -> None:
        self.section = section
        self.seal = seal
        self._servers: dict[str, CurveClient | None] = {}  # endpoint -> how to connect; replaced whole
        self._down: frozenset[str] = frozenset()  # endpoints whose connection dropped; replaced whole
        self._where: dict[str, str] = {}  # episode -> the endpoint holding its environment
        self._pending: dict[int, tuple[str, Future]] = {}  # request id -> (endpoint, its future)
        self._outbox: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="remote-environments", daemon=True)
        self._thread.start()

    # -- the actor's side
    def set_servers(self, servers: dict[str, CurveClient | None]) -> None:
        """The workers that serve environments now (endpoint -> CURVE for it, or None on loopback in the clear)."""
        self._servers = dict(servers)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # -- the episodes' side
    async def call_async(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request for ``fields["episode"]``, answered within ``environment.step_timeout_s``."""
        timeout_s = self.section.step_timeout_s
        episode = fields["episode"]
        if op == "make":
            endpoint = await self._choose(timeout_s)
        elif (endpoint := self._where.get(episode, "")) not in self._servers or endpoint in self._down:
            raise EnvironmentLost(f"the reward worker holding this episode's environment is gone ({endpoint})")
        request_id = next(self._ids)
        future: Future = Future()
        self._pending[request_id] = (endpoint, future)
        self._outbox.put((endpoint, {"id": request_id, "op": op, **_wire_fields(op, fields)}))
        try:
            answer = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            raise EnvironmentFailed(f"{op} took longer than environment.step_timeout_s = {timeout_s:g}") from None
        finally:
            self._pending.pop(request_id, None)
        if "error" in answer:
            raise EnvironmentFailed(str(answer["error"]))
        if op == "make":
            self._where[episode] = endpoint
        return answer

    def forget(self, op: str, **fields: Any) -> None:
        """A request nobody waits for (``close``): sent to the episode's worker if it is still there."""
        endpoint = self._where.pop(fields["episode"], "")
        if endpoint in self._servers:
            self._outbox.put((endpoint, {"id": next(self._ids), "op": op, **_wire_fields(op, fields)}))

    async def _choose(self, timeout_s: float) -> str:
        """The live worker holding the fewest of this actor's episodes; waits up to ``timeout_s`` for one."""
        deadline = time.monotonic() + timeout_s
        while not (servers := [e for e in self._servers if e not in self._down]):
            if time.monotonic() > deadline:
                raise EnvironmentFailed(
                    "no reward worker serves environments (environment.isolation = 'workers'): start one "
                    "(rl-actor reward), or set environment.isolation = 'process'"
                )
            await asyncio.sleep(0.1)
        held = Counter(self._where.values())
        return min(servers, key=lambda endpoint: held[endpoint])

    # -- the socket thread
    def _run(self) -> None:
        sockets: dict[str, _Connection] = {}
        try:
            while not self._stop.is_set():
                self._drop_gone(sockets)
                self._send_queued(sockets)
                for endpoint, connection in list(sockets.items()):
                    if (connected := connection.connected()) is False:
                        self._lose(endpoint, "its connection dropped")
                    elif connected and endpoint in self._down:
                        self._down = self._down - {endpoint}
                    for reply in connection.socket.recv_ready():
                        self._resolve(reply)
                time.sleep(POLL_S)
        finally:
            for connection in sockets.values():
                connection.close()

    def _drop_gone(self, sockets: dict[str, _Connection]) -> None:
        servers = self._servers
        for endpoint in [e for e in sockets if e not in servers]:
            sockets.pop(endpoint).close()
            log.info("environment worker gone; its episodes' environments are made again elsewhere", endpoint=endpoint)
        for endpoint in {e for e, _ in list(self._pending.values())} - servers.keys():
            self._lose(endpoint, "it left the run")

    def _lose(self, endpoint: str, why: str) -> None:
        """Fail every request waiting on ``endpoint``; new episodes go elsewhere until it connects again."""
        self._down = self._down | {endpoint}
        for where, future in list(self._pending.values()):
            if where == endpoint:
                _settle(future, EnvironmentLost(f"the reward worker at {endpoint} is gone ({why})"))

    def _send_queued(self, sockets: dict[str, _Connection]) -> None:
        while True:
            try:
                endpoint, body = self._outbox.get_nowait()
            except queue.Empty:
                return
            if endpoint not in self._servers:
                continue  # _drop_gone fails its future
            if endpoint not in sockets:
                try:
                    socket = RequestSocket("environments", self.seal, endpoint, self._servers[endpoint])
                except (OSError, ValueError, zmq.ZMQError) as exc:  # an unreadable CURVE key, a bad endpoint
                    failed = EnvironmentFailed(f"cannot connect to the reward worker at {endpoint}: {exc}")
                    self._fail(body["id"], failed)
                    continue
                sockets[endpoint] = _Connection(socket)
            if not sockets[endpoint].socket.send(body):
                self._fail(body["id"], EnvironmentFailed(f"the reward worker at {endpoint} takes no more requests"))

    def _resolve(self, reply: dict[str, Any]) -> None:
        if (pending := self._pending.get(reply["id"])) is not None:
            _settle(pending[1], reply)

    def _fail(self, request_id: int, exc: Exception) -> None:
        if (pending := self._pending.get(request_id)) is not None:
            _settle(pending[1], exc)


class _Connection:
    """A worker's socket and a monitor of its connection: a worker that dies drops the TCP connection at once, long
    before its heartbeat expires."""

    def __init__(self, socket: RequestSocket) -> None:
        self.socket = socket
        self.monitor = socket.socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)

    def connected(self) -> bool | None:
        """Whether the connection came up (True) or dropped (False) since the last look; None when neither."""
        state = None
        while self.monitor.poll(0):
            state = recv_monitor_message(self.monitor)["event"] == zmq.EVENT_CONNECTED
        return state

    def close(self) -> None:
        self.socket.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close()


def _settle(future: Future, outcome: Any) -> None:
    """Give ``future`` its reply, or its exception; nothing when the waiter already gave up (timed out)."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:
        pass


def _wire_fields(op: str, fields: dict[str, Any]) -> dict[str, Any]:
    """What a request carries: the episode key, and the row and which episode of which group it is for (``make``)
    or the turn (``step``). Never the environment's name or options: the worker makes what its own config names."""
    keep = {"make": ("row", "identity"), "step": ("action",)}.get(op, ())
    return {"episode": fields["episode"], **{k: fields[k] for k in keep if k in fields}}
