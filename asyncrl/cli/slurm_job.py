"""Inside the Slurm job that ``rl-launch slurm`` submits (``cli/slurm_script.py`` writes its script): the run across the
job's nodes.

On the first node, as ``rl-launch run`` does on one machine: the embedded Redis (bound to the node's address too, with
its password file in the run folder), the reward workers (CURVE, on every interface) and the learner; then one
``srun`` step per rollout actor on the other nodes. The job follows the learner: when it ends, every step is stopped
and the job exits with the learner's code. A requeued job resumes from the newest checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.cli.slurm_script import actor_nodes, actor_step, actors_per_node
from asyncrl.cli.util import bin_path
from asyncrl.common.config import RunConfig
from asyncrl.common.exit_codes import ExitCode
from asyncrl.common.net import ADVERTISE_HOST_ENV
from asyncrl.common.observability.logs import get_logger

log = get_logger("slurm")

JOB_OVERRIDES = ("transport.zmq_endpoint=tcp://0.0.0.0:0",)
"""The reward workers bind every interface (the actors are on other nodes); CURVE keys are made for the run."""


def job_nodes(environ: dict[str, str] | None = None) -> list[str]:
    """The job's nodes, first node first (``scontrol show hostnames $SLURM_JOB_NODELIST``)."""
    environ = dict(os.environ) if environ is None else environ
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise RuntimeError("rl-launch slurm-job runs inside a Slurm job (no SLURM_JOB_NODELIST); use rl-launch slurm")
    done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return done.stdout.split()


@dataclass
class SrunActors:
    """Rollout actors as ``srun`` steps on the job's actor nodes (:func:`asyncrl.cli.slurm_script.actor_nodes`)."""

    config: RunConfig
    nodes: list[str]
    learner_prefix: list[str] = field(default_factory=list)

    def start_actors(self, children, run_args: list[str]) -> int:
        tp = self.config.rollout.tensor_parallel_size
        per_node = actors_per_node(self.config.slurm, tp)
        rl_actor = bin_path("rl-actor")
        count = 0
        for node in actor_nodes(self.nodes):
            for _ in range(per_node):
                name = f"actor-{count}"
                step = actor_step(node, name, self.config.slurm, tp)
                # srun carries this environment to the step: the actor advertises its own node
                children.start(name, [*step, rl_actor, *run_args, "--id", name], {ADVERTISE_HOST_ENV: node})
                count += 1
        log.info("rollout actors started as job steps", actors=count, nodes=",".join(actor_nodes(self.nodes)))
        return count


def learner_prefix(ranks: int) -> list[str]:
    """``torchrun`` of ``ranks`` learner ranks on this node, or nothing for one rank."""
    if ranks == 1:
        return []
    return [bin_path("torchrun"), "--standalone", "--nnodes=1", f"--nproc-per-node={ranks}", "--no-python"]


class JobSignals:
    """SIGTERM (``scancel``) and SIGINT stop the run; :data:`~asyncrl.cli.slurm_script.TIME_LIMIT_SIGNAL` (the time
    limit is near) stops it too, and asks for a requeue."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.time_limit = False
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._received)

    def _received(self, signum: int, _frame) -> None:
        self.time_limit |= signum == signal.SIGUSR1
        log.info("stopping the run", signal=signal.Signals(signum).name, requeue_asked=self.time_limit)
        self.stop.set()


def resume_args(resolved: RunConfig) -> list[str]:
    """``--resume latest`` when the run folder holds a complete checkpoint (a requeued job), else nothing."""
    from asyncrl.learner.checkpoint.format import CheckpointError
    from asyncrl.learner.checkpoint.history import find_checkpoint

    try:
        find_checkpoint("latest", resolved.run_dir / "checkpoints")
    except CheckpointError:
        return []
    log.info("resuming from the newest checkpoint", run=resolved.run.name)
    return ["--resume", "latest"]


def unshared_nodes(nodes: list[str], url_file: Path) -> list[str]:
    """The actor nodes on which ``url_file`` (in the run folder, just written on the first node) is not there: the
    run folder is not on a filesystem they share. One ``srun`` of ``test -r`` on each, in parallel."""
    actor_hosts = [n for n in actor_nodes(nodes) if n != nodes[0]]
    if not actor_hosts:
        return []
    check = ["srun", f"--nodes={len(actor_hosts)}", f"--ntasks={len(actor_hosts)}", "--ntasks-per-node=1", "--overlap"]
    check += [f"--nodelist={','.join(actor_hosts)}", "--kill-on-bad-exit=0", "--job-name=shared-check"]
    probe = ["sh", "-c", 'test -r "$0" || echo "$SLURMD_NODENAME"', str(url_file)]
    done = subprocess.run([*check, *probe], capture_output=True, text=True, timeout=300)
    return sorted(set(done.stdout.split()))


def requeue(job_id: str) -> None:
    """Put this job back in the queue (it is ended and started again from its script)."""
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if done.returncode:
        log.error("could not requeue the job", job=job_id, error=done.stderr.strip(), action="resubmit it by hand")
    else:
        log.info("job requeued: it resumes from the checkpoint just saved", job=job_id)


def run_job(config: Path | None, overrides: list[str], run_redis, run_children) -> int:
    """The run across the job's nodes; the learner's exit code. ``run_redis`` and ``run_children`` are
    ``rl-launch run``'s own (``cli/launch.py``, which calls this): the job starts its processes as it does."""
    nodes = job_nodes()
    advertise = os.environ.get(ADVERTISE_HOST_ENV) or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    os.environ[ADVERTISE_HOST_ENV] = advertise  # every process started here advertises this node
    signals = JobSignals()
    overrides = [*overrides, *JOB_OVERRIDES]
    with run_redis(config, overrides, curve=True, check_model=True, binds_here=True, advertise=advertise) as (
        resolved,
        server,
        in_force,
    ):
        log.info("slurm job started", run=resolved.run.name, nodes=",".join(nodes), redis_host=advertise)
        if missing := unshared_nodes(nodes, resolved.run_dir / "redis" / "url"):
            log.error(
                "the run folder is not on a filesystem every node shares",
                run_dir=resolved.run_dir,
                nodes=",".join(missing),
                action="put run.root (and the folder you submit from) on the cluster's shared filesystem",
            )
            return ExitCode.REFUSED
        placement = SrunActors(resolved, nodes, learner_prefix(resolved.slurm.learner_ranks))
        learner_args = [*resume_args(resolved), "--sigterm-exit-code", str(ExitCode.STOPPED_EARLY)]
        started = (resolved, server, config, in_force)
        code, learner_code = run_here(
            run_children, started, resolved.slurm.rewards, learner_args, placement, signals.stop
        )
    if signals.time_limit and learner_code == ExitCode.STOPPED_EARLY and resolved.slurm.requeue:
        requeue(os.environ.get("SLURM_JOB_ID", ""))
    return learner_code if code == ExitCode.INTERRUPTED else code


def run_here(run_children, started: tuple, rewards: int, learner_args: list[str], placement, stop) -> tuple[int, int]:
    """The run's learner and reward workers on this node, its rollout actors where ``placement`` puts them (Slurm's
    steps, Ray's actors), until the learner ends or ``stop`` is set: (how the following ended, the learner's exit
    code). ``started`` is what ``rl-launch run``'s ``_run_redis`` gave: (config, Redis server, config path,
    overrides in force)."""
    from asyncrl.cli.children import Children

    resolved, server, config, in_force = started
    children = Children(resolved.run_dir / "logs")
    try:
        code = run_children(
            children, resolved, server, config, in_force, (0, rewards, {}), learner_args, placement, stop
        )
    finally:
        # The learner first: its last sync (up to weight_sync.timeout_s) and its checkpoint, while the actors can
        # still take the sync; then the others.
        children.stop_all(resolved.weight_sync.timeout_s + 120, first=("learner",))
    return code, children.procs["learner"].returncode
