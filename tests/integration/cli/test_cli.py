"""The console scripts, run as a user runs them: separate processes, real Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.wire.messages import Heartbeat
from tests.helpers.waits import wait_for

BIN = Path(sys.executable).parent
HEAVY = {"torch", "vllm", "deepspeed", "transformers", "redis", "zmq", "numpy"}


def run(*args: str, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize("script", ["rl-learner", "rl-actor", "rl-launch", "rl-top"])
def test_every_console_script_answers_help(script: str) -> None:
    assert "Usage" in run(str(BIN / script), "--help").stdout


def test_help_imports_no_heavy_library() -> None:
    """--help stays fast because the CLIs import torch, vLLM, DeepSpeed, Redis... only inside commands."""
    code = (
        "import sys, asyncrl.cli.learner, asyncrl.cli.actor, asyncrl.cli.launch, asyncrl.cli.top; "
        f"print(sorted(set({sorted(HEAVY)!r}) & set(m.split('.')[0] for m in sys.modules)))"
    )
    assert run(sys.executable, "-c", code).stdout.strip() == "[]"


def test_resolved_config_reaches_an_actor_that_knows_only_redis_and_run(tmp_path: Path, redis_server) -> None:
    run(
        str(BIN / "rl-learner"),
        "resolve",
        "--set",
        f"run.root={tmp_path}",
        "--set",
        "run.name=cli",
        "--set",
        "learner.lr=0.125",
        "--redis",
        redis_server.url,
    )
    written = json.loads((tmp_path / "cli" / "config.json").read_text())
    seen = json.loads(run(str(BIN / "rl-actor"), "show-config", "--redis", redis_server.url, "--run", "cli").stdout)
    assert seen == written and seen["learner"]["lr"] == 0.125


def test_invalid_override_exits_with_the_field_named(tmp_path: Path) -> None:
    result = run(str(BIN / "rl-learner"), "resolve", "--set", "learner.zero_stage=7", "--dry-run", check=False)
    assert result.returncode == 2
    assert "learner.zero_stage: Input should be 0, 1, 2 or 3 (got 7)" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_value_out_of_bounds_in_a_config_file_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[learner]\nlr = inf\n")
    done = run(str(BIN / "rl-learner"), "resolve", "--dry-run", str(config), check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"error: {config}: learner.lr: inf is not a finite number; give a finite value\n"


def test_an_option_typo_exits_2_before_anything_starts(tmp_path: Path) -> None:
    """``loss_options={clip_hgh=0.3}`` passed ``resolve`` and failed in ``train`` after DeepSpeed started."""
    typo = ["--set", "algorithm.loss_options={clip_hgh=0.3}", "--set", f"run.root={tmp_path}"]
    for command in (["resolve", "--dry-run"], ["train"]):
        result = run(str(BIN / "rl-learner"), *command, *typo, check=False)
        assert result.returncode == 2, result.stderr
        assert "policy loss 'ppo_clip': unknown option(s) 'clip_hgh'; allowed: " in result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "demo").exists()  # train wrote nothing and started no Redis


def test_actor_on_an_unknown_run_says_what_to_do(redis_server) -> None:
    result = run(str(BIN / "rl-actor"), "show-config", "--redis", redis_server.url, "--run", "nope", check=False)
    assert result.returncode == 2 and "start `rl-learner` for it first" in result.stderr


def test_launch_serves_redis_until_interrupted_and_top_shows_the_run(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [str(BIN / "rl-launch"), "redis", "--set", f"run.root={tmp_path}", "--set", "run.name=live"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url_file = tmp_path / "live" / "redis" / "url"
        deadline = time.monotonic() + 60  # for both: the url file, then the config published just after it
        url = wait_for(lambda: url_file.read_text().strip(), "redis url file", proc=proc, timeout_s=60, poll_s=0.1)
        plane = ControlPlane(connect(url), "live")
        left_s = deadline - time.monotonic()
        wait_for(lambda: plane.client.exists(plane.keys.config), "published config", timeout_s=left_s, poll_s=0.1)
        assert plane.run.read_config().run.name == "live"
        actor = Heartbeat(process_id="actor-x", kind="actor", state="generating", tokens_per_s=321)
        plane.registry.beat(actor, ttl_s=30)
        screen = run(str(BIN / "rl-top"), "--run", "live", "--root", str(tmp_path), "--once").stdout
        assert "actor-x" in screen and "generating" in screen and "321" in screen
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert not url_file.with_name("server.lock").exists() or _unlocked(url_file.with_name("server.lock"))
    finally:
        if proc.poll() is None:  # a failed assertion: stop it as a user would, so it stops its redis-server too
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _unlocked(lock: Path) -> bool:
    import fcntl

    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_docs_config_reference_is_current() -> None:
    docs = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    table = run(str(BIN / "rl-learner"), "fields", "--markdown").stdout.strip()
    between = docs.split("<!-- config-reference:", 1)[1].split("\n", 1)[1].split("<!-- /config-reference -->")[0]
    assert between.strip() == table, "docs/configuration.md's reference is stale: paste `rl-learner fields --markdown`"
