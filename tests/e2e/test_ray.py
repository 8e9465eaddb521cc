"""A run placed on a real Ray cluster, launched as a user launches it: ``rl-launch ray run.toml --address HEAD:PORT``
on the head node.

The cluster is Ray's own ``ray start`` (:class:`tests.helpers.ray_cluster.RayCluster`): a head node and a worker node,
each a host of its own (a network namespace with its own address), sharing this machine's filesystem as a cluster
shares its run folder. With no GPU here, the nodes declare custom resources that the run's ``[ray]`` section asks for:
the head's placement group (Redis, the learner, the reward worker) lands on the head node, the rollout actor on the
worker node, as ``num_gpus`` requests place them on a GPU cluster.

Checked from the run's own records: the launcher exits 0 when the run ends, with every step trained once; the actor
ran on the worker node and loaded every version sent to it; no secret (the Redis password, the CURVE secret keys) in
what the launcher printed or anything Ray wrote (its logs, its record of the actors' arguments); afterwards nothing of
the run is left: no process, no Ray actor, no placement group holding resources.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.ray_cluster import HEAD, RayCluster
from tests.helpers.runs import processes_of, step_rows
from tests.helpers.stack import BIN

pytestmark = pytest.mark.e2e

RUN, STEPS, GROUPS = "onray", 6, 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    made = RayCluster(tmp_path_factory.mktemp("ray-cluster"), workers=1)
    try:
        made.start()
        yield made
    finally:
        made.stop()


def _config(model: Path) -> str:
    return f"""preset = "demo"

[run]
name = "{RUN}"

[model]
path = "{model}"

[learner]
steps = {STEPS}
groups_per_step = {GROUPS}

[eval]
every = 0

[rollout]
kv_cache_bytes = 67108864
cpu_single_process = true

[ray]
actors = 1
head_cpus = 1
actor_cpus = 1
head_resources = {{asyncrl_head = 1}}
actor_resources = {{rollout_node = 1}}
"""


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


def test_a_run_placed_on_a_ray_cluster_trains_and_leaves_nothing_behind(
    cluster: RayCluster, tmp_path: Path, model_dir: Path
) -> None:
    (tmp_path / "run.toml").write_text(_config(model_dir))
    run_dir = tmp_path / "runs" / RUN
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "DS_ACCELERATOR": "cpu"}
    command = [BIN / "rl-launch", "ray", "run.toml", "--address", cluster.address]
    done = cluster.command(command, env=env, cwd=tmp_path, timeout=900)
    head_log = run_dir / "logs" / "ray-head.log"
    assert done.returncode == 0, (done.stderr[-3000:], head_log.read_text()[-3000:] if head_log.exists() else "")

    rows = step_rows(run_dir)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    events = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    loaded = {int(e["version"]) for e in events if e["event"] == "weights.loaded" and e["who"]["process"] == "actor-0"}
    published = {int(e["version"]) for e in events if e["event"] == "weights.published" and "actor-0" in e["members"]}
    assert published and published <= loaded, (published, loaded)
    placed = (run_dir / "logs" / "actor-0.log").read_text()
    assert f"rollout actor placed by Ray actor=actor-0 node={cluster.addresses[1]}" in placed  # the worker node

    secrets = _secrets(run_dir)
    assert not [s for s in secrets if s in done.stdout + done.stderr]
    assert _files_holding(cluster.temp, secrets) == []  # Ray's session: its logs, its record of every actor's args
    named = cluster.query("ray.util.list_named_actors(all_namespaces=True)")
    assert [a for a in named if a["namespace"] == f"asyncrl-{RUN}"] == []  # every actor of the run ended
    groups = cluster.query("[g['state'] for g in ray.util.placement_group_table().values()]")
    assert set(groups) <= {"REMOVED"}, groups  # the head's resources given back
    assert processes_of(run_dir) == []
    assert HEAD in (run_dir / "redis" / "url").read_text()  # Redis bound to the head node's own address
