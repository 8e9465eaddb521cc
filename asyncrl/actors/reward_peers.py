"""The actor's reward workers: where each finished rollout group goes, and which workers there are to send to.

:class:`RewardPeers` holds a PUSH socket per reward worker; :class:`PeerDiscovery` keeps those sockets in step with
the run's registry (a worker that joins is connected, one that is gone is dropped) and tells the episodes which
workers serve environments. A worker that requires CURVE is reached with this actor's client key, or not at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import zmq

from asyncrl.actors.environments.remote import RemoteEnvironments
from asyncrl.common.config import RunConfig
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.outage import settling
from asyncrl.common.transport.channel import ChannelBlocked, PushChannel, events
from asyncrl.common.transport.curve import CurveClient
from asyncrl.common.wire.messages import Heartbeat
from asyncrl.common.wire.seal import Seal

log = get_logger("actor")


class RewardPeers:
    """A PUSH socket per reward worker, so that the actor knows which worker each group went to (its scorer in the
    ledger: ``common/plane/prompt_ledger.py``); one shared socket would deal groups among workers without saying to
    whom.

    Delivery: a group goes to the next worker in turn whose queue has room (as ZeroMQ's own round robin skips a full
    peer); when every queue is full it waits on the next in turn for up to ``send_timeout_s``, then raises
    :class:`ChannelBlocked`, as it does at once when no worker is connected. Each socket is a :class:`PushChannel`
    (sealed, CURVE per worker, linger 0: what is queued for a worker is dropped when it is disconnected or closed).
    Not thread-safe: the actor calls it from its one sender thread.
    """

    def __init__(self, hwm: int, send_timeout_s: float, seal: Seal | None = None) -> None:
        self.hwm, self.send_timeout_s, self.seal = hwm, send_timeout_s, seal
        self.channels: dict[str, PushChannel] = {}  # endpoint -> its socket
        self.workers: dict[str, str] = {}  # endpoint -> the id of the worker bound there (its heartbeat's)
        self._turn = 0

    def connect(self, endpoint: str, worker: str, curve: CurveClient | None = None) -> None:
        channel = PushChannel("rollouts", hwm=self.hwm, send_timeout_s=self.send_timeout_s, seal=self.seal)
        channel.connect(endpoint, curve)
        self.channels[endpoint], self.workers[endpoint] = channel, worker

    def disconnect(self, endpoint: str) -> None:
        self.workers.pop(endpoint, None)
        if (channel := self.channels.pop(endpoint, None)) is not None:
            channel.close()

    def send(self, message: object) -> str:
        """Send ``message`` to one worker (see the class docstring); returns that worker's id."""
        endpoints = list(self.channels)
        if not endpoints:
            raise ChannelBlocked("channel 'rollouts': no reward worker connected")
        first = self._turn % len(endpoints)
        order = endpoints[first:] + endpoints[:first]
        ready = (e for e in order if events(self.channels[e].socket) & zmq.POLLOUT)
        endpoint = next(ready, order[0])
        self._turn = endpoints.index(endpoint) + 1
        self.channels[endpoint].send(message)
        return self.workers[endpoint]

    def close(self) -> None:
        for endpoint in list(self.channels):
            self.disconnect(endpoint)


class PeerDiscovery:
    """Connects :class:`RewardPeers` to every live reward worker this actor can talk to and drops the gone; tells
    ``environments`` (when episodes run on the workers) which workers serve them. Each :meth:`refresh` is one pass
    over the registry; the socket calls run on ``sender``, the one thread that owns the PUSH sockets."""

    def __init__(
        self,
        config: RunConfig,
        plane: ControlPlane,
        push: RewardPeers,
        sender: concurrent.futures.Executor,
        environments: RemoteEnvironments | None = None,
    ) -> None:
        self.config, self.plane, self.push, self.sender, self.environments = config, plane, push, sender, environments
        self.connected: set[str] = set()  # endpoints of the workers this actor sends to
        self._unreachable: set[str] = set()  # workers that require CURVE while this actor has no key (logged once)

    async def refresh(self) -> None:
        live, _ = await asyncio.to_thread(self.plane.registry.processes)
        workers = {h.endpoint: h for h in live if h.kind == "reward" and h.endpoint}
        self._environment_servers(workers.values())
        for endpoint in workers.keys() & self.connected:  # a worker restarted on the same endpoint has a new id
            self.push.workers[endpoint] = workers[endpoint].process_id
        for endpoint in workers.keys() - self.connected:
            curve = self._curve_for(endpoint, workers[endpoint].curve_public_key)
            if curve is False:
                continue
            await self._on_sender(self.push.connect, endpoint, workers[endpoint].process_id, curve)
            self.connected.add(endpoint)
            log.info("connected to reward worker", endpoint=endpoint, curve=curve is not None)
        gone = self.connected - workers.keys()
        if settling(self.plane.client, self.config.transport.heartbeat_ttl_s):
            gone = set()  # Redis just came back: a worker's heartbeat that expired meanwhile is being renewed
        for endpoint in gone:
            await self._on_sender(self.push.disconnect, endpoint)
            self.connected.discard(endpoint)
            log.info("reward worker gone; disconnected", endpoint=endpoint)

    def _environment_servers(self, workers: Iterable[Heartbeat]) -> None:
        """Tell the episodes which live reward workers serve environments, and how to reach each."""
        if self.environments is None:
            return
        servers = {}
        for beat in workers:
            if beat.environment_endpoint and beat.state != "draining":
                curve = self._curve_for(beat.environment_endpoint, beat.curve_public_key)
                if curve is not False:
                    servers[beat.environment_endpoint] = curve
        self.environments.set_servers(servers)

    def _curve_for(self, endpoint: str, server_key: str) -> CurveClient | Literal[False] | None:
        """How to reach a worker: with CURVE when it advertises a server key (this actor needs
        ``transport.curve_client_key`` then), in the clear when it does not; False when it cannot be reached."""
        client_key = self.config.transport.curve_client_key
        if server_key and client_key:
            return CurveClient(Path(client_key), server_key.encode())
        if not server_key:
            return None
        if endpoint not in self._unreachable:
            self._unreachable.add(endpoint)
            log.error(
                "a reward worker requires CURVE and this actor has no client key; not sending to it",
                endpoint=endpoint,
                action="set transport.curve_client_key to this actor's key pair (name.key_secret), whose public key "
                "is in the workers' transport.curve_client_keys folder",
            )
        return False

    async def _on_sender(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.sender, fn, *args)
