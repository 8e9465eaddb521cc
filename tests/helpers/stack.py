"""The system under test as a user starts it: ``rl-launch run`` whole (:func:`launch`, :func:`finish`), or its
processes one by one as a person would on a cluster (:class:`Processes`), and what a run leaves (:func:`metrics`,
:func:`_steps`). Shared by the e2e tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from tests.helpers import waits
from tests.helpers.runs import step_rows

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DEMO = ROOT / "configs/demo.toml"
ONE_PROCESS_ENGINE = "rollout.cpu_single_process=true"
"""vLLM's one-process layout (the model worker inside the engine core) for the actors of every e2e run but the demo's:
one Python process fewer importing vLLM, so an engine is up in about 20 s instead of 30 on this machine. The demo run
(``tests/e2e/test_system.py``) keeps the default layout, and ``tests/integration/actors/test_rollout_actor.py`` checks
both."""


def launch(
    tmp_path: Path,
    model_dir: Path,
    name: str,
    *overrides: str,
    config: Path | None = None,
    actors: int = 2,
    stderr: Path | None = None,
) -> subprocess.Popen:
    """``rl-launch run`` of the run ``name`` under ``tmp_path``; what it prints to stderr goes to the file ``stderr``
    when given (else to the test's)."""
    args = [
        BIN / "rl-launch",
        "run",
        config or ROOT / "configs/demo.toml",
        "--actors",
        str(actors),
        "--set",
        f"run.root={tmp_path}",
        "--set",
        f"run.name={name}",
        "--set",
        f"model.path={model_dir}",
    ]
    for override in ("eval.every=0", *overrides):  # the demo's eval rounds: tests/e2e/test_eval.py's
        args += ["--set", override]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    if stderr is None:
        return subprocess.Popen(args, cwd=ROOT, env=env)
    with stderr.open("w") as sink:  # the child keeps its own copy
        return subprocess.Popen(args, cwd=ROOT, env=env, stderr=sink)


def finish(proc: subprocess.Popen, timeout_s: float = 1200) -> int:
    try:
        return proc.wait(timeout_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the launcher stops its children and its Redis
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()


def metrics(tmp_path: Path, name: str) -> list[dict]:
    """The training steps' rows (the demo's eval rounds are checked in tests/e2e/test_eval.py)."""
    return step_rows(tmp_path / name)


class Processes:
    """The processes this test started, each the leader of its own session; stopped by PID (and its session)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(
        self, name: str, cmd: list, env: dict[str, str] | None = None, cpus: set[int] | None = None
    ) -> subprocess.Popen:
        """``cmd`` as the process ``name``, logging to ``<log_dir>/<name>.log``; on the CPUs ``cpus`` when given."""
        log = (self.log_dir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "DS_ACCELERATOR": "cpu", **(env or {})},
            start_new_session=True,  # its own children (vLLM's engine) share its session: ended with it
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        self.procs[name] = proc
        return proc

    def start_run(self, config: Path, sets: list[str], run_dir: Path) -> list[str]:
        """``rl-launch redis`` for the run, then a reward worker (``reward-0``); returns ``--redis URL --run NAME``.
        The worker starts once the config is published (the URL file is written before it)."""
        self.start("redis", [BIN / "rl-launch", "redis", config, *sets])
        url = _wait(lambda: (run_dir / "redis" / "url").read_text().strip(), "redis", self.procs["redis"])
        plane = ControlPlane(connect(url), run_dir.name)
        _wait(lambda: plane.client.exists(plane.keys.config), "the published config", self.procs["redis"])
        run_args = ["--redis", url, "--run", run_dir.name]
        self.start("reward", [BIN / "rl-actor", "reward", *run_args, "--id", "reward-0"])
        return run_args

    def start_actor(self, name: str, run_args: list[str], core: int, env: dict[str, str] | None = None):
        """``rl-actor`` as ``name`` on the CPU ``core``: in the :data:`ONE_PROCESS_ENGINE` layout its engine inherits
        the actor's CPUs, so the engine keeps off the other core."""
        return self.start(name, [BIN / "rl-actor", *run_args, "--id", name], env, cpus={core})

    def start_demo(self, run_dir: Path, model: Path, *overrides: str) -> tuple[list[str], list[str]]:
        """:meth:`start_run` for configs/demo.toml as run ``run_dir`` on the model folder ``model`` with
        ``overrides``; returns the learner's ``--set`` arguments and ``--redis URL --run NAME``."""
        run = [f"run.root={run_dir.parent}", f"run.name={run_dir.name}", f"model.path={model}", "eval.every=0"]
        run.append(ONE_PROCESS_ENGINE)
        run += overrides  # eval rounds off: tests/e2e/test_eval.py's
        sets = [arg for override in run for arg in ("--set", override)]
        return sets, self.start_run(DEMO, sets, run_dir)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 90) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the session this child led
        return proc.returncode

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):  # learner and actors first, Redis last
            self.stop(name, signal.SIGINT if name == "redis" else signal.SIGTERM)


def _wait(condition, what: str, proc: subprocess.Popen | None = None, timeout_s: float = 600, poll_s: float = 0.05):
    """:func:`tests.helpers.waits.wait_for` with the e2e callers' argument order and their 600 s default."""
    return waits.wait_for(condition, what, proc=proc, timeout_s=timeout_s, poll_s=poll_s)


def _steps(run_dir: Path) -> list[int]:
    return [int(row["step"]) for row in step_rows(run_dir)]


def actor_pid(log: Path) -> int:
    """An actor's PID from its own log line ('actor ready ... pid=N')."""
    for line in log.read_text().splitlines():
        if "actor ready" in line:
            return int(line.split("pid=")[1].split(":")[0])
    raise AssertionError(f"no 'actor ready' line in {log}")


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
