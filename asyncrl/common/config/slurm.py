"""The ``[slurm]`` section: how ``rl-launch slurm`` lays a run out as one Slurm job (``cli/slurm_script.py`` writes the
batch script from it). Node 0 holds Redis, the learner's ranks and the reward workers; every other node holds rollout
actors. Flags of ``rl-launch slurm`` override these fields one for one."""

from __future__ import annotations

from pydantic import Field, field_validator

from asyncrl.common.config.base import Int, Section

SBATCH_NAME = r"^[A-Za-z0-9_.+-]{1,64}$"
"""A partition, account or QOS name as Slurm writes them (no spaces, quotes or ``#``)."""


class SlurmSection(Section):
    nodes: Int = Field(default=2, ge=1, le=4096)
    """Nodes of the job: node 0 for Redis, the learner and the reward workers, the rest for rollout actors (with 1,
    the actors share node 0)."""
    gpus_per_node: Int = Field(default=0, ge=0, le=64)
    """GPUs of each node asked for (``--gpus-per-node``); 0 on CPU nodes."""
    learner_ranks: Int = Field(default=1, ge=1, le=64)
    """Learner ranks on node 0 (``torchrun --nproc-per-node``; one GPU each on GPU nodes)."""
    actors_per_node: Int = Field(default=0, ge=0, le=256)
    """Rollout actors on each actor node; 0 = as many as its GPUs hold (``gpus_per_node`` ÷
    ``rollout.tensor_parallel_size``), or 1 on CPU nodes."""
    cpus_per_actor: Int = Field(default=1, ge=1, le=1024)
    """CPUs each actor's step asks for (``srun --cpus-per-task``)."""
    rewards: Int = Field(default=1, ge=0, le=256)
    """Reward workers on node 0."""
    partition: str = Field(default="", pattern=r"^$|" + SBATCH_NAME)
    """``--partition``; empty: the cluster's default."""
    account: str = Field(default="", pattern=r"^$|" + SBATCH_NAME)
    """``--account``; empty: the user's default."""
    qos: str = Field(default="", pattern=r"^$|" + SBATCH_NAME)
    """``--qos``; empty: the default."""
    time_limit: str = Field(default="", pattern=r"^$|^(\d+-)?\d+(:\d{1,2}){0,2}$")
    """``--time`` as Slurm writes it (``MM``, ``HH:MM:SS``, ``D-HH:MM``…); empty: the partition's limit."""
    stop_before_end_s: Int = Field(default=300, ge=10, le=86_400)
    """Seconds before the time limit at which the learner is told to stop (``--signal``): it finishes the step and
    saves a checkpoint; then the job is requeued (``requeue``) and resumes from it."""
    requeue: bool = True
    """Requeue the job when its time limit stops it (``--requeue``); it resumes from the newest checkpoint."""
    job_name: str = Field(default="", pattern=r"^$|^[A-Za-z0-9_.+-]{1,128}$")
    """``--job-name``; empty: ``asyncrl-<run.name>``."""
    sbatch: list[str] = Field(default_factory=list, max_length=64)
    """Extra ``#SBATCH`` options, one per item, each as it follows ``#SBATCH `` (``--constraint=a100``)."""

    @field_validator("sbatch")
    @classmethod
    def _options(cls, lines: list[str]) -> list[str]:
        for line in lines:
            if not line.startswith("-") or "\n" in line or "\r" in line or len(line) > 512:
                raise ValueError(f"{line!r} is not one sbatch option; write it as it follows '#SBATCH ', e.g. --mem=0")
        return lines
