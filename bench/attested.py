"""What scoring on the reward workers' signatures costs against scoring by replay: the agent preset run twice on the
same model, data and settings, its environments on the reward workers (``environment.isolation = "workers"``), once
with the built-in ``calculator`` (replayable: each episode is scored by replaying it) and once with the same
calculator declared ``replayable = False`` (:class:`SignedCalculator`: each step's answer is signed by the worker that
ran it and the scoring worker checks the signatures instead of replaying).

    python bench/attested.py [--steps 20] [--warm-steps 600] [--out DIR]

Both runs answer every turn the same (the calculator is deterministic), so the difference is the scoring path alone:
a replay's environment made again and stepped, against one Ed25519 signature made per step and per score on the
worker that ran the episode and checked on the one that scores it. The table goes to stderr; the last line of stdout
is one JSON object with every figure (ratios signed / replayed). A benchmark: nothing here asserts anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.common.environments.protocol import Calculator

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODES = {"replayed": "calculator", "signed": "bench.attested:SignedCalculator"}


class SignedCalculator(Calculator):
    """The built-in calculator, declared not replayable: scored on its workers' signatures."""

    replayable = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm-steps", type=int, default=600)
    parser.add_argument("--out", type=Path, default=None, help="where the model and the runs go (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="asyncrl-attested-"))
    config, model = ROOT / "configs/agent.toml", out / "tiny-agent"
    if not (model / "config.json").exists():
        init = [BIN / "rl-learner", "init-model", config, "--kind", "agent", "--set", f"model.path={model}"]
        subprocess.run([*init, "--warm-steps", str(args.warm_steps), "--threads", "2", "--force"], check=True)
    figures = {mode: run(config, model, out, mode, environment, args.steps) for mode, environment in MODES.items()}
    for key in ("step_s_median", "step_s_mean", "run_s"):
        figures[f"{key}_ratio"] = round(figures["signed"][key] / figures["replayed"][key], 3)
    for mode in MODES:
        print(f"{mode:>9}: {json.dumps(figures[mode])}", file=sys.stderr)
    print(json.dumps(figures))


def run(config: Path, model: Path, out: Path, mode: str, environment: str, steps: int) -> dict:
    """One run of the agent preset with ``environment`` on the reward workers; its step times and what it refused."""
    settings = [
        f"run.root={out}", f"run.name={mode}", f"model.path={model}", f"learner.steps={steps}", "eval.every=0",
        "environment.isolation=workers", f"environment.name={environment}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    launch = [BIN / "rl-launch", "run", config, *(arg for s in settings for arg in ("--set", s))]
    started = time.perf_counter()
    subprocess.run(launch, check=True, cwd=ROOT, env=env)
    run_s = time.perf_counter() - started
    rows = [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["step/seconds"] for r in rows if "step/seconds" in r][1:]  # the first step waits for the engine
    return {
        "steps": len(seconds) + 1,
        "step_s_median": round(statistics.median(seconds), 3),
        "step_s_mean": round(statistics.fmean(seconds), 3),
        "run_s": round(run_s, 1),
        "reward_mean": round(statistics.fmean(r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r), 3),
        "groups_dead_lettered": sum(_dead_lettered(log) for log in (out / mode / "logs").glob("reward*.log")),
    }


def _dead_lettered(log: Path) -> int:
    """Groups a reward worker could not score (its log says so once per group)."""
    return log.read_text().count("dead-lettered a rollout group that could not be scored")


if __name__ == "__main__":
    main()
