"""``rl-launch``: one machine, one command. ``run`` starts the run's embedded Redis, then the learner,
rollout actors and reward workers as child processes with their logs in ``runs/<name>/logs/``, shows a
live progress line, and stops them all (and Redis) when the learner ends or on Ctrl-C. ``redis``
starts only the embedded Redis, for launching the other processes by hand."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from asyncrl.cli.util import listed_briefly
from asyncrl.common.exit_codes import ExitCode

if TYPE_CHECKING:
    from asyncrl.common.config import RunConfig
    from asyncrl.common.plane.redis_server import EmbeddedRedis

app = typer.Typer(add_completion=False, no_args_is_help=True, help="asyncrl local launcher.")


@app.callback()
def _group() -> None:
    """asyncrl local launcher."""


ConfigOpt = Annotated[Path | None, typer.Argument(help="Run config (TOML).")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value.")]


CurveOpt = Annotated[
    bool,
    typer.Option(
        "--curve",
        help="Generate CURVE keys for the run in runs/<name>/keys/ (unless there) and use them on every ZeroMQ hop.",
    ),
]


@contextlib.contextmanager
def _run_redis(
    config: Path | None,
    overrides: list[str] | None,
    curve: bool = False,
    check_model: bool = False,
    binds_here: bool = False,
    advertise: str | None = None,
    before_start: Callable[[RunConfig], None] | None = None,
) -> Iterator[tuple[RunConfig, EmbeddedRedis, list[str]]]:
    """Resolve the config (with ``check_model``, check it against a local model folder: ``cli/model_check.py``,
    the engine aside; with ``binds_here``, that reward workers started here can bind their endpoint), start the run's
    embedded Redis (with ``advertise``, bound to that host's address too, for the run's other hosts), publish the
    config; stop Redis on exit. ``before_start`` may refuse the resolved config before anything starts. Yields the
    config, the server and the overrides in force
    (with ``curve``, the generated keys' settings added)."""
    from asyncrl.cli.preflight import check_config, missing_model_folder, slow_precision
    from asyncrl.cli.util import fail, load
    from asyncrl.common.config import bind_refusal, write_resolved
    from asyncrl.common.plane.control import ControlPlane
    from asyncrl.common.plane.keys import connect
    from asyncrl.common.plane.redis_server import EmbeddedRedis, EmbeddedRedisError
    from asyncrl.common.private import private_dir

    overrides = list(overrides or [])
    if curve:
        overrides += _curve_overrides(load(config, overrides, check=check_config))
    resolved = load(config, overrides, check=check_config)
    if before_start is not None:
        before_start(resolved)
    if binds_here and (refusal := bind_refusal(resolved)) is not None:  # not once the learner has started
        fail(f"invalid config: {refusal}")
    if check_model and (missing := missing_model_folder(resolved.model.path)) is not None:
        fail(missing)
    if (slow := slow_precision(resolved)) is not None:
        typer.echo(f"warning: {slow}", err=True)
    if check_model and Path(resolved.model.path).is_dir():  # a hub name is the engine's to fetch and check
        from asyncrl.cli.model_check import check_model_folder

        try:
            check_model_folder(resolved)
        except ValueError as exc:
            fail(f"{exc} (rl-learner check-model CONFIG shows the whole check)")
    private_dir(resolved.run_dir)  # 0700, also a folder an older run left readable (common/private.py)
    write_resolved(resolved)
    try:
        memory = resolved.transport.redis_maxmemory_mb
        server = EmbeddedRedis(
            resolved.run_dir / "redis", maxmemory_mb=memory, advertise=advertise, follow_parent=advertise is not None
        ).start()
    except EmbeddedRedisError as exc:
        fail(str(exc))
    try:
        ControlPlane(connect(server.url), resolved.run.name).run.publish_config(resolved)
        yield resolved, server, overrides
    finally:
        server.stop()


def _curve_overrides(resolved: RunConfig) -> list[str]:
    """The run's CURVE keys (made in ``runs/<name>/keys/`` the first time) as ``--set`` overrides."""
    import json

    from asyncrl.common.transport.curve import create_run_keys

    folder = resolved.run_dir / "keys"
    settings = (
        {
            "transport.curve_server_key": str(folder / "server.key_secret"),
            "transport.curve_client_keys": str(folder / "authorized"),
            "transport.curve_client_key": str(folder / "client.key_secret"),
        }
        if (folder / "server.key_secret").is_file()
        else create_run_keys(folder)
    )
    typer.echo(f"CURVE keys of run {resolved.run.name!r} in {folder}", err=True)
    return [f"{key}={json.dumps(value)}" for key, value in settings.items()]


@app.command()
def keys(folder: Annotated[Path, typer.Argument(help="Folder for the keys (created).")]) -> None:
    """Make CURVE keys for a run: the reward workers' server pair, a client pair for the actors, and the folder of
    authorised client keys; prints the settings that use them. Add a client by putting its public key file into
    the authorised folder."""
    from asyncrl.common.transport.curve import create_run_keys

    for key, value in create_run_keys(folder).items():
        print(f"--set {key}={value}")


@app.command()
def redis(config: ConfigOpt = None, set_: SetOpt = None, curve: CurveOpt = False) -> None:
    """Start the run's embedded Redis, publish the resolved config, and serve until Ctrl-C. Started again on the same
    run folder (after its server was killed), it takes the same port, password and AOF, and the run goes on; exits 1
    when its redis-server dies."""
    with _run_redis(config, set_, curve) as (resolved, server, _overrides):
        url_file = resolved.run_dir / "redis" / "url"
        typer.echo(
            f"run {resolved.run.name!r}: redis ready (URL with password in {url_file}); Ctrl-C stops it", err=True
        )
        code = _serve(server, resolved)
    raise typer.Exit(code)


@app.command()
def run(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    actors: Annotated[int, typer.Option(help="Rollout actors to start.")] = 2,
    rewards: Annotated[int, typer.Option(help="Reward workers to start.")] = 1,
    resume: Annotated[
        str | None, typer.Option(help="Passed on to the learner: 'latest' or a checkpoint folder to continue from.")
    ] = None,
    curve: CurveOpt = False,
    pin: Annotated[
        list[str] | None,
        typer.Option(
            help="Pin processes to CPUs, ROLE=CPUS (repeatable): ROLE learner, actors or rewards; CPUS a list "
            "such as 0 or 1-3 (taskset's). E.g. --pin learner=0 --pin actors=1 --pin rewards=1."
        ),
    ] = None,
) -> None:
    """Start embedded Redis, the learner, rollout actors and reward workers; show progress; Ctrl-C stops all
    (the learner saves a checkpoint first). A redis-server that dies is started again on its AOF, with the same
    port and password, while the other processes wait for it (transport.redis_outage_s)."""
    from asyncrl.cli.children import Children, parse_pins
    from asyncrl.cli.util import fail

    try:
        pins = parse_pins(pin or [])
    except ValueError as exc:
        fail(str(exc))
    code = 1
    run_redis = _run_redis(
        config, set_, curve, check_model=True, binds_here=rewards > 0, before_start=lambda r: _nothing_to_do(r, resume)
    )
    with run_redis as (resolved, server, overrides):
        learner_args = ["--resume", str(_checkpoint_folder(resolved, resume))] if resume else []
        children = Children(resolved.run_dir / "logs")
        try:
            code = _run_children(children, resolved, server, config, overrides, (actors, rewards, pins), learner_args)
        finally:
            children.stop_all()
    if code == ExitCode.INTERRUPTED:
        from asyncrl.cli.resuming import how_to_go_on

        typer.echo(how_to_go_on(resolved, config, set_), err=True)
    raise typer.Exit(code)


def _nothing_to_do(resolved: RunConfig, resume: str | None) -> None:
    """Before anything starts: a run folder that holds a checkpoint is refused without ``--resume`` (one line saying
    what to pass); with it, a run already at ``learner.steps`` says it finished and exits 0, and one without the
    checkpoint it names is refused."""
    from asyncrl.cli.resuming import finished_at, finished_line, started_refusal
    from asyncrl.cli.util import fail

    if resume is None:
        if (refusal := started_refusal(resolved)) is not None:
            fail(refusal)
    elif (step := finished_at(resolved, resume)) is not None:
        typer.echo(finished_line(resolved, step), err=True)
        raise typer.Exit(0)
    else:
        _checkpoint_folder(resolved, resume)


@app.command()
def slurm(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    nodes: Annotated[int | None, typer.Option(help="Nodes of the job (slurm.nodes).")] = None,
    partition: Annotated[str | None, typer.Option(help="Partition (slurm.partition).")] = None,
    account: Annotated[str | None, typer.Option(help="Account (slurm.account).")] = None,
    time: Annotated[str | None, typer.Option(help="Time limit, as sbatch --time (slurm.time_limit).")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="GPUs per node (slurm.gpus_per_node).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the batch script; submit nothing.")] = False,
    script_only: Annotated[
        Path | None, typer.Option("--script-only", help="Write the batch script to this file; submit nothing.")
    ] = None,
    add_actors: Annotated[
        int | None,
        typer.Option(min=1, help="Submit a job of this many rollout actors that join the running run instead."),
    ] = None,
    run_name: Annotated[str | None, typer.Option("--run", help="The run (run.name), for --add-actors.")] = None,
) -> None:
    """Run on a Slurm cluster as one job: Redis, the learner and the reward workers on the first node, rollout actors
    on the others ([slurm] section). Writes the batch script and submits it with sbatch; the job ends when the run
    does. Run it on a login node, from a folder every node shares (run.root and this environment must be on it).
    --add-actors N submits a job of N more actors that join the running run; scancel it to take them away."""
    from asyncrl.cli.slurm_submit import submit

    flags = {"nodes": nodes, "partition": partition, "account": account, "time_limit": time}
    flags["gpus_per_node"] = gpus_per_node
    overrides = [*(set_ or []), *(f"slurm.{k}={v}" for k, v in flags.items() if v is not None)]
    overrides += [f"run.name={run_name}"] if run_name else []
    raise typer.Exit(submit(config, overrides, dry_run=dry_run, script_only=script_only, add_actors=add_actors))


@app.command("slurm-job", hidden=True)
def slurm_job(config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Inside the job rl-launch slurm submits: the run across the job's nodes (exits with the learner's code)."""
    from asyncrl.cli.slurm_job import run_job

    raise typer.Exit(run_job(config, list(set_ or []), _run_redis, _run_children))


@app.command()
def ray(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    address: Annotated[
        str | None,
        typer.Option(help="The Ray cluster: auto, HOST:PORT of its head, or ray://HOST:10001 (ray.address)."),
    ] = None,
    actors: Annotated[int | None, typer.Option(min=0, help="Rollout actors (ray.actors).")] = None,
    rewards: Annotated[int | None, typer.Option(min=0, help="Reward workers (ray.rewards).")] = None,
    gpus: Annotated[
        bool | None, typer.Option("--gpus/--no-gpus", help="Ask Ray for GPUs for the learner and actors (ray.gpus).")
    ] = None,
    run_name: Annotated[
        str | None,
        typer.Option("--run", help="A live run (run.name): with --actors N, start or stop rollout actors until N run."),
    ] = None,
) -> None:
    """Run on a Ray cluster: Ray places the run's head (Redis, the learner, the reward workers: one placement group on
    one node) and each rollout actor ([ray] section), and asyncrl's own processes run there as anywhere. Run it on a
    node of the cluster (or through ray://), from a folder every node shares (run.root and this environment must be on
    it). Ends with the run; Ctrl-C stops it (the learner saves a checkpoint first). With --run NAME and --actors N,
    changes the number of rollout actors of that live run instead, from the folder it was launched from."""
    from asyncrl.cli.ray_launch import launch, scale
    from asyncrl.cli.util import fail

    flags = {"address": address, "actors": actors, "rewards": rewards, "gpus": gpus}
    overrides = [*(set_ or []), *(f"ray.{k}={json.dumps(v)}" for k, v in flags.items() if v is not None)]
    if run_name is None:
        raise typer.Exit(launch(config, overrides))
    if actors is None:
        fail("--run names a live run to change: give the number of rollout actors it should have (--actors N)")
    raise typer.Exit(scale(config, [*overrides, f"run.name={json.dumps(run_name)}"], actors))


@app.command("ray-head", hidden=True)
def ray_head(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    address: Annotated[str, typer.Option(help="The cluster's GCS address.")] = "auto",
) -> None:
    """On the node Ray placed the run's head: Redis, the reward workers and the learner; the actors through Ray."""
    from asyncrl.cli.ray_launch import head_main

    raise typer.Exit(head_main(config, list(set_ or []), address, _run_redis, _run_children))


@app.command("ray-actor", hidden=True)
def ray_actor(
    command: Annotated[list[str], typer.Argument(help="The rollout actor's command line.")],
    address: Annotated[str, typer.Option(help="The cluster's GCS address.")] = "auto",
    run_name: Annotated[str, typer.Option("--run", help="The run (its Ray namespace).")] = "demo",
    name: Annotated[str, typer.Option(help="The actor's name in the run.")] = "actor-0",
    request: Annotated[str, typer.Option(help="JSON: cpus, gpus, resources, restarts.")] = "{}",
    log_path: Annotated[str, typer.Option("--log", help="The actor's log file.")] = "",
) -> None:
    """One rollout actor placed by Ray, followed until it exits (its exit code); SIGTERM stops it."""
    from asyncrl.cli.ray_launch import actor_main

    raise typer.Exit(actor_main(address, run_name, name, json.loads(request), log_path, command))


def _checkpoint_folder(resolved: RunConfig, spec: str) -> Path:
    """The checkpoint ``--resume`` names, found before anything starts (the learner verifies its files)."""
    from asyncrl.cli.util import fail
    from asyncrl.learner.checkpoint.format import CheckpointError
    from asyncrl.learner.checkpoint.history import find_checkpoint

    try:
        return find_checkpoint(spec, resolved.run_dir / "checkpoints")
    except CheckpointError as exc:
        fail(f"cannot resume: {exc}")


def _run_children(
    children, resolved, server, config, overrides, counts, learner_args, placement=None, stop=None
) -> int:
    """Start the run's processes and follow them until the learner ends (its exit code) or ``stop`` is set (130).
    ``placement`` starts the rollout actors elsewhere (a Slurm job's ``srun`` steps: ``cli/slurm_job.py``) and
    may wrap the learner's command; ``stop``: set by the caller's own signal handlers, else by SIGINT and SIGTERM."""
    import os
    import sys

    bin_dir = Path(sys.executable).parent
    # The URL holds the Redis password: children read it from the server's 0600 file, never from argv (ps shows argv).
    run_args = ["--redis-url-file", str(resolved.run_dir / "redis" / "url"), "--run", resolved.run.name]
    actors, rewards, pins = counts
    cores = sorted(os.sched_getaffinity(0))
    for i in range(rewards):
        reward = [str(bin_dir / "rl-actor"), "reward", *run_args, "--id", f"reward-{i}"]
        children.start(f"reward-{i}", reward, cpus=pins.get("rewards"))
    if placement is not None:
        actors = placement.start_actors(children, run_args)
    for i in range(actors if placement is None else 0):
        # vLLM binds its CPU threads itself: to the pinned cores, else one core an actor round the machine's
        env = {"VLLM_CPU_OMP_THREADS_BIND": pins.get("actors") or str(cores[i % len(cores)])}
        actor = [str(bin_dir / "rl-actor"), *run_args, "--id", f"actor-{i}"]
        children.start(f"actor-{i}", actor, env, cpus=pins.get("actors"))
    learner_cmd = [*(placement.learner_prefix if placement else []), str(bin_dir / "rl-learner"), "train"]
    learner_cmd += [str(config)] if config else []
    learner_cmd += [a for o in overrides for a in ("--set", o)] + [*run_args[:2], *learner_args]
    learner = children.start("learner", learner_cmd, cpus=pins.get("learner"))
    if stop is None:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    return _follow(children, resolved, server, learner, actors, stop, restarts_actors=placement is not None)


def _follow(
    children, resolved, server, learner, actors: int, stop: threading.Event, restarts_actors: bool = False
) -> int:
    """Show progress and say why each child that failed did, until the learner ends or ``stop`` is set. Unless
    others may bring actors back (``restarts_actors``: a Slurm job's), the run stops as soon as every rollout actor
    started here has exited and no other actor serves the run."""
    import sys

    from asyncrl.cli.children import ActorsGone, Progress, tail_metrics, why_it_failed

    metrics = resolved.run_dir / "metrics.jsonl"
    progress, told = Progress(resolved.learner.steps, sys.stderr), set()
    gone = None if restarts_actors else ActorsGone(children.procs, actors, server.url, resolved.run.name)
    while not stop.wait(1.0) and learner.poll() is None:
        if (restarted := server.keep_up()) is not None:
            children.keep(restarted)  # ours, not a stray a child left behind
        for dead in children.failed_all() - told - {"learner"}:  # each once, with the line that says why
            told.add(dead)
            why = why_it_failed(children.procs[dead].returncode, children.log_path(dead))
            progress.say(f"{dead} exited with an error: {why}")
        if refused_by_every_actor(children, actors):
            progress.end()
            typer.echo(
                "stopping the run: every rollout actor refused its settings (above), and a restart would too; "
                "fix the setting each names, then run again",
                err=True,
            )
            return ExitCode.REFUSED
        if gone is not None and gone.all_gone():
            progress.end()
            typer.echo(
                "stopping the run: every rollout actor it started has exited (why each one did is above) and "
                "rl-launch does not start them again; the learner saves a checkpoint; fix the cause, then run again "
                "with --resume latest",
                err=True,
            )
            return ExitCode.NO_WORKERS
        if (last := tail_metrics(metrics)) is not None:
            progress.show(last)
    progress.end()
    if learner.poll() is None:
        return ExitCode.INTERRUPTED
    if learner.returncode == ExitCode.REDIS_OUTAGE:
        typer.echo(
            "learner stopped: Redis was unreachable for longer than transport.redis_outage_s "
            f"({resolved.transport.redis_outage_s:g}s); run again with --resume latest once Redis can start; "
            f"see {resolved.run_dir / 'logs' / 'learner.log'}",
            err=True,
        )
    elif learner.returncode == ExitCode.NO_WORKERS:  # the learner's own line names the kind that is gone
        said = children.log_path("learner").read_text(errors="replace").splitlines()
        line = next((x for x in reversed(said) if x.startswith("learner stopped:")), "learner stopped: no workers")
        typer.echo(f"{line} (why each one ended is above)", err=True)
    elif learner.returncode:
        typer.echo(f"learner failed: {why_it_failed(learner.returncode, children.log_path('learner'))}", err=True)
    return learner.returncode


def refused_by_every_actor(children, actors: int) -> bool:
    """Every rollout actor this launcher started exited with :data:`ExitCode.REFUSED`: each refused the run's
    settings before its engine started (``rl-actor``'s checks), so none will ever generate."""
    codes = [children.procs[f"actor-{i}"].poll() for i in range(actors)]
    return bool(codes) and all(code == ExitCode.REFUSED for code in codes)




def _serve(server: EmbeddedRedis, resolved: RunConfig) -> int:
    """``rl-launch redis``: 0 after SIGINT or SIGTERM; 1, saying what to do, as soon as its redis-server died."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    process = server.process
    if process is None:
        raise RuntimeError("rl-launch redis serves a server it started")
    while not stop.wait(1.0):
        if (code := process.poll()) is not None:
            typer.echo(
                f"redis-server (pid {process.pid}) exited with {code}; start it again with the same command "
                f"(`rl-launch redis` for {resolved.run_dir}): it takes the same port, password and AOF, and the run's "
                f"processes wait {resolved.transport.redis_outage_s:g}s (transport.redis_outage_s) for it",
                err=True,
            )
            return 1
    return 0


listed_briefly(app)  # every command is defined by now


def main() -> None:
    from asyncrl.common.private import private_umask

    private_umask()  # the run's files are its user's only, its children's too (they inherit it)
    app()


if __name__ == "__main__":
    main()
