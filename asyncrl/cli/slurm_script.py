"""A run as one Slurm job: the batch script ``rl-launch slurm`` submits, and the ``srun`` step of each rollout actor.

The script asks for the nodes (``[slurm]``), then runs ``rl-launch slurm-job`` on the job's first node, which starts
the embedded Redis (bound to the node's address), the learner's ranks and the reward workers there, and one ``srun``
step per rollout actor on the other nodes (:func:`actor_step`). The job ends when the learner does, with its exit code.

Signals, as a Slurm user expects them:

- ``scancel`` sends SIGTERM: every process stops as Ctrl-C stops ``rl-launch run`` (the learner finishes its step and
  saves a checkpoint) within Slurm's ``KillWait``; the job is not requeued.
- ``stop_before_end_s`` before the time limit, Slurm sends :data:`TIME_LIMIT_SIGNAL` to the batch step
  (``--signal=B:USR1@N``): the same stop, then the job requeues itself (``scontrol requeue``, with ``requeue``) and the
  next start resumes from the newest checkpoint.

No secret is in the script, in an argument or in the environment Slurm records: the job makes the Redis password and
the CURVE keys in the run folder (mode 0600) when it starts, on the filesystem every node shares. The standard library
only: ``rl-launch slurm --dry-run`` renders the script without loading torch.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from asyncrl.common.config.slurm import SlurmSection

TIME_LIMIT_SIGNAL = "USR1"
"""What Slurm sends the batch step ``stop_before_end_s`` before the time limit (SIGTERM is ``scancel``'s)."""


@dataclass(frozen=True)
class JobFiles:
    """Where the job reads and writes, as absolute paths on the shared filesystem."""

    config: str
    """The run config (a file, or a preset's name)."""
    overrides: tuple[str, ...]
    """``--set`` overrides, as given to ``rl-launch slurm``."""
    workdir: str
    """The folder the job runs in (a relative ``run.root`` is under it)."""
    run_dir: str
    """``<run.root>/<run.name>``: the logs, Redis' folder, keys and checkpoints."""
    bin_dir: str
    """The folder of the ``rl-launch`` and ``rl-actor`` commands every node runs."""


def actors_per_node(section: SlurmSection, tensor_parallel_size: int) -> int:
    """``actors_per_node``, or as many actors as a node's GPUs hold (one on CPU nodes)."""
    if section.actors_per_node:
        return section.actors_per_node
    if section.gpus_per_node:
        return section.gpus_per_node // tensor_parallel_size
    return 1


def sbatch_options(section: SlurmSection, run: str, files: JobFiles) -> list[str]:
    """The ``#SBATCH`` options of the run's job, in the order they are written."""
    options = [
        f"--job-name={section.job_name or f'asyncrl-{run}'}",
        f"--nodes={section.nodes}",
        *_whole_nodes(files),
        "--open-mode=append",  # a requeued job adds to the same file
        f"--signal=B:{TIME_LIMIT_SIGNAL}@{section.stop_before_end_s}",
        "--requeue" if section.requeue else "--no-requeue",
    ]
    return options + _resources(section)


def _whole_nodes(files: JobFiles) -> list[str]:
    """Whole nodes (the actors' engines and the learner size themselves to the machine), kept when one of them fails
    (``--no-kill``: Slurm would end the whole job; the run goes on without that node's actors), started in the folder
    of the submit, the output beside the run's logs."""
    return ["--exclusive", "--no-kill", f"--chdir={files.workdir}", f"--output={files.run_dir}/logs/slurm-%j.out"]


def _resources(section: SlurmSection) -> list[str]:
    """GPUs, partition, account, QOS, time limit (those set), then the extra options."""
    options = [f"--gpus-per-node={section.gpus_per_node}"] if section.gpus_per_node else []
    for name in ("partition", "account", "qos"):
        options += [f"--{name}={getattr(section, name)}"] if getattr(section, name) else []
    options += [f"--time={section.time_limit}"] if section.time_limit else []
    return options + list(section.sbatch)


def batch_script(section: SlurmSection, run: str, files: JobFiles) -> str:
    """The whole batch script: its options, then ``rl-launch slurm-job`` on the first node (``exec``: the signals
    Slurm sends the batch step reach it)."""
    job = [f"{files.bin_dir}/rl-launch", "slurm-job", files.config]
    job += [a for o in files.overrides for a in ("--set", o)]
    lines = [
        "#!/bin/bash",
        f"# asyncrl run {run!r}: Redis, the learner and the reward workers on the first node, rollout actors on the",
        "# others (one srun step each). Written by rl-launch slurm; secrets are made by the job in the run folder.",
        *(f"#SBATCH {shlex.quote(option)}" for option in sbatch_options(section, run, files)),
        "set -eu",
        f"exec {shlex.join(job)}",
    ]
    return "\n".join(lines) + "\n"


def added_actors_script(
    section: SlurmSection, run: str, files: JobFiles, actors: int, tensor_parallel_size: int
) -> str:
    """A job of ``actors`` rollout actors that join the running run ``run`` (``rl-launch slurm --add-actors``): one
    ``srun`` of them, :func:`actors_per_node` a node, each named after the job and its task, reading the run's Redis
    URL from the run folder. Cancelling the job (``scancel``: SIGTERM first) makes them leave, giving their unfinished
    groups back."""
    per_node = min(actors_per_node(section, tensor_parallel_size), actors)
    nodes = -(-actors // per_node)
    job = section.job_name or f"asyncrl-{run}"
    options = [f"--job-name={job}-actors", f"--nodes={nodes}", *_whole_nodes(files), *_resources(section)]
    step = [
        "srun",
        f"--ntasks={actors}",
        f"--ntasks-per-node={per_node}",
        f"--cpus-per-task={section.cpus_per_actor}",
        "--kill-on-bad-exit=0",
    ]
    step += [f"--gpus-per-task={tensor_parallel_size}"] if section.gpus_per_node else []
    actor = (
        f'ASYNCRL_ADVERTISE_HOST="$SLURMD_NODENAME" exec {shlex.quote(files.bin_dir + "/rl-actor")} '
        f"--run {shlex.quote(run)} --redis-url-file {shlex.quote(files.run_dir + '/redis/url')} "
        '--id "actor-$SLURM_JOB_ID-$SLURM_PROCID"'
    )
    lines = [
        "#!/bin/bash",
        f"# Rollout actors that join the running asyncrl run {run!r}; scancel this job to take them away.",
        *(f"#SBATCH {shlex.quote(option)}" for option in options),
        "set -eu",
        f"exec {shlex.join(step)} bash -c {shlex.quote(actor)}",
    ]
    return "\n".join(lines) + "\n"


def actor_step(node: str, process_id: str, section: SlurmSection, tensor_parallel_size: int) -> list[str]:
    """The ``srun`` options of one rollout actor's step on ``node`` (its command follows them). ``--overlap``: on a
    job of one node the actors share node 0 with the batch step's processes."""
    step = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", f"--job-name={process_id}", "--overlap"]
    step += [f"--cpus-per-task={section.cpus_per_actor}", "--kill-on-bad-exit=0"]
    step += [f"--gpus-per-task={tensor_parallel_size}"] if section.gpus_per_node else []
    return step


def actor_nodes(nodes: Sequence[str]) -> list[str]:
    """The nodes that hold rollout actors: every node but the first, or the one node of a job of one."""
    return list(nodes[1:]) or list(nodes)
