"""A run folder is its user's only, whatever the shell's umask: the folder and every folder in it 0700, every file
0600 — config.json, metrics.jsonl, samples.jsonl, audit.jsonl, logs/, checkpoints/, and redis/ with the AOF that a
real redis-server writes. And that server has a memory limit past which writes fail loudly (nothing evicted)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import redis

from asyncrl.common.config import load_config, write_resolved
from asyncrl.common.plane.audit import Audit, flush
from asyncrl.common.plane.audit_file import AuditMirror
from asyncrl.common.plane.keys import RunKeys, connect
from asyncrl.common.plane.redis_server import EmbeddedRedis
from asyncrl.common.plane.replay import ReplayWriter
from asyncrl.common.private import private_umask
from asyncrl.common.wire.messages import ScoredGroup
from asyncrl.learner.checkpoint.history import truncate_metrics
from asyncrl.learner.record.recorder import Recorder, StepRecord
from asyncrl.learner.record.samples import SampleLog
from tests.helpers.rollouts import make_group
from tests.helpers.waits import wait_for

ROOT = Path(__file__).resolve().parents[3]


def mode(path: Path) -> str:
    return oct(stat.S_IMODE(path.stat().st_mode))


@pytest.fixture
def shell_umask() -> Iterator[None]:
    """The usual interactive umask (022: new files world-readable), restored after: the modes must not rely on the
    caller's umask."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture
def run_server(tmp_path: Path, shell_umask) -> Iterator[EmbeddedRedis]:
    """The run's embedded Redis in ``runs/r/redis``, started under umask 022 over a run folder an older run left
    0755 with a 0644 metrics.jsonl; stopped after the test, also on failure."""
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True, mode=0o755)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert mode(run_dir) == "0o755" and mode(run_dir / "metrics.jsonl") == "0o644"
    server = EmbeddedRedis(run_dir / "redis").start()
    try:
        yield server
    finally:
        server.stop()


def test_every_file_of_a_run_is_its_users_only(run_server: EmbeddedRedis, tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    client = connect(run_server.url)
    try:
        client.xadd(RunKeys("r").replay, {"m": b"x" * 1000})  # something in the AOF
        _write_run_files(client, run_dir)
        client.bgrewriteaof()  # the rewritten AOF is a new file, created by a forked redis-server
        wait_for(lambda: _aof_rewritten(client), "end of the AOF rewrite", timeout_s=30)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("maxmemory") == {"maxmemory": str(2048 * 2**20)}  # the config's default
    finally:
        client.close()
    _run_a_child(run_dir / "logs")
    assert (run_dir / "redis" / "appendonly.aof").is_file()
    folders = sorted(p for p in run_dir.rglob("*") if p.is_dir())
    files = sorted(p for p in run_dir.rglob("*") if p.is_file())
    names = {p.relative_to(run_dir).as_posix() for p in files}
    assert {"config.json", "metrics.jsonl", "samples.jsonl", "audit.jsonl", "redis/appendonly.aof"} <= names
    assert {"redis/url", "redis/redis.conf", "redis/redis.log", "redis/server.lock", "logs/writer.log"} <= names
    assert {"metrics.discarded.jsonl", "checkpoints/step-1/model.pt", "logs/written-by-child"} <= names
    wide = {p.relative_to(run_dir).as_posix(): mode(p) for p in [run_dir, *folders] if mode(p) != "0o700"}
    wide |= {p.relative_to(run_dir).as_posix(): mode(p) for p in files if mode(p) != "0o600"}
    assert wide == {}, "readable by others"


def _aof_rewritten(client: redis.Redis) -> bool:
    persistence = client.info("persistence")
    return not (persistence["aof_rewrite_in_progress"] or persistence["aof_rewrite_scheduled"])


def _write_run_files(client: redis.Redis, run_dir: Path) -> None:
    """Write what a learner writes into ``run_dir``, through the code that writes it."""
    Recorder._write(SimpleNamespace(metrics_path=run_dir / "metrics.jsonl"), 2, StepRecord(_step_values()))
    truncate_metrics(run_dir / "metrics.jsonl", 1)  # a resume from step 1: step 2's line set aside
    group = ScoredGroup(rollout=make_group(["19", "18"]), rewards=np.array([1.0, 0.0], np.float32))
    SampleLog(run_dir / "samples.jsonl", every=1, per_step=1, seed=0).write(1, [group], {})
    Audit(client, "r", "learner", "learner").record("run.started", steps=1)
    assert flush(30, client)  # this server's entries (another test's stopped server may still hold some)
    mirror = AuditMirror(client, "r", run_dir / "audit.jsonl")
    assert mirror.pump() == 1
    previous = private_umask()  # what rl-learner's entry point does: files of libraries that know no modes
    try:
        write_resolved(load_config(None, [f"run.root={run_dir.parent}", "run.name=r"]))
        checkpoint = run_dir / "checkpoints" / "step-1"
        checkpoint.mkdir(parents=True)
        (checkpoint / "model.pt").write_bytes(b"weights")  # as DeepSpeed's torch.save writes them
    finally:
        os.umask(previous)


def _step_values() -> dict[str, float]:
    return {"rollout/reward_mean": 0.5, "train/loss": 0.1, "rollout/staleness_max": 0.0, "step/seconds": 1.0}


LAUNCHER = """
import sys
from pathlib import Path
from asyncrl.cli.children import Children

children = Children(Path(sys.argv[1]))
writer = children.start("writer", [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write('x')",
                                   sys.argv[1] + "/written-by-child"])
sys.exit(writer.wait(30))
"""


def _run_a_child(log_dir: Path) -> None:
    """rl-launch's :class:`Children` under umask 022, in a process of its own (it becomes a subreaper)."""
    done = subprocess.run([sys.executable, "-c", LAUNCHER, str(log_dir)], cwd=ROOT, timeout=60, check=False)
    assert done.returncode == 0


def test_past_maxmemory_a_replay_write_fails_loudly_and_names_the_setting(tmp_path: Path, caplog) -> None:
    """noeviction: XADD is refused with Redis's OOM error (nothing of the run is evicted), and the writer says which
    setting to raise."""
    server = EmbeddedRedis(tmp_path / "redis", maxmemory_mb=2).start()
    client = connect(server.url)
    replay_log = logging.getLogger("asyncrl.replay")
    replay_log.addHandler(caplog.handler)  # whether or not the asyncrl loggers propagate
    try:
        client.set("asyncrl:full:manifest", b"kept")
        writer = ReplayWriter(client, RunKeys("full"))
        group = ScoredGroup(rollout=make_group(["19"], lengths=[8_000]), rewards=np.zeros(1, np.float32))
        with pytest.raises(redis.exceptions.OutOfMemoryError) as refused:
            for _ in range(100):  # 100 groups of ~ 100 kB: far past 2 MB
                writer.add([group])
        assert "command not allowed when used memory > 'maxmemory'" in str(refused.value)  # Redis's OOM reply
        [line] = {r.getMessage() for r in caplog.records if r.getMessage().startswith("Redis is full")}  # one line
        assert "transport.redis_maxmemory_mb" in line and "CONFIG SET maxmemory" in line
        assert client.get("asyncrl:full:manifest") == b"kept"  # nothing evicted
    finally:
        replay_log.removeHandler(caplog.handler)
        client.close()
        server.stop()
