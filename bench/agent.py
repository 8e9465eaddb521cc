"""The agent preset's run, measured: what a multi-turn run with a tool learns, and the shape of its episodes.

Makes the tiny tool-chat model (``rl-learner init-model configs/agent.toml --kind agent``) and runs
``rl-launch run configs/agent.toml`` with every step's episodes sampled into samples.jsonl, then reads what the run
left: the reward and tool calls per episode over the steps, the held-out evaluations, and the distribution of the
episodes' lengths (tokens after the prompt, model turns) at the start and at the end of the run.

    python bench/agent.py [--steps 40] [--warm-steps 600] [--actors 1] [--out DIR]

The table goes to stderr; the last line of stdout is one JSON object with every figure. A benchmark: nothing here
asserts anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SAMPLED_PER_STEP = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warm-steps", type=int, default=600)
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="where the model and the run go (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="asyncrl-agent-"))
    config, model = ROOT / "configs/agent.toml", out / "tiny-agent"
    started = time.perf_counter()
    init = [BIN / "rl-learner", "init-model", config, "--kind", "agent", "--set", f"model.path={model}"]
    subprocess.run([*init, "--warm-steps", str(args.warm_steps), "--force"], check=True)
    warm_s = time.perf_counter() - started
    settings = [
        f"run.root={out}",
        "run.name=agent",
        f"model.path={model}",
        f"learner.steps={args.steps}",
        f"eval.every={args.steps // 2}",
        "monitoring.samples_every=1",
        f"monitoring.samples_per_step={SAMPLED_PER_STEP}",
    ]
    launch = [BIN / "rl-launch", "run", config, "--actors", str(args.actors)]
    started = time.perf_counter()
    subprocess.run([*launch, *(arg for s in settings for arg in ("--set", s))], check=True, cwd=ROOT)
    figures = {"warm_start_s": round(warm_s, 1), "run_s": round(time.perf_counter() - started, 1)}
    figures |= read_run(out / "agent")
    print_table(figures)
    print(json.dumps(figures))


def read_run(run_dir: Path) -> dict:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "eval/step" not in r]
    evals = {int(r["eval/step"]): round(r["eval/pass@k"], 3) for r in lines if "eval/step" in r}
    fifth = max(1, len(steps) // 5)
    curve = {
        key: [
            round(statistics.fmean(r[f"rollout/{key}"] for r in steps[i : i + fifth]), 3)
            for i in range(0, len(steps), fifth)
        ]
        for key in ("reward_mean", "episode_tool_calls_mean", "episode_turns_mean", "episode_malformed_calls_mean")
    }
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    drawn = [s for s in samples if s["pick"] == "random"]
    first = [s for s in drawn if s["step"] <= fifth]
    last = [s for s in drawn if s["step"] > len(steps) - fifth]
    return {
        "steps": len(steps),
        "per_fifth_of_the_run": curve,
        "eval_pass@1_by_step": evals,
        "episodes_first_fifth": shape(first),
        "episodes_last_fifth": shape(last),
        "step_s_median": round(statistics.median(r["step/seconds"] for r in steps), 2),
    }


def shape(episodes: list[dict]) -> dict:
    """Tokens after the prompt (percentiles) and model turns (counts) of sampled episodes."""
    tokens = sorted(s["tokens"] for s in episodes)
    turns = [sum(t["by"] == "model" for t in s["turns"]) for s in episodes]

    def at(q: float) -> int:
        return tokens[min(len(tokens) - 1, int(q * len(tokens)))]

    return {
        "episodes": len(episodes),
        "tokens_p10_p50_p90_max": [at(0.1), at(0.5), at(0.9), tokens[-1]],
        "model_turns": {n: turns.count(n) for n in sorted(set(turns))},
        "reward_mean": round(statistics.fmean(s["reward"] for s in episodes), 3),
    }


def print_table(figures: dict) -> None:
    say = lambda text: print(text, file=sys.stderr)  # noqa: E731
    say(f"warm start {figures['warm_start_s']} s, run {figures['run_s']} s ({figures['steps']} steps)")
    for key, values in figures["per_fifth_of_the_run"].items():
        say(f"  {key:32} " + "  ".join(f"{v:.3f}" for v in values))
    say(f"  eval pass@1 by step            {figures['eval_pass@1_by_step']}")
    for part in ("episodes_first_fifth", "episodes_last_fifth"):
        say(f"  {part:32} {figures[part]}")


if __name__ == "__main__":
    main()
