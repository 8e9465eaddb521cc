"""Soak: the demo's stack for hours, with faults on a schedule, watched for leaks and for lost or twice-trained groups.

    python bench/soak.py [--minutes 60] [--fault-every 300] [--sample-every 30] [--out DIR]

The processes are started one by one as on a cluster (tests/helpers/stack.py: ``Processes``): ``rl-launch redis``, a
reward worker, one rollout actor on core 1 and ``rl-learner train`` on configs/demo.toml (its warm model, no eval
rounds, a checkpoint every ``--checkpoint-every`` steps, as many steps as the time allows). Every ``--fault-every``
seconds one fault, in turn:

1. ``kill -9`` of the actor (a new one is started 5 s later, as a Deployment would);
2. ``kill -9`` of the reward worker (a new one 5 s later);
3. ``kill -9`` of the redis-server (``rl-launch redis`` exits 1 and is started again on the same folder; every other
   process rides the outage out within ``transport.redis_outage_s``);
4. ``kill -9`` of the learner, as when its host dies (started again with ``--resume latest``).

Every ``--sample-every`` seconds the resident memory of each role (the process and its descendants: an actor's vLLM
engine, the redis-server under ``rl-launch redis``) is read. At the end the learner is stopped with SIGTERM (its step
finishes and is saved) and the group ledger is read from Redis (tests/helpers/accounting.py: ``group_ledger``).

Reported per role: resident MiB at its first sample past the warm-up and at the end, and the slope in MiB per hour of
its longest-lived incarnation (least squares over that incarnation's samples past ``WARM_UP_S``); per fault, the
seconds until the learner's next step; steps per hour; the ledger (issued = trained + discarded + lost + in flight;
lost and trained twice should be 0) and any process that exited without being told to. The table goes to stderr, one
JSON object is the last line of stdout. A benchmark: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.common.config import load_config
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from tests.helpers.accounting import group_ledger
from tests.helpers.runs import step_rows
from tests.helpers.stack import BIN, DEMO, Processes
from tests.helpers.waits import wait_for

FAULTS = ("actor", "reward", "redis", "learner")
ROLES = ("learner", "actor", "reward", "redis")
WARM_UP_S = 120.0
"""Samples of an incarnation's first two minutes (imports, engine start, the first compilations) are left out of its
slope."""
GROUPS_PER_STEP = load_config(DEMO, []).learner.groups_per_step


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


@dataclass
class Soak:
    """One soak run: its processes by role (the current incarnation's name in ``procs``), their memory samples
    ``(time, pid, bytes)`` by role, the faults done ``(kind, time)``, and exits nobody asked for."""

    root: Path
    procs: Processes
    sets: list[str]
    run_args: list[str] = field(default_factory=list)
    current: dict[str, str] = field(default_factory=dict)
    started: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[tuple[float, int, int]]] = field(default_factory=lambda: {r: [] for r in ROLES})
    faults: list[tuple[str, float]] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.root / "soak"

    def start(self, role: str, *extra: str) -> None:
        """A new incarnation of ``role`` (``actor-3``, ``learner-2``, …), logging to ``logs/<name>.log``."""
        self.started[role] = self.started.get(role, 0) + 1
        name = f"{role}-{self.started[role]}"
        if role == "redis":
            self.procs.start(name, [BIN / "rl-launch", "redis", DEMO, *self.sets])
        elif role == "reward":
            self.procs.start(name, [BIN / "rl-actor", "reward", *self.run_args, "--id", name])
        elif role == "actor":
            self.procs.start_actor(name, self.run_args, core=1)
        else:
            self.procs.start(name, [BIN / "rl-learner", "train", DEMO, *self.sets, *self.run_args[:2], *extra])
        self.current[role] = name

    def proc(self, role: str) -> subprocess.Popen:
        return self.procs.procs[self.current[role]]

    def plane(self) -> ControlPlane:
        return ControlPlane(connect(self.run_args[1]), self.run_dir.name)

    def sample(self) -> None:
        """Each role's resident bytes now: its process and every descendant."""
        now = time.time()
        for role in self.current:
            proc = self.proc(role)
            try:
                tree = psutil.Process(proc.pid)
                rss = sum(p.memory_info().rss for p in [tree, *tree.children(recursive=True)])
            except psutil.Error:
                continue
            self.samples[role].append((now, proc.pid, rss))

    def check_alive(self) -> None:
        """A process that exited without being told to is noted with its log's last line and started again (the
        learner with ``--resume latest``)."""
        for role in list(self.current):
            code = self.proc(role).poll()
            if code is None:
                continue
            name = self.current[role]
            last = (self.procs.log(name).strip().splitlines() or [""])[-1]
            self.unexpected.append(f"{name} exited {code}: {last[-300:]}")
            say(f"  unexpected: {self.unexpected[-1]}")
            self.procs.stop(name)
            self.start(role, *(["--resume", "latest"] if role == "learner" else []))

    def fault(self, kind: str) -> None:
        say(f"{time.strftime('%H:%M:%S')} fault: kill -9 of the {kind}")
        self.faults.append((kind, time.time()))
        if kind == "redis":
            os.kill(int((self.run_dir / "redis" / "server.lock").read_text()), signal.SIGKILL)
            self.proc("redis").wait(60)  # rl-launch redis says its server died and exits 1
            self.procs.stop(self.current["redis"])
            self.start("redis")
            wait_for(lambda: connect(self.run_args[1]).ping(), "redis again", proc=self.proc("redis"), timeout_s=120)
            return
        os.kill(self.proc(kind).pid, signal.SIGKILL)
        self.procs.stop(self.current[kind], signal.SIGKILL)  # reaped, with what its session left
        if kind != "learner":
            time.sleep(5.0)
        self.start(kind, *(["--resume", "latest"] if kind == "learner" else []))


def memory_figures(samples: list[tuple[float, int, int]]) -> dict[str, float | None]:
    """Resident MiB at the first sample past the warm-up and at the last, and the slope (MiB per hour, least
    squares) of the longest-lived incarnation over its samples past :data:`WARM_UP_S`."""
    by_pid: dict[int, list[tuple[float, int]]] = {}
    for t, pid, rss in samples:
        by_pid.setdefault(pid, []).append((t, rss))
    settled = {pid: [(t, r) for t, r in rows if t - rows[0][0] >= WARM_UP_S] for pid, rows in by_pid.items()}
    longest = max(settled.values(), key=lambda rows: rows[-1][0] - rows[0][0] if len(rows) > 1 else 0, default=[])
    figures: dict[str, float | None] = {"start_mib": None, "end_mib": None, "slope_mib_per_h": None, "fit_minutes": 0}
    first = [rows[0] for rows in settled.values() if rows]
    if first:
        figures["start_mib"] = round(min(first)[1] / 2**20, 1)
    if samples:
        figures["end_mib"] = round(samples[-1][2] / 2**20, 1)
    if len(longest) >= 3:
        t, rss = np.asarray(longest, np.float64).T
        figures["slope_mib_per_h"] = round(float(np.polyfit(t - t[0], rss, 1)[0]) * 3600 / 2**20, 2)
        figures["fit_minutes"] = round((t[-1] - t[0]) / 60, 1)
    return figures


def recoveries(faults: list[tuple[str, float]], step_times: list[float]) -> list[dict]:
    """Per fault, seconds until the learner's next step row after it."""
    out = []
    for kind, at in faults:
        after = [t for t in step_times if t > at]
        out.append({"fault": kind, "next_step_s": round(min(after) - at, 1) if after else None})
    return out


def soak(minutes: float, fault_every: float, sample_every: float, checkpoint_every: int, root: Path) -> dict:
    run_dir = root / "soak"
    model = root / "model"
    init = [BIN / "rl-learner", "init-model", DEMO, "--set", f"model.path={model}", "--warm-steps", "120"]
    subprocess.run(init, check=True, stdout=sys.stderr)
    settings = [
        f"run.root={root}",
        "run.name=soak",
        f"model.path={model}",
        "eval.every=0",
        "rollout.cpu_single_process=true",
        "learner.steps=1000000",
        f"checkpoint.every={checkpoint_every}",
        "checkpoint.keep=2",
    ]
    state = Soak(root, Processes(root / "logs"), [a for s in settings for a in ("--set", s)])
    try:
        state.start("redis")
        wait_for(lambda: (run_dir / "redis" / "url").read_text().strip(), "redis", proc=state.proc("redis"))
        url = (run_dir / "redis" / "url").read_text().strip()
        state.run_args = ["--redis", url, "--run", run_dir.name]
        plane = state.plane()
        wait_for(lambda: plane.client.exists(plane.keys.config), "the published config", proc=state.proc("redis"))
        for role in ("reward", "actor", "learner"):
            state.start(role)
        wait_for(lambda: step_rows(run_dir), "the first step", proc=state.proc("learner"), timeout_s=600)
        began = time.time()
        say(f"{time.strftime('%H:%M:%S')} first step; soaking {minutes} min, a fault every {fault_every} s")
        next_fault, next_sample, turn = began + fault_every, began, 0
        while time.time() - began < minutes * 60:
            now = time.time()
            if now >= next_sample:
                state.sample()
                next_sample += sample_every
            if now >= next_fault:
                state.fault(FAULTS[turn % len(FAULTS)])
                turn += 1
                next_fault = time.time() + fault_every
            state.check_alive()
            time.sleep(1.0)
        state.sample()
        elapsed_h = (time.time() - began) / 3600
        learner = state.proc("learner")
        learner.send_signal(signal.SIGTERM)  # the step finishes and is saved; exit 0
        learner_exit = learner.wait(300)
        rows = step_rows(run_dir)
        ledger, problems = group_ledger(state.plane(), GROUPS_PER_STEP)
    finally:
        state.procs.stop_all()
    last_step = max((int(r["step"]) for r in rows), default=0)
    return {
        "minutes": round(elapsed_h * 60, 1),
        "steps": last_step,
        "steps_per_hour": round(last_step / elapsed_h),
        "learner_exit_on_sigterm": learner_exit,
        "faults": recoveries(state.faults, [float(r["time"]) for r in rows]),
        "memory": {role: memory_figures(state.samples[role]) for role in ROLES},
        "ledger": ledger,
        "ledger_problems": problems,
        "unexpected_exits": state.unexpected,
        "logs": str(root / "logs"),
    }


def table(result: dict) -> None:
    say(f"\nsteps {result['steps']} in {result['minutes']} min: {result['steps_per_hour']} steps/h")
    say(f"{'role':<8} {'start MiB':>10} {'end MiB':>10} {'slope MiB/h':>12} {'fit min':>8}")
    for role, f in result["memory"].items():
        say(f"{role:<8} {f['start_mib']!s:>10} {f['end_mib']!s:>10} {f['slope_mib_per_h']!s:>12} {f['fit_minutes']:>8}")
    say("faults: " + ", ".join(f"{f['fault']} (next step {f['next_step_s']} s)" for f in result["faults"]))
    say(f"ledger: {result['ledger']}; problems: {result['ledger_problems'] or 'none'}")
    say(f"unexpected exits: {result['unexpected_exits'] or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--fault-every", type=float, default=300.0, help="seconds between two faults")
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds between two memory samples")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="checkpoint.every, in steps")
    parser.add_argument("--out", type=Path, help="folder for the run and its logs (a temporary one if not given)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="asyncrl-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    result = soak(args.minutes, args.fault_every, args.sample_every, args.checkpoint_every, root.resolve())
    table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
