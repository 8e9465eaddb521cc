"""Environments served to the run's actors by its reward workers (``environment.isolation = "workers"``).

A reward worker that serves environments binds a ROUTER socket (:class:`~asyncrl.common.transport.rpc.ReplySocket`:
sealed with the run secret, CURVE like its PULL socket) next to its PULL socket and advertises it in its heartbeat
(``environment_endpoint``). Actors open each episode's environment on one of the live workers and step it there
(``actors/environments/remote.py``); the worker keeps the environments in its environment process
(:class:`~asyncrl.actors.environments.host.EnvironmentHost`), so one that crashes, hangs or eats memory ends only its
own episode, and neither the worker nor any actor's engine.

Requests: ``make`` (a dataset row, and which episode of which group it is for), ``step`` (the model's turn),
``score``, ``close``. Which environment is made, and with which options, is the worker's own config
(``environment.name``, ``environment.options``), never the request's. Episodes are kept per client, so two actors'
episode keys never meet. An episode nobody has touched for :data:`IDLE_S` (its actor died or left without closing it)
is forgotten.

An environment that cannot be replayed (``replayable = False``) is served with a notary
(``actors/environments/notary.py``): its ``make`` must name the episode (``identity``: group id and index), and its
``step`` and ``score`` answers carry the worker's signature (``common/wire/attestation.py``), which the reward worker
that scores the episode checks instead of replaying it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from asyncrl.actors.environments.host import EnvironmentHost
from asyncrl.actors.environments.notary import Notary
from asyncrl.common.config import EnvironmentSection, RunConfig
from asyncrl.common.environments.protocol import EnvironmentFailed, EpisodeRow
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.metrics import ENVIRONMENT_REQUESTS
from asyncrl.common.transport.curve import CurveServer
from asyncrl.common.transport.rpc import ReplySocket
from asyncrl.common.wire.seal import Seal

log = get_logger("environment_service")
OPS = ("make", "step", "score", "close")
IDLE_S = 900.0
"""An episode not stepped for this long is forgotten: its actor is gone (an actor's own episode deadline,
``environment.episode_timeout_s``, ends live ones long before)."""
MAX_KEY_CHARS, MAX_ACTION_CHARS, MAX_SAMPLES = 128, 1_000_000, 4096


def serves_environments(config: RunConfig) -> bool:
    """Whether the reward workers of this run serve environments to its actors (``environment.isolation =
    "workers"`` in a multi-turn run)."""
    return config.rollout.workflow == "multi_turn" and config.environment.isolation == "workers"


class BadRequest(ValueError):
    """A request that is not one of :data:`OPS` with the fields it needs."""


def request_fields(request: dict[str, Any]) -> dict[str, Any]:
    """The fields the environment process gets for ``request`` (its ``op`` and ``episode`` aside), checked."""
    op, episode = request.get("op"), request.get("episode")
    if op not in OPS:
        raise BadRequest(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if not isinstance(episode, str) or not 0 < len(episode) <= MAX_KEY_CHARS:
        raise BadRequest(f"episode must be a key of 1-{MAX_KEY_CHARS} characters")
    if op == "make":
        row, needs = request.get("row"), "make needs a row with prompt, answer, extra and seed"
        if not isinstance(row, dict):
            raise BadRequest(needs)
        try:
            EpisodeRow(**row)
        except TypeError:  # a field missing or unknown, or a key that is not a string
            raise BadRequest(needs) from None
        return {"row": row, **episode_identity(request)}
    if op == "step":
        action = request.get("action")
        if not isinstance(action, str) or len(action) > MAX_ACTION_CHARS:
            raise BadRequest(f"step needs an action of at most {MAX_ACTION_CHARS} characters")
        return {"action": action}
    return {}


def episode_identity(request: dict[str, Any]) -> dict[str, Any]:
    """A ``make`` request's ``identity`` field (the episode's ``group_id`` and ``index``), checked; ``{}`` when it has
    none (an actor from before it, where the environment is replayable)."""
    if "identity" not in request:
        return {}
    identity = request["identity"]
    if not (
        isinstance(identity, dict)
        and set(identity) == {"group_id", "index"}
        and isinstance(identity["group_id"], str)
        and 0 < len(identity["group_id"]) <= MAX_KEY_CHARS
        and type(identity["index"]) is int
        and 0 <= identity["index"] < MAX_SAMPLES
    ):
        raise BadRequest(f"make's identity must be a group_id of 1-{MAX_KEY_CHARS} characters and an index")
    return {"identity": identity}


class EnvironmentService:
    """Serves environment requests on a ROUTER socket from a thread of its own (module docstring)."""

    def __init__(
        self,
        section: EnvironmentSection,
        seal: Seal | None,
        host: EnvironmentHost | None = None,
        notary: Notary | None = None,
    ) -> None:
        self.section = section
        self.notary = notary
        """Signs every answer when the environment cannot be replayed; None when it can."""
        refused = ENVIRONMENT_REQUESTS.labels("unsealed", "refused").inc
        self.socket = ReplySocket("environments", seal, on_refused=refused)
        self.host = host or EnvironmentHost(section)
        self.endpoint = ""
        self._replies: queue.SimpleQueue[tuple[bytes, dict[str, Any]]] = queue.SimpleQueue()
        self._last_used: dict[str, float] = {}  # episode key in the environment process -> when last asked
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._threads = [
            threading.Thread(target=self._loop.run_forever, name="environment-service-loop", daemon=True),
            threading.Thread(target=self._serve, name="environment-service", daemon=True),
        ]

    def start(self, endpoint: str, curve: CurveServer | None) -> str:
        """Bind ``endpoint`` (``tcp://host:0`` picks a port) and serve; returns the endpoint bound."""
        self.endpoint = self.socket.bind(endpoint, curve)
        for thread in self._threads:
            thread.start()
        log.info("serving environments", endpoint=self.endpoint, environment=self.section.name)
        return self.endpoint

    def close(self) -> None:
        self._stop.set()
        self._threads[1].join(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._threads[0].join(5)
        self.socket.close()

    @property
    def episodes(self) -> int:
        return len(self._last_used)

    def _serve(self) -> None:
        swept = time.monotonic()
        while not self._stop.is_set():
            if (got := self.socket.recv(timeout_s=0.005)) is not None:
                self._dispatch(*got)
            while True:
                try:
                    client, body = self._replies.get_nowait()
                except queue.Empty:
                    break
                self.socket.reply(client, body)
            if time.monotonic() - swept > 10:
                swept = time.monotonic()
                self._forget_idle(swept)

    def _dispatch(self, client: bytes, request: dict[str, Any]) -> None:
        try:
            fields = request_fields(request)
            if request["op"] == "make" and self.notary is not None and "identity" not in fields:
                raise BadRequest(
                    "make needs the episode's identity (group_id and index): this environment cannot be replayed, "
                    "so what it says is signed for one episode"
                )
        except BadRequest as exc:
            ENVIRONMENT_REQUESTS.labels("invalid", "refused").inc()
            self._replies.put((client, {"id": request["id"], "error": f"refused: {exc}"}))
            return
        op: str = request["op"]  # one of OPS: request_fields checked it
        key = f"{client.hex()}/{request['episode']}"
        if op == "close":
            self._forget(key)
            ENVIRONMENT_REQUESTS.labels(op, "ok").inc()
            return
        self._last_used[key] = time.monotonic()
        future = asyncio.run_coroutine_threadsafe(self._answer(op, key, fields), self._loop)
        future.add_done_callback(self._reply_to(client, request["id"]))

    def _reply_to(self, client: bytes, request_id: int) -> Callable[[Future], None]:
        def done(future: Future) -> None:
            self._replies.put((client, {**future.result(), "id": request_id}))

        return done

    async def _answer(self, op: str, key: str, fields: dict[str, Any]) -> dict[str, Any]:
        identity = fields.pop("identity", None)  # the notary's, never the environment process's
        if op == "make":  # the worker's own environment and options, whatever the request says
            fields = {"name": self.section.name, "options": self.section.options, **fields}
        try:
            answer = await self.host.call_async(op, episode=key, **fields)
            if self.notary is not None:
                answer = self._notarized(op, key, fields, answer, identity)
        except EnvironmentFailed as exc:
            ENVIRONMENT_REQUESTS.labels(op, "failed").inc()
            return {"error": str(exc)}
        except Exception as exc:  # never let one request end the service
            ENVIRONMENT_REQUESTS.labels(op, "failed").inc()
            return {"error": f"{op} failed in the environment worker: {type(exc).__name__}: {exc}"}
        ENVIRONMENT_REQUESTS.labels(op, "ok").inc()
        return answer

    def _notarized(
        self, op: str, key: str, fields: dict[str, Any], answer: dict[str, Any], identity: dict[str, Any] | None
    ) -> dict[str, Any]:
        """``answer`` with what the notary adds: its key and the environment's id (``make``), a signature (``step``,
        ``score``)."""
        assert self.notary is not None
        if op == "make":
            assert identity is not None  # _dispatch refused a make without one
            return {**answer, **self.notary.made(key, identity)}
        if op == "step":
            return self.notary.stepped(key, fields["action"], answer)
        return self.notary.scored(key, answer)

    def _forget(self, key: str) -> None:
        self._last_used.pop(key, None)
        if self.notary is not None:
            self.notary.forget(key)
        self.host.forget("close", episode=key)

    def _forget_idle(self, now: float) -> None:
        for key in [k for k, used in self._last_used.items() if now - used > IDLE_S]:
            self._forget(key)
            log.info("forgot an environment nobody stepped", episode=key, idle_s=IDLE_S)
