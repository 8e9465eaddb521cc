"""A run placed on a real Ray cluster, launched as a user launches it: ``rl-launch ray run.toml --address HEAD:PORT``
on the head node, then grown and shrunk with ``rl-launch ray run.toml --run NAME --actors N``, then stopped with
Ctrl-C.

The cluster is Ray's own ``ray start`` (:class:`tests.helpers.ray_cluster.RayCluster`): a head node and a worker node,
each a host of its own (a network namespace with its own address), sharing this machine's filesystem as a cluster
shares its run folder. With no GPU here, the nodes declare custom resources that the run's ``[ray]`` section asks for:
the head's placement group (Redis, the learner, the reward worker) lands on the head node, the rollout actors on the
worker node, as ``num_gpus`` requests place them on a GPU cluster.

Checked from the run's own records: every step trained once; the first actor placed on the worker node; the added
actor served and left (SIGTERM: its groups given back), and each actor loaded every version sent to it while it was a
member; Ctrl-C ends the launcher with 130 after the learner's checkpoint; no secret (the Redis password, the CURVE
secret keys) in what the launcher printed or anything Ray wrote (its logs, its record of the actors' arguments);
afterwards nothing of the run is left: no process, no Ray actor, no placement group holding resources.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.common.exit_codes import ExitCode
from tests.helpers.ray_cluster import HEAD, RayCluster
from tests.helpers.runs import cluster_run_toml, not_loaded, processes_of, step_rows
from tests.helpers.stack import BIN
from tests.helpers.waits import wait_for

RUN, GROUPS = "onray", 4
STEPS = 100_000
"""More steps than the run ever reaches: it ends by Ctrl-C, so nothing the test waits for races its end."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    made = RayCluster(tmp_path_factory.mktemp("ray-cluster"), workers=1)
    try:
        made.start()
        yield made
    finally:
        made.stop()


def _config(model: Path) -> str:
    more = """
[ray]
actors = 1
head_cpus = 1
actor_cpus = 1
head_resources = {asyncrl_head = 1}
actor_resources = {rollout_node = 1}
"""
    return cluster_run_toml(RUN, model, STEPS, GROUPS, more)


def _secrets(run_dir: Path) -> list[str]:
    """The run's Redis password and the contents of its CURVE secret keys."""
    url = (run_dir / "redis" / "url").read_text().strip()
    password = url.split("://:", 1)[1].split("@", 1)[0]
    return [password, *(p.read_text().strip() for p in (run_dir / "keys").rglob("*secret*") if p.is_file())]


def _files_holding(folder: Path, secrets: list[str]) -> list[str]:
    """The files under ``folder`` that hold one of ``secrets``."""
    wanted = [s.encode() for s in secrets]
    found = []
    for path in folder.rglob("*"):
        try:
            data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        except OSError:
            continue
        found += [str(path) for s in wanted if s in data]
    return found


def test_a_run_on_ray_grows_shrinks_stops_on_ctrl_c_and_leaves_nothing_behind(
    cluster: RayCluster, tmp_path: Path, model_dir: Path
) -> None:
    (tmp_path / "run.toml").write_text(_config(model_dir))
    run_dir = tmp_path / "runs" / RUN
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "DS_ACCELERATOR": "cpu"}
    launch = [BIN / "rl-launch", "ray", "run.toml", "--address", cluster.address]
    said = tmp_path / "launcher.txt"
    with said.open("w") as out:
        launcher = cluster.popen(launch, env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: trained(run_dir) >= 2 or launcher.poll() is not None, "two steps", timeout_s=300)
        assert launcher.poll() is None, said.read_text()[-3000:]
        grow = cluster.command([*launch, "--run", RUN, "--actors", "2"], env=env, cwd=tmp_path)
        assert grow.returncode == 0 and "rollout actor added" in grow.stderr, grow.stderr[-2000:]
        wait_for(lambda: loaded_by(run_dir, "actor-1"), "the added actor's first weights", timeout_s=300)
        left_at = time.time()
        shrink = cluster.command([*launch, "--run", RUN, "--actors", "1"], env=env, cwd=tmp_path)
        assert shrink.returncode == 0 and "rollout actors stopped" in shrink.stderr, shrink.stderr[-2000:]
        wait_for(lambda: left(run_dir, "actor-1"), "the added actor left", timeout_s=120)
        more = trained(run_dir) + 2
        wait_for(lambda: trained(run_dir) >= more, "two steps after it left", timeout_s=300)
        launcher.send_signal(signal.SIGINT)  # Ctrl-C
        assert launcher.wait(timeout=600) == ExitCode.INTERRUPTED, said.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = said.read_text()

    rows = step_rows(run_dir)
    assert [int(r["step"]) for r in rows] == list(range(1, len(rows) + 1))  # each step once
    assert (run_dir / "checkpoints").is_dir() and "stopping the run" in output
    events = audit(run_dir)
    failed = {int(e["version"]) for e in events if e["event"] == "weights.failed"}
    missed = not_loaded(events, failed, {"actor-1": left_at, "actor-0": time.time()})
    assert {"actor-0", "actor-1"} <= set(missed) and not any(missed.values()), missed
    placed = (run_dir / "logs" / "actor-0.log").read_text()
    assert f"rollout actor placed by Ray actor=actor-0 node={cluster.addresses[1]}" in placed  # the worker node

    secrets = _secrets(run_dir)
    assert not [s for s in secrets if s in output]
    assert _files_holding(cluster.temp, secrets) == []  # Ray's session: its logs, its record of every actor's args
    named = cluster.query("ray.util.list_named_actors(all_namespaces=True)")
    assert [a for a in named if a["namespace"] == f"asyncrl-{RUN}"] == []  # every actor of the run ended
    groups = cluster.query("[g['state'] for g in ray.util.placement_group_table().values()]")
    assert set(groups) <= {"REMOVED"}, groups  # the head's resources given back
    assert processes_of(run_dir) == []
    assert HEAD in (run_dir / "redis" / "url").read_text()  # Redis bound to the head node's own address


def audit(run_dir: Path) -> list[dict]:
    """The run's audit trail so far (a line being written is left out)."""
    path = run_dir / "audit.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def trained(run_dir: Path) -> int:
    return len(step_rows(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0


def loaded_by(run_dir: Path, actor: str) -> bool:
    return any(e["event"] == "weights.loaded" and e["who"]["process"] == actor for e in audit(run_dir))


def left(run_dir: Path, actor: str) -> bool:
    return any(e["event"] == "process.left" and e["who"]["process"] == actor for e in audit(run_dir))
