"""``rl-actor``: rollout actors and reward workers. Heavy libraries are imported inside commands only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from asyncrl.cli.util import RedisFileOpt, RedisOpt, listed_briefly

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="asyncrl actors. Without a command: one rollout actor (rl-actor --redis URL --run NAME).",
)

RunOpt = Annotated[str, typer.Option(help="Run name.")]


IdOpt = Annotated[str | None, typer.Option("--id", help="Process id in the registry (default: KIND-HOST-PID).")]


@app.callback(invoke_without_command=True)
def rollout(
    ctx: typer.Context, redis: RedisOpt = None, redis_file: RedisFileOpt = None, run: RunOpt = "demo", id_: IdOpt = None
) -> None:
    """Without a command: run one rollout actor (vLLM) for the run until SIGTERM.

    It needs only the run's Redis and name: the config, the current weights and the prompt
    groups all come from the run. SIGTERM gives its unfinished groups back to the queue.
    """
    if ctx.invoked_subcommand is not None:
        return
    from asyncrl.actors.engine import EngineSettingsError
    from asyncrl.actors.engine_checks import check_installed_engine
    from asyncrl.actors.rollout import run_actor
    from asyncrl.cli.util import fail, redis_url

    url = redis_url(redis, run, url_file=redis_file)
    config = _read_run_config(url, run)
    _exit_if_finished(url, run, "actor")
    try:
        check_installed_engine(config)
    except EngineSettingsError as exc:
        fail(str(exc))
    raise typer.Exit(run_actor(config, url, id_))


@app.command("show-config")
def show_config(redis: RedisOpt = None, redis_file: RedisFileOpt = None, run: RunOpt = "demo") -> None:
    """Print the run config this process would work from, read from the run's Redis."""
    from asyncrl.cli.util import redis_url

    print(_read_run_config(redis_url(redis, run, url_file=redis_file), run).to_json())


@app.command("reward")
def reward(
    redis: RedisOpt = None,
    redis_file: RedisFileOpt = None,
    run: RunOpt = "demo",
    id_: IdOpt = None,
) -> None:
    """Score rollout groups with the run's reward functions and write them to the replay stream, until SIGTERM."""
    import os
    import socket

    import zmq

    from asyncrl.actors.reward_worker import RewardWorker, run_until_stopped
    from asyncrl.cli.util import fail, redis_url
    from asyncrl.common.environments.protocol import EnvironmentFailed
    from asyncrl.common.transport.channel import InsecureBindError

    url = redis_url(redis, run, url_file=redis_file)
    config = _read_run_config(url, run)
    _exit_if_finished(url, run, "reward worker")
    worker_id = id_ or f"reward-{socket.gethostname()}-{os.getpid()}"
    try:
        worker = RewardWorker(config, url, worker_id)
        code = run_until_stopped(worker)
    except (ValueError, InsecureBindError, zmq.ZMQError, EnvironmentFailed) as exc:  # unknown function, no CURVE
        fail(str(exc))  # keys, port in use, an environment process that cannot start
    raise typer.Exit(code)


@app.command("eval")
def eval_command(
    config: Annotated[Path | None, typer.Argument(help="Run config (TOML) with an eval section.")] = None,
    checkpoint: Annotated[
        str, typer.Option(help="An HF model folder, or a checkpoint folder (step-<N>) whose hf/ export is loaded.")
    ] = "",
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts).")] = False,
    samples: Annotated[
        Path | None, typer.Option(help="Write each response here as a JSON line: prompt, response, reward.")
    ] = None,
) -> None:
    """Evaluate a saved policy offline on the run's eval set (one vLLM engine in this process, the run's reward
    functions): pass@k, mean@k, accuracy. Without --checkpoint: model.path. 'latest': use rl-learner eval."""
    import json

    from asyncrl.actors.evaluate import evaluate
    from asyncrl.cli.util import fail, load

    resolved = load(config, set_)
    if checkpoint == "latest":
        fail(
            "--checkpoint latest is resolved by the learner, which owns checkpoints: rl-learner eval CONFIG "
            "--checkpoint latest (or pass a step-<N> folder)"
        )
    try:
        figures = evaluate(resolved, checkpoint or resolved.model.path, samples)
    except ValueError as exc:  # no model there, a bad held-out file (TaskFileError), an unknown reward function
        fail(str(exc))
    if as_json:
        print(json.dumps(figures))
        return
    k = int(figures["eval/k"])
    print(
        f"eval of {figures['model']}: {int(figures['eval/groups'])} prompts, k = {k}: "
        f"pass@{k} {figures.get('eval/pass@k', 0.0):.3f}  mean@{k} {figures.get('eval/mean@k', 0.0):.3f}  "
        f"accuracy {figures.get('eval/accuracy', 0.0):.3f}  tokens {figures.get('eval/response_tokens', 0):.1f}"
    )


@app.command("check-model")
def check_model_command(
    config: Annotated[Path | None, typer.Argument(help="Run config (TOML).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value.")] = None,
    prompt_ids: Annotated[
        str, typer.Option(help="The prompt's token ids, comma-separated (rl-learner check-model gives the task's).")
    ] = "0",
) -> None:
    """Build the run's vLLM engine with its settings in this process and sample one token for the prompt; print one
    JSON object (the token, its text, the seconds), or exit 2 with one line. rl-learner check-model runs this."""
    import asyncio
    import json
    import sys
    import time

    from asyncrl.actors.engine import EngineSettingsError, RolloutEngine, error_line
    from asyncrl.actors.engine_checks import check_installed_engine
    from asyncrl.cli.util import fail, load

    resolved = load(config, set_)
    try:
        check_installed_engine(resolved)
        ids = [int(i) for i in prompt_ids.split(",")]
    except (EngineSettingsError, ValueError) as exc:
        fail(str(exc))
    started = time.perf_counter()
    try:
        engine = RolloutEngine(resolved, resolved.run.seed)
    except Exception as exc:  # vLLM's own refusal: its first line says which setting
        fail(f"model.path: vLLM could not build an engine for {resolved.model.path}: {error_line(exc)}")
    try:
        built = time.perf_counter()
        response = asyncio.run(engine.first_token(ids))
    except Exception as exc:
        time.sleep(2.0)  # vLLM's engine core writes its traceback after its frontend has learnt it died: let it
        print(file=sys.stderr)  # and its last line may lack a newline: the error line starts a line of its own
        fail(f"model.path: vLLM built the engine but could not generate one token: {error_line(exc)}")
    finally:
        engine.shutdown()
    figures = {"token_id": response.token_ids[0], "text": response.text, "finish_reason": response.finish_reason}
    print(json.dumps(figures | {"engine_s": built - started, "token_s": time.perf_counter() - built}))


def _read_run_config(url: str, run: str):
    """The run's config from Redis with the run's log level set, or a clear exit 2."""
    import redis.exceptions as redis_errors

    from asyncrl.cli.util import fail
    from asyncrl.common.config import ConfigError, with_host_keys
    from asyncrl.common.observability.logs import configure
    from asyncrl.common.plane.control import ControlPlane
    from asyncrl.common.plane.keys import connect
    from asyncrl.common.plane.run_record import RunNotFoundError

    try:
        config = ControlPlane(connect(url), run).run.read_config()
    except (RunNotFoundError, ConfigError) as exc:
        fail(str(exc))
    except redis_errors.ConnectionError as exc:
        fail(f"cannot reach Redis at {url.split('@')[-1]}: {exc}")
    configure(config.monitoring.log_level)
    return with_host_keys(config)


def _exit_if_finished(url: str, run: str, who: str) -> None:
    """Exit 0 at once, saying so, when the run has finished: an actor restarted after the end (a Kubernetes pod, a
    supervisor) must not build its engine for nothing."""
    from asyncrl.common.plane.control import ControlPlane
    from asyncrl.common.plane.keys import connect

    if (step := ControlPlane(connect(url), run).run.finished()) is not None:
        typer.echo(f"run {run!r} finished at step {step}: the {who} has nothing to do", err=True)
        raise typer.Exit(0)


listed_briefly(app)  # every command is defined by now


def main() -> None:
    from asyncrl.common.openmp import passive_waits

    passive_waits()  # before torch loads OpenMP; vLLM's engine processes inherit it (common/openmp.py)
    # vLLM logs to stdout unless told otherwise: a command's stdout is its result (eval's figures, check-model's JSON)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    app()


if __name__ == "__main__":
    main()
