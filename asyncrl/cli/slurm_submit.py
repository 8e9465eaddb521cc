"""``rl-launch slurm``: check a run against the cluster, write its batch script (``cli/slurm_script.py``) and submit it.

Everything that can be refused is refused here, in one line naming the setting, before anything is submitted: a config
that does not resolve, a partition Slurm does not know, more GPUs per actor than a node is given, ``sbatch`` missing.
A job Slurm itself refuses gets Slurm's own message, once.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import typer

from asyncrl.cli.slurm_script import JobFiles, added_actors_script, batch_script
from asyncrl.common.config import RunConfig
from asyncrl.common.exit_codes import ExitCode


def job_files(config: Path | None, overrides: list[str], resolved: RunConfig) -> JobFiles:
    """The job's paths, absolute: the job starts in this folder on another node."""
    workdir = Path.cwd()
    config_arg = str(config.resolve()) if config is not None and config.exists() else str(config or "")
    return JobFiles(
        config=config_arg,
        overrides=tuple(overrides),
        workdir=str(workdir),
        run_dir=str((workdir / resolved.run_dir).resolve()),
        bin_dir=str(Path(sys.executable).parent),
    )


def cluster_refusal(resolved: RunConfig) -> str | None:
    """What the cluster cannot run, in one line naming the setting; None when nothing is wrong."""
    section, tp = resolved.slurm, resolved.rollout.tensor_parallel_size
    if section.gpus_per_node and tp > section.gpus_per_node:
        return (
            f"rollout.tensor_parallel_size = {tp} needs {tp} GPUs per actor, more than slurm.gpus_per_node = "
            f"{section.gpus_per_node}; lower it or ask for more GPUs per node"
        )
    if section.gpus_per_node and section.actors_per_node * tp > section.gpus_per_node:
        return (
            f"slurm.actors_per_node = {section.actors_per_node} actors of {tp} GPU(s) need "
            f"{section.actors_per_node * tp} GPUs, more than slurm.gpus_per_node = {section.gpus_per_node}"
        )
    if section.gpus_per_node and section.learner_ranks > section.gpus_per_node:
        return (
            f"slurm.learner_ranks = {section.learner_ranks} is more than slurm.gpus_per_node = {section.gpus_per_node}"
        )
    if section.partition and not _partition_exists(section.partition):
        return f"slurm.partition = {section.partition!r}: no such partition on this cluster (sinfo lists them)"
    return None


def _partition_exists(name: str) -> bool:
    done = subprocess.run(["sinfo", "--noheader", "--format=%R", f"--partition={name}"], capture_output=True, text=True)
    return done.returncode == 0 and name in done.stdout.split()


def submit(
    config: Path | None,
    overrides: list[str],
    dry_run: bool = False,
    script_only: Path | None = None,
    add_actors: int | None = None,
) -> int:
    """Check, write the script of the run's job (or, with ``add_actors``, of that many actors joining it), submit it
    unless ``dry_run`` or ``script_only``; the exit status."""
    from asyncrl.cli.preflight import check_config
    from asyncrl.cli.util import fail, load
    from asyncrl.common.private import open_private, private_dir

    resolved = load(config, overrides, check=check_config)
    submits = not dry_run and script_only is None
    if submits and shutil.which("sbatch") is None:
        fail("sbatch not found: run rl-launch slurm on a Slurm login node, or write the script with --script-only FILE")
    if submits and (refusal := cluster_refusal(resolved)) is not None:
        fail(f"invalid config: {refusal}")
    files = job_files(config, overrides, resolved)
    if add_actors and submits and not (Path(files.run_dir) / "redis" / "url").is_file():
        fail(f"run {resolved.run.name!r} is not running from {files.run_dir} (no redis/url): start it first")
    tp = resolved.rollout.tensor_parallel_size
    script = (
        added_actors_script(resolved.slurm, resolved.run.name, files, add_actors, tp)
        if add_actors
        else batch_script(resolved.slurm, resolved.run.name, files)
    )
    if dry_run:
        print(script, end="")
        return 0
    if script_only is not None:
        script_only.write_text(script)
        typer.echo(f"wrote {script_only}; submit it with sbatch {script_only}", err=True)
        return 0
    private_dir(Path(files.run_dir) / "logs")  # the job's output file goes there; the run's user's only
    path = Path(files.run_dir) / ("slurm-actors.sh" if add_actors else "slurm-job.sh")
    with open_private(path, "w") as f:
        f.write(script)
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode:
        typer.echo(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}", err=True)
        return ExitCode.FAILED
    job_id = done.stdout.strip().split(";")[0]
    typer.echo(
        f"submitted job {job_id} {'of actors ' if add_actors else ''}for run {resolved.run.name!r} ({path}); "
        f"watch it: squeue -j {job_id}, "
        f"rl-top --redis-url-file {files.run_dir}/redis/url --run {resolved.run.name}; "
        f"output in {files.run_dir}/logs/slurm-{job_id}.out",
        err=True,
    )
    print(job_id)
    return 0
