"""Environments in a process of their own, so that one that crashes, hangs or eats memory never takes down the
process that drives it (a rollout actor and its engine, or a reward worker).

:class:`EnvironmentHost` starts ``python -m asyncrl.actors.environments.host`` (``subprocess``: safe from the threaded
actor, unlike ``fork``) and speaks JSON lines with it over its stdin and stdout: ``make`` an environment for an episode,
``step`` it, ``score`` it, ``close`` it. The child answers each request from a thread of its own, so a slow step does
not hold up the other episodes' steps; it limits its address space to ``environment.max_memory_mb``, so a greedy
environment fails with ``MemoryError`` instead of swapping the machine. The parent gives every request a time limit
(``environment.step_timeout_s``), which starts once the child has said it is ready (its own start-up has
:data:`START_TIMEOUT_S`); a request that fails, times out, or meets a child that died raises
:class:`~asyncrl.common.environments.protocol.EnvironmentFailed`, which ends that episode. A dead child is replaced at
the next ``make``; a child with :data:`MAX_STUCK` steps still running past their limit is killed and replaced (the
episodes it held end as errors).

The child runs behind the strongest fence this machine allows (``environment.fence``;
:mod:`~asyncrl.actors.environments.fence` says what each one stops): its own PID, mount and IPC namespaces, a read-only
filesystem but its scratch, no capability, and a uid of its own when the actor is root, so environment code cannot
signal, trace or write into the process it serves; a hostile ``step`` ends only its own child, which is replaced as
one that crashed.

:class:`HostedEnvironment` is what the episode loop sees: the :class:`~asyncrl.common.environments.protocol.Environment`
protocol, async, backed by the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import operator
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asyncrl.actors.environments import fence as environment_fence
from asyncrl.common.config import EnvironmentSection
from asyncrl.common.environments.protocol import (
    EnvironmentFailed,
    EnvironmentLost,
    EpisodeRow,
    Step,
    checked_score,
    checked_step,
    make_environment,
    recorded_as_given,
)
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.observability.metrics import ACTOR_ENVIRONMENT_MOVES
from asyncrl.common.wire.attestation import AttestedStep, EpisodeAttestation

log = get_logger("environment_host")
MAX_STUCK = 8
"""Steps past their time limit a child may still be running before it is replaced."""
START_TIMEOUT_S = 60.0
"""How long a new child may take to start (a Python interpreter and asyncrl's imports, on a loaded machine) before it
counts as failed. Not part of any request's ``environment.step_timeout_s``: that limit is the environment's own time."""
READY = environment_fence.READY
"""The child's first line: it has started and imported what it needs, and takes requests from now on."""


@dataclasses.dataclass
class _Child:
    """One child process and the requests it holds: answers are matched to requests of this child only."""

    proc: subprocess.Popen
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set when the child says it is ready to take requests, or when it is gone."""
    pending: dict[int, Future] = dataclasses.field(default_factory=dict)
    late: set[int] = dataclasses.field(default_factory=set)
    """Requests given up on (past their limit) that the child has not answered yet: steps stuck in it."""
    write_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class EnvironmentHost:
    """One child process holding the environments of many episodes (module docstring)."""

    def __init__(self, section: EnvironmentSection) -> None:
        self.section = section
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._ids = itertools.count(1)
        self._started = 0
        # Requests are written off the event loop: a child that stops reading (frozen, or holding its GIL) fills the
        # pipe, and a blocked write must cost its request's time limit, not the loop that drives every episode.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="environment-writer")

    @property
    def restarts(self) -> int:
        """Processes started to replace one that died or was killed."""
        return max(0, self._started - 1)

    def start(self) -> None:
        """Start the child now and return once it takes requests (:class:`EnvironmentFailed` when it cannot): a reward
        worker serving environments pays for the start before it advertises them, so an actor's first request to it
        (an episode moved there from a worker that died, say) is not charged the start within its time limit."""
        self._writer.submit(self._ensure_child).result()  # on the writer thread: see _start_child

    # -- the child
    def _ensure_child(self) -> _Child:
        """The running child, started first if there is none (or it died), once it is ready for requests."""
        with self._lock:
            if self._child is None or self._child.proc.poll() is not None:
                self._child = self._start_child()
            child = self._child
        if not child.ready.wait(START_TIMEOUT_S) or child.proc.poll() is not None:
            self._kill(child)
            exit_code = child.proc.wait()
            raise EnvironmentFailed(
                f"the environment process did not start within {START_TIMEOUT_S:g} s (exit {exit_code})"
            )
        return child

    def _start_child(self) -> _Child:
        self._started += 1
        if self.restarts:  # one that died, or that this host killed (stuck, or not reading)
            exit_code = self._child.proc.returncode if self._child is not None else "killed"
            log.warning("environment host replaced", exit_code=exit_code, restarts=self.restarts)
        try:
            fence = environment_fence.host_fence(self.section.fence)
        except RuntimeError as exc:  # offline asked for where no namespace may be made
            raise EnvironmentFailed(str(exc)) from None
        # On the writer thread, which lives as long as this host: the launcher's parent-death signal follows it.
        child = _Child(environment_fence.launch(fence, self.section.max_memory_mb))
        threading.Thread(target=self._read, args=(child,), name="environment-host-reader", daemon=True).start()
        return child

    @staticmethod
    def _read(child: _Child) -> None:
        assert child.proc.stdout is not None
        for line in child.proc.stdout:
            try:
                answer = json.loads(line)
                if answer == READY:
                    child.ready.set()
                    continue
                request_id = int(answer["id"])
            except (ValueError, TypeError, KeyError):
                continue  # not an answer (the child keeps its answers on a descriptor of their own; be sure)
            child.late.discard(request_id)
            future = child.pending.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(answer)
        died = EnvironmentFailed(f"the environment process died (exit {child.proc.wait()})")
        child.ready.set()  # whoever waits for it to start learns it is gone
        for request_id in list(child.pending):  # the child is gone: every request it held fails
            future = child.pending.pop(request_id, None)
            if future is not None and not future.done():
                future.set_exception(died)

    def _kill(self, child: _Child | None = None) -> None:
        with self._lock:
            if child is None or child is self._child:
                child, self._child = self._child, None
        if child is not None and child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # its session: the launcher and the child
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.kill()
            child.proc.wait()

    def close(self) -> None:
        self._kill()

    # -- requests
    def _send(self, op: str, **fields: Any) -> tuple[_Child, int, Future]:
        child = self._ensure_child()
        request_id = next(self._ids)
        future: Future = Future()
        child.pending[request_id] = future
        try:
            assert child.proc.stdin is not None
            with child.write_lock:
                child.proc.stdin.write(json.dumps({"id": request_id, "op": op, **fields}) + "\n")
                child.proc.stdin.flush()
        except (BrokenPipeError, OSError, TypeError, ValueError) as exc:
            child.pending.pop(request_id, None)
            future.set_exception(EnvironmentFailed(f"could not reach the environment process: {exc}"))
        return child, request_id, future

    def forget(self, op: str, **fields: Any) -> None:
        """A request nobody waits for (``close``), written in the background."""

        def send() -> None:
            child = self._child
            if child is None or child.proc.poll() is not None:
                return  # the environments it would close died with their process: starting one to close them is waste
            child, request_id, _ = self._send(op, **fields)
            child.pending.pop(request_id, None)

        self._writer.submit(send)

    @staticmethod
    def _answer(answer: dict[str, Any]) -> dict[str, Any]:
        if "error" in answer:
            raise EnvironmentFailed(str(answer["error"]))
        return answer

    async def _in_writer(self, work: Any, limit_s: float, op: str) -> Any:
        """``work()`` on the writer thread within ``limit_s``: past it the child is not reading (its pipe is full), so
        it is killed, which ends the blocked write."""
        try:
            return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._writer, work), limit_s)
        except TimeoutError:
            log.warning("environment process took no request within its time limit; replacing it", op=op)
            self._kill()
            raise EnvironmentFailed(f"{op}: the environment process took no request for {limit_s:g} s") from None

    async def call_async(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request, awaited within ``environment.step_timeout_s``. A request given up on is counted as stuck in
        the child until it answers; at :data:`MAX_STUCK` the child is replaced."""
        timeout_s = self.section.step_timeout_s
        loop = asyncio.get_running_loop()
        # A child that must start first has START_TIMEOUT_S for it; the request's own limit starts once it is ready.
        await self._in_writer(self._ensure_child, START_TIMEOUT_S + timeout_s, op)
        deadline = loop.time() + timeout_s
        child, request_id, future = await self._in_writer(functools.partial(self._send, op, **fields), timeout_s, op)
        try:
            return self._answer(await asyncio.wait_for(asyncio.wrap_future(future), deadline - loop.time()))
        except TimeoutError:
            child.late.add(request_id)
            if len(child.late) == MAX_STUCK:  # once per child: the requests that time out after it are its own
                log.warning("environment process has too many stuck steps; replacing it", stuck=len(child.late))
                self._kill(child)
            raise EnvironmentFailed(f"{op} took longer than environment.step_timeout_s = {timeout_s:g}") from None
        finally:
            child.pending.pop(request_id, None)


class HostedEnvironment:
    """An episode's environment in an :class:`EnvironmentHost` (or on reward workers:
    :class:`~asyncrl.actors.environments.remote.RemoteEnvironments`); made with :meth:`open`, every call awaited.

    It keeps the episode's steps so far. When the worker holding it is lost
    (:class:`~asyncrl.common.environments.protocol.EnvironmentLost`), it is made again from the same row on another
    worker, its steps are replayed there, and the request is sent again, up to :data:`MAX_MOVES` times. Environments are
    deterministic given their row and seed (the reward worker's replay relies on it as well); one whose replayed steps
    differ from the first ones fails its episode.

    An environment that cannot be replayed is one whose worker signs its answers (its ``make`` answer names the
    signer): it keeps each signed answer (:attr:`attestation`, which the episode carries to be scored) and never moves,
    since no other worker could vouch for the steps it took; losing its worker fails the episode at once."""

    _keys = itertools.count(1)

    def __init__(self, host: Any, key: str, fields: dict[str, Any], made: dict[str, Any] | None = None) -> None:
        self.host, self.key = host, key
        self._make_fields = fields
        self._steps: list[tuple[str, dict[str, Any]]] = []  # (action, what the step answered)
        made = made or {}
        signer, episode = str(made.get("signer", "")), str(made.get("episode", ""))
        self.attestation = EpisodeAttestation(signer, episode) if signer else None
        """What the worker signed so far; None for an environment whose worker signs nothing (a replayable one)."""

    @classmethod
    async def open(cls, host: Any, row: EpisodeRow, identity: dict[str, Any] | None = None) -> HostedEnvironment:
        """The environment of ``row`` made in ``host``; ``identity`` (``group_id``, ``index``) says which episode it is
        for, which a worker signs with what an environment that cannot be replayed says."""
        key = f"e{next(cls._keys)}"
        fields = {"name": host.section.name, "options": host.section.options, "row": dataclasses.asdict(row)}
        if identity is not None:
            fields["identity"] = identity
        made = await host.call_async("make", episode=key, **fields)
        return cls(host, key, fields, made)

    async def step(self, action: str) -> Step:
        answered = await self._call("step", action=action)
        answer = _step_fields(answered)
        self._steps.append((action, answer))
        if self.attestation is not None:
            signed = AttestedStep(answer["observation"], answer["reward"], answer["done"], _signature(answered))
            self.attestation = dataclasses.replace(self.attestation, steps=(*self.attestation.steps, signed))
        return Step(**answer)

    async def score(self) -> float:
        answered = await self._call("score")
        score = float(answered["score"])
        if self.attestation is not None:
            self.attestation = dataclasses.replace(self.attestation, score=score, score_signature=_signature(answered))
        return score

    def close(self) -> None:
        """Forget the environment in the child (nothing waits for the answer)."""
        self.host.forget("close", episode=self.key)

    async def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        for moves in itertools.count():
            try:
                return await self.host.call_async(op, episode=self.key, **fields)
            except EnvironmentLost as exc:
                if self.attestation is not None:
                    raise EnvironmentFailed(
                        f"{exc}; this environment cannot be replayed, so its episode cannot move to another worker"
                    ) from exc
                if moves >= MAX_MOVES:
                    raise
                log.warning("environment lost with its worker; making it again elsewhere", episode=self.key, error=exc)
                await self._make_again()
        raise AssertionError("unreachable")

    async def _make_again(self) -> None:
        """Make the environment again (on another worker) and replay the steps it took: each must answer as before."""
        await self.host.call_async("make", episode=self.key, **self._make_fields)
        for action, answered in self._steps:
            again = Step(**_step_fields(await self.host.call_async("step", episode=self.key, action=action)))
            same = (again.done, again.reward) == (answered["done"], answered["reward"])
            if not same or not recorded_as_given(again, functools.partial(operator.eq, answered["observation"])):
                raise EnvironmentFailed(
                    "the environment made again on another worker answered a replayed step differently: it is not "
                    "deterministic given its row and seed, so its episode cannot move"
                )
        ACTOR_ENVIRONMENT_MOVES.inc()


MAX_MOVES = 2
"""Times an episode's environment may move to another worker before the episode ends as an environment error."""


def _signature(answer: dict[str, Any]) -> str:
    """The signature a worker put on ``answer``; :class:`EnvironmentFailed` when it put none."""
    signature = answer.get("signature")
    if not isinstance(signature, str):
        raise EnvironmentFailed("the reward worker signed this environment's make but not this answer")
    return signature


def _step_fields(answer: dict[str, Any]) -> dict[str, Any]:
    """A :class:`Step`'s fields from an answer (a worker that predates the time-limit fields sends none)."""
    fields = {"observation": answer["observation"], "reward": answer["reward"], "done": answer["done"]}
    return {**fields, "timed_out": answer.get("timed_out", False), "if_timed_out": answer.get("if_timed_out", [])}


# --------------------------------------------------------------------------- the child


def _serve() -> None:
    """The child's loop: one thread per request, answers written whole under a lock."""
    import resource

    if plan := os.environ.get(environment_fence.PLAN_VARIABLE):  # first of all: no environment code has run yet
        environment_fence.enter(json.loads(plan))
    limit_mb = int(os.environ.get("ASYNCRL_ENV_MEMORY_MB", "0"))
    if limit_mb:
        resource.setrlimit(resource.RLIMIT_AS, (limit_mb * 2**20, limit_mb * 2**20))
    # Answers go out on a descriptor of their own; descriptor 1 (where environments, their libraries and their
    # subprocesses print) becomes stderr, so nothing they print can enter the answers.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    environments: dict[str, Any] = {}
    write_lock = threading.Lock()

    def answer(request_id: int, **fields: Any) -> None:
        line = json.dumps({"id": request_id, **fields}) + "\n"
        with write_lock:
            out.write(line)
            out.flush()

    def handle(request: dict[str, Any]) -> None:
        request_id = request.get("id", 0)
        try:
            answer(request_id, **_handle(environments, request))
        except BaseException as exc:  # MemoryError included: the episode fails, the child goes on
            answer(request_id, error=f"{request.get('op')} raised {type(exc).__name__}: {exc}"[:2000])

    pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="environment")
    out.write(json.dumps(READY) + "\n")
    out.flush()
    for line in sys.stdin:
        pool.submit(handle, json.loads(line))
    os._exit(0)  # the parent is gone (stdin closed): end now, whatever steps still hang


def _handle(environments: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    op, key = request["op"], request["episode"]
    if op == "make":
        environments[key] = make_environment(request["name"], request["options"], EpisodeRow(**request["row"]))
        return {}
    if op == "close":
        environments.pop(key, None)
        return {}
    env = environments[key]
    if op == "score":
        return {"score": checked_score(env.score())}
    result = env.step(request["action"])
    if asyncio.iscoroutine(result):
        result = asyncio.run(result)
    step = checked_step(result)
    return {**_step_fields(dataclasses.asdict(step)), "reward": float(step.reward)}


if __name__ == "__main__":
    _serve()
