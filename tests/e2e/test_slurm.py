"""A run on a real Slurm cluster, submitted as a user submits it: ``rl-launch slurm run.toml --nodes 2`` on the login
node, and ``rl-launch slurm run.toml --add-actors 1`` beside it.

The cluster is Debian's ``slurmctld``, ``slurmd`` and ``munged`` (:class:`tests.helpers.slurm_cluster.SlurmCluster`):
a controller and three nodes, each a host of its own (network, hostname), sharing this machine's filesystem as a
cluster shares its run folder. The run's job puts Redis, the learner and a reward worker on ``node1`` and a rollout
actor step on ``node2``; the added actors' job one actor on ``node3``. Once that actor has loaded weights and two
steps are trained, ``node3`` dies (its ``slurmd`` and every process on it killed at once, as when a host loses power):
its actor is counted gone when its heartbeat runs out, its groups are given out again, and the run goes on with the
run's own actor; its user cancels the dead node's job (``scancel JOB``) and the node comes back. Then the run's own
actor step is cancelled (``scancel JOB.STEP``, which kills the step's tasks: it is counted lost, its groups are given
out again) and the run's job gets what Slurm sends before its time limit
(``--signal=B:USR1``, sent here with ``scancel --signal=USR1 --batch``): the learner saves a checkpoint, every step
stops and the job requeues itself; started again, it resumes from that checkpoint and runs to the end
(``learner.steps``, raised in run.toml before the signal, as a user extends a run: the requeued job reads its config
file again). Three engine starts in all, the least that shows each of these.

Checked from the run's own records: the job ends COMPLETED (exit 0, as ``sacct`` shows it) after one restart; every
step trained once and every group accounted for (the run's Redis, opened again on its AOF); every actor loaded every
version sent to it; no secret in the scripts, ``scontrol show job``, ``sacct``, the job's output or any process's
argv; nothing of the run left running.
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.redis_server import EmbeddedRedis, find_redis_server
from tests.helpers.accounting import account_groups
from tests.helpers.runs import cluster_run_toml, not_loaded, processes_of, step_rows
from tests.helpers.slurm_cluster import SlurmCluster, missing_programs
from tests.helpers.stack import BIN
from tests.helpers.waits import wait_for

RUN, GROUPS = "slurm", 4
STEPS = 100_000
"""``learner.steps`` of the first start: more than it ever reaches, so nothing the test waits for races the run's end.
Before the requeue the test lowers it in run.toml (a requeued job reads its config file again) to a few steps past
where the run is: the second start ends the run there."""
MORE_STEPS = 12
"""Steps the second start trains at most."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if missing := missing_programs():
        pytest.fail(f"Slurm is not installed ({', '.join(missing)} missing): bin/setup installs slurm-wlm and munge")
    local = {"node3": tmp_path_factory.mktemp("node3-local")}  # a folder node3 does not share with the others
    made = SlurmCluster(tmp_path_factory.mktemp("slurm-cluster"), nodes=3, local=local)
    try:
        made.start()
        yield made
    finally:
        made.stop()


def _config(model: Path, steps: int) -> str:
    more = """
[weight_sync]
timeout_s = 10  # an actor that leaves mid-transfer holds a sync this long
"""
    return cluster_run_toml(RUN, model, steps, GROUPS, more)


class Job:
    """The submitted job, read through the cluster's commands."""

    def __init__(self, cluster: SlurmCluster, folder: Path) -> None:
        self.cluster, self.folder = cluster, folder
        self.run_dir = folder / "runs" / RUN
        self.env = {**cluster.env, "PATH": f"{BIN}:{Path(find_redis_server()).parent}:{os.environ['PATH']}"}
        self.env["DS_ACCELERATOR"] = "cpu"
        self.id = ""

    def submit(self, *args: str) -> tuple[str, str]:
        """``rl-launch slurm run.toml ARGS`` on the login node: the job id and what the command said."""
        command = [BIN / "rl-launch", "slurm", "run.toml", *args]
        done = self.cluster.command(command, env=self.env, cwd=self.folder, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip(), done.stderr

    def state(self) -> dict[str, str]:
        return self.cluster.job_state(self.id)

    def steps_named(self) -> dict[str, str]:
        """The job's running steps: name -> step id."""
        done = self.cluster.command(["squeue", "--steps", f"--jobs={self.id}", "--noheader", "--format=%i %j"])
        return {name: step for step, name in (line.split() for line in done.stdout.splitlines())}

    def events(self) -> list[dict]:
        """The run's audit trail so far (a line being written is left out)."""
        audit = self.run_dir / "audit.jsonl"
        lines = audit.read_text().splitlines() if audit.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def trained(self) -> int:
        return len(step_rows(self.run_dir)) if (self.run_dir / "metrics.jsonl").exists() else 0

    def finished(self) -> str | None:
        state = self.state().get("JobState")
        return state if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else None


def _secrets(run_dir: Path) -> list[str]:
    """The run's Redis password and the contents of its CURVE secret keys."""
    url = (run_dir / "redis" / "url").read_text().strip()
    password = url.split("://:", 1)[1].split("@", 1)[0]
    keys = [p.read_text().strip() for p in (run_dir / "keys").rglob("*secret*") if p.is_file()]
    return [password, *keys]


def _argv_holding(secrets: list[str]) -> list[str]:
    """Every process on this machine whose command line holds one of ``secrets``."""
    shown = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes()
        except OSError:
            continue
        shown += [f"{cmdline.parent.name}: {argv[:200]!r}" for s in secrets if s.encode() in argv]
    return shown


def lost(job: Job, actor: str, since: float) -> float:
    """When the run counted ``actor`` gone (its heartbeat ran out) after ``since``; 0 while it has not."""
    found = [e["unix"] for e in job.events() if e["event"] == "process.lost" and e["process"] == actor]
    return next((unix for unix in found if unix >= since), 0.0)


def test_a_run_submitted_to_slurm_survives_a_dead_node_a_cancelled_step_and_a_requeue(
    cluster: SlurmCluster, tmp_path: Path, model_dir: Path
) -> None:
    (tmp_path / "run.toml").write_text(_config(model_dir, STEPS))
    job = Job(cluster, tmp_path)
    job.id, said = job.submit("--nodes", "2")
    assert f"submitted job {job.id} for run '{RUN}'" in said
    wait_for(lambda: (job.run_dir / "redis" / "url").exists(), "the run's Redis", timeout_s=300, poll_s=0.5)
    added, said = job.submit("--add-actors", "1")  # node3: the one node the run's job left free
    assert f"submitted job {added} of actors for run '{RUN}'" in said
    added_actor = f"actor-{added}-0"
    script = (job.run_dir / "slurm-job.sh").read_text() + (job.run_dir / "slurm-actors.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --signal=B:USR1@300" in script and "--requeue" in script

    def loaded_by(actor: str) -> bool:
        return any(e["event"] == "weights.loaded" and e["who"]["process"] == actor for e in job.events())

    ready = "two steps trained, the added actor served"
    wait_for(lambda: (job.trained() >= 2 and loaded_by(added_actor)) or job.finished(), ready, timeout_s=400)
    assert not job.finished(), (job.state(), (job.run_dir / "logs" / f"slurm-{job.id}.out").read_text()[-3000:])
    secrets = _secrets(job.run_dir)
    assert _argv_holding(secrets) == []
    top = [BIN / "rl-top", "--once", "--run", RUN, "--redis-url-file", job.run_dir / "redis" / "url"]
    shown = cluster.command(top, env=job.env, timeout=120)  # from the login node, as the submit said
    table = shown.stdout.split("\nprocess ", 1)[-1]
    assert shown.returncode == 0 and {"actor-0", added_actor} <= set(table.split()), shown.stdout[-2000:]
    died_at = time.time()
    stopped = {added_actor: died_at}  # each may die between receiving a version and loading it
    cluster.power_off("node3")  # the added actor's node dies: its slurmd, its steps, its actor and engine
    wait_for(lambda: lost(job, added_actor, died_at), "the dead node's actor counted gone", timeout_s=120)
    trained_before = job.trained()
    wait_for(lambda: job.trained() > trained_before or job.finished(), "a step after node3 died", timeout_s=120)
    assert cluster.command(["scancel", added]).returncode == 0  # its user gives up the job of the dead node
    cluster.power_on("node3")  # and the node comes back
    steps = job.steps_named()
    assert "actor-0" in steps, steps
    cancelled_at = stopped["actor-0"] = time.time()
    assert cluster.command(["scancel", steps["actor-0"]]).returncode == 0  # SIGKILL, Slurm's default for a step
    wait_for(lambda: "actor-0" not in job.steps_named(), "actor-0's step ended", timeout_s=120, poll_s=0.5)
    wait_for(lambda: lost(job, "actor-0", cancelled_at - 1), "actor-0 counted gone", timeout_s=120)
    final = job.trained() + MORE_STEPS
    (tmp_path / "run.toml").write_text(_config(model_dir, final))  # what the requeued job trains to
    assert cluster.command(["scancel", "--signal=USR1", "--batch", job.id]).returncode == 0  # the time limit nears

    wait_for(lambda: int(job.state().get("Restarts", 0)) >= 1 or job.finished(), "the job requeued", timeout_s=240)
    state = wait_for(job.finished, "the requeued job's end", timeout_s=600, poll_s=2)
    output = (job.run_dir / "logs" / f"slurm-{job.id}.out").read_text()
    assert (state, job.state()["ExitCode"], job.state()["Restarts"]) == ("COMPLETED", "0:0", "1"), output[-3000:]
    accounted = cluster.accounting(job.id)  # sacct: a row for the end that requeued it, then the last
    assert accounted[-1] == {"JobID": job.id, "JobName": f"asyncrl-{RUN}", "State": "COMPLETED", "ExitCode": "0:0",
                             "NodeList": "node[1-2]"}, accounted  # fmt: skip

    rows = step_rows(job.run_dir)
    counts = collections.Counter(int(r["step"]) for r in rows)
    assert sorted(counts) == list(range(1, final + 1)) and set(counts.values()) == {1}, counts  # each step once
    events = job.events()
    [resumed] = [e["unix"] for e in events if e["event"] == "run.resumed"]
    gone = [e["unix"] for e in events if e["event"] == "process.lost" and e["process"] == "actor-0"]
    assert [t for t in gone if cancelled_at - 1 <= t < resumed], gone  # its heartbeat ran out after the kill
    failed = {int(r["sync/version"]) for r in rows if r.get("sync/failed") and "sync/version" in r}
    failed |= {int(e["version"]) for e in events if e["event"] == "weights.failed"}  # a stop may beat its row
    missed = not_loaded(events, failed, stopped)
    assert set(missed) == {"actor-0", added_actor} and not any(missed.values()), missed
    assert lost(job, added_actor, died_at) < resumed  # counted gone when its heartbeat ran out, long before the end
    assert cluster.job_state(added)["JobState"] in ("CANCELLED", "NODE_FAIL")
    assert {e["who"]["host"] for e in events if e["event"] == "weights.loaded"} == {"node2", "node3"}

    shown_job = cluster.command(["scontrol", "show", "job", "-d", job.id]).stdout
    for holder in (script, shown_job, str(accounted), output):
        assert not [s for s in secrets if s in holder]
    assert job.steps_named() == {} and processes_of(job.run_dir) == []
    with EmbeddedRedis(job.run_dir / "redis") as redis:  # the run's Redis again, on its AOF: the ledger
        account_groups(ControlPlane(connect(redis.url), RUN), final, GROUPS)


def test_a_run_folder_a_node_does_not_share_fails_the_job_naming_it(cluster: SlurmCluster, model_dir: Path) -> None:
    """``run.root`` in a folder node3 does not share (its own disk there): the job starts the run's Redis on node1,
    finds the run folder missing on node3 with one ``srun``, says so in one line naming the node and the fix, and ends
    FAILED with exit 2 before any learner, reward worker or actor starts; nothing of the run is left running."""
    folder = cluster.local["node3"]
    config = _config(model_dir, 2) + '\n[slurm]\nsbatch = ["--nodelist=node1,node3"]\n'
    (folder / "run.toml").write_text(config)
    job = Job(cluster, folder)
    job.id, _ = job.submit("--nodes", "2")
    assert wait_for(job.finished, "the job's end", timeout_s=300, poll_s=0.5) == "FAILED"
    assert job.state()["ExitCode"] == "2:0", job.state()
    logs = job.run_dir / "logs"
    said = [line for line in (logs / f"slurm-{job.id}.out").read_text().splitlines() if "every node shares" in line]
    assert len(said) == 1 and "nodes=node3" in said[0] and "on the cluster's shared filesystem" in said[0], said
    assert not [log.name for log in logs.iterdir() if not log.name.startswith("slurm-")]  # no process was started
    assert not processes_of(job.run_dir)
