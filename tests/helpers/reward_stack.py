"""A reward worker under test: a run config published as the learner would, ``rl-actor reward`` started as a
process and waited for (:func:`reward_worker`), its heartbeat, what it wrote to the replay stream, and its stop.
Shared by the integration tests of the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncrl.common.config import load_config
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import RunKeys
from asyncrl.common.plane.replay import ReplayEntry, ReplayReader
from asyncrl.common.wire.messages import Heartbeat
from tests.helpers import waits
from tests.helpers.rollouts import tokenizer_dir
from tests.helpers.stack import BIN, ROOT


def publish(redis_client, run: str, *overrides: str) -> None:
    """Publish a run config as the learner would (fast heartbeats, so the tests wait less)."""
    fast = ["transport.heartbeat_s=0.2", "transport.heartbeat_ttl_s=5", f"model.path={tokenizer_dir()}"]
    config = load_config(None, [f"run.name={run}", *fast, *overrides])
    ControlPlane(redis_client, run).run.publish_config(config)


def start(url: str, run: str, worker_id: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the worker imports tests.helpers reward functions by path
    with log.open("w") as out:
        return subprocess.Popen(
            [str(BIN / "rl-actor"), "reward", "--redis", url, "--run", run, "--id", worker_id],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )


@contextmanager
def reward_worker(redis_server, redis_client, tmp_path: Path, run: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """A worker process and its advertised endpoint, once its heartbeat says ``ready``; always ended."""
    log = tmp_path / f"{run}.log"
    proc = start(redis_server.url, run, "rw-1", log)
    try:
        beat = wait_ready(redis_client, run, "rw-1", proc, log)
        assert beat.kind == "reward" and beat.pid == proc.pid and beat.endpoint.startswith("tcp://127.0.0.1:")
        yield proc, beat.endpoint
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def heartbeat(redis_client, run: str, worker_id: str, state: str | None = None) -> Heartbeat | None:
    live, _lost = ControlPlane(redis_client, run).registry.processes()
    found = [b for b in live if b.process_id == worker_id and (state is None or b.state == state)]
    return found[0] if found else None


START_TIMEOUT_S = 180
"""How long a worker may take to say it is ready, or to exit: a wait for it, never a claim about its speed."""


def wait_ready(redis_client, run: str, worker_id: str, proc: subprocess.Popen, log: Path) -> Heartbeat:
    """The worker's first ``ready`` heartbeat. Beside the serial chain a worker starts niced on two busy cores: its
    imports alone took over 60 s there, so this waits :data:`START_TIMEOUT_S` (or until the process exits)."""
    ready = lambda: heartbeat(redis_client, run, worker_id, state="ready")  # noqa: E731
    return wait_for(ready, proc, log, "a ready heartbeat", timeout_s=START_TIMEOUT_S)


def wait_for(probe, proc: subprocess.Popen, log: Path, what: str, timeout_s: float = 60):
    """:func:`tests.helpers.waits.wait_for` on a worker process, failing with its log (the argument order of the
    callers in test_reward_worker and test_garbage_flood)."""
    return waits.wait_for(probe, what, proc=proc, log=log, timeout_s=timeout_s)


def read_replay(redis_client, run: str, count: int, timeout_s: float = 30) -> list[ReplayEntry]:
    reader = ReplayReader(redis_client, RunKeys(run), consumer="test")
    entries: list[ReplayEntry] = []
    deadline = time.monotonic() + timeout_s
    while len(entries) < count and time.monotonic() < deadline:
        entries += reader.read(count=count - len(entries), block_ms=200)
    return entries


def stop(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM, then the exit status must be 0 (waited for up to :data:`START_TIMEOUT_S`: a worker niced beside the
    serial chain once took over 20 s to exit; how fast it leaves is not what the callers check)."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(START_TIMEOUT_S) == 0, log.read_text()
