"""The batch script ``rl-launch slurm`` submits, the actors' ``srun`` steps, and what is refused before a submit
(the script's run on a real Slurm: ``tests/e2e/test_slurm.py``)."""

from __future__ import annotations

import pytest

from asyncrl.cli.slurm_script import (
    JobFiles,
    actor_nodes,
    actor_step,
    actors_per_node,
    added_actors_script,
    batch_script,
    sbatch_options,
)
from asyncrl.cli.slurm_submit import cluster_refusal
from asyncrl.common.config import ConfigError, load_config
from asyncrl.common.config.slurm import SlurmSection

FILES = JobFiles("/shared/exp/run.toml", ("learner.lr=1e-4",), "/shared/exp", "/shared/exp/runs/exp1", "/venv/bin")


def sbatch_lines(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_the_script_asks_for_the_nodes_and_runs_the_job_on_the_first() -> None:
    section = SlurmSection(nodes=4, gpus_per_node=8, partition="gpu", account="rl", time_limit="4:00:00")
    script = batch_script(section, "exp1", FILES)
    assert script.startswith("#!/bin/bash\n")
    assert sbatch_lines(script) == [
        "--job-name=asyncrl-exp1", "--nodes=4", "--exclusive", "--no-kill", "--chdir=/shared/exp",
        "--output=/shared/exp/runs/exp1/logs/slurm-%j.out", "--open-mode=append", "--signal=B:USR1@300",
        "--requeue", "--gpus-per-node=8", "--partition=gpu", "--account=rl", "--time=4:00:00",
    ]  # fmt: skip
    assert script.rstrip().endswith(
        "exec /venv/bin/rl-launch slurm-job /shared/exp/run.toml --set learner.lr=1e-4"
    )  # exec: the signals Slurm sends the batch step reach the job itself


def test_extra_options_follow_and_requeue_can_be_off() -> None:
    section = SlurmSection(requeue=False, sbatch=["--constraint=a100", "--mem=0"], job_name="mine")
    options = sbatch_options(section, "exp1", FILES)
    assert (
        options[0] == "--job-name=mine"
        and "--no-requeue" in options
        and options[-2:] == ["--constraint=a100", "--mem=0"]
    )


def test_an_added_actors_job_runs_one_srun_of_actors_that_join_the_run() -> None:
    section = SlurmSection(gpus_per_node=8, partition="gpu")
    script = added_actors_script(section, "exp1", FILES, actors=3, tensor_parallel_size=4)
    assert sbatch_lines(script) == [
        "--job-name=asyncrl-exp1-actors", "--nodes=2", "--exclusive", "--no-kill", "--chdir=/shared/exp",
        "--output=/shared/exp/runs/exp1/logs/slurm-%j.out", "--gpus-per-node=8", "--partition=gpu",
    ]  # fmt: skip
    last = script.rstrip().splitlines()[-1]
    srun = "exec srun --ntasks=3 --ntasks-per-node=2 --cpus-per-task=1 --kill-on-bad-exit=0 --gpus-per-task=4 "
    assert last.startswith(srun)
    assert "--redis-url-file /shared/exp/runs/exp1/redis/url" in last and "actor-$SLURM_JOB_ID-$SLURM_PROCID" in last


def test_actors_fill_a_nodes_gpus_or_one_per_cpu_node() -> None:
    assert actors_per_node(SlurmSection(), 1) == 1
    assert actors_per_node(SlurmSection(gpus_per_node=8), 2) == 4
    assert actors_per_node(SlurmSection(gpus_per_node=8, actors_per_node=2), 2) == 2
    assert actor_nodes(["n1", "n2", "n3"]) == ["n2", "n3"] and actor_nodes(["n1"]) == ["n1"]
    step = actor_step("n2", "actor-3", SlurmSection(gpus_per_node=8, cpus_per_actor=4), 2)
    assert step[:5] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=n2", "--job-name=actor-3"]
    assert "--cpus-per-task=4" in step and "--gpus-per-task=2" in step
    assert not [o for o in actor_step("n2", "a", SlurmSection(), 1) if o.startswith("--gpus")]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("slurm.partition='gpu queue'", "slurm.partition: String should match pattern"),
        ("slurm.time_limit='4 hours'", "slurm.time_limit: String should match pattern"),
        ("slurm.sbatch=['mem=0']", "'mem=0' is not one sbatch option"),
        ('slurm.sbatch=["--mem=0\\n#SBATCH --x"]', "is not one sbatch option"),  # a newline: a second line
        ("slurm.nodes=0", "slurm.nodes: Input should be greater than or equal to 1"),
    ],
)
def test_a_setting_slurm_cannot_take_is_refused_naming_it(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_gpus_a_node_does_not_have_are_refused_before_a_submit() -> None:
    def refusal(*sets: str) -> str | None:
        return cluster_refusal(load_config(None, list(sets)))

    assert refusal() is None and refusal("slurm.gpus_per_node=8", "rollout.tensor_parallel_size=8") is None
    assert "rollout.tensor_parallel_size = 4 needs 4 GPUs per actor" in refusal(
        "slurm.gpus_per_node=2", "rollout.tensor_parallel_size=4"
    )
    assert "slurm.actors_per_node = 3 actors of 2 GPU(s) need 6 GPUs" in refusal(
        "slurm.gpus_per_node=4", "slurm.actors_per_node=3", "rollout.tensor_parallel_size=2"
    )
    assert "slurm.learner_ranks = 4 is more than slurm.gpus_per_node = 2" in refusal(
        "slurm.gpus_per_node=2", "slurm.learner_ranks=4"
    )
