"""Stability study: asynchronous runs (staleness 1, 2 and 4) against synchronous ones, over seeds and
off-policy corrections, on one of the peer benchmark's tasks and its warm model.

Each configuration trains the same warm model once per seed (``run.seed``: prompt order and sampling), with the
peer benchmark's task settings, process split and evaluation (``bench/peer.py``: its ``TASKS``; greedy accuracy on
64 held-out prompts every ``--eval-every`` steps). The default task is the demo's (``arithmetic``: one-digit sums,
``rl-learner init-model configs/demo.toml --warm-steps 120`` leaves it at partial skill; the demo's own cold model
learns too little in a short run to show a collapse); ``--task long-tail`` runs it on counting with heavy-tailed
answer lengths, ``--model`` reuses a warm model.

    python bench/stability.py [--task arithmetic] [--model PATH] [--seeds 1,2,3] [--steps 60]
                              [--configs sync,async1-guard,async2-guard,async4-guard,...]

Per configuration: collapses (runs whose last two evaluations are both more than ``COLLAPSE_DROP`` below their
step-0 accuracy), median seconds to the threshold (runs that never reach it count as not reached), mean final
accuracy, mean and max of the step mismatch KL(μ ‖ π_old) and the fraction of sequences the guard dropped.
The last line of stdout is one JSON object with every run's figures; the table goes to stderr. A benchmark:
nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.peer import TASKS, init_model, rounded, run_asyncrl, say

NO_GUARD = ("staleness.max_sequence_kl=0", "staleness.veto=0")
CONFIGS: dict[str, tuple[int, tuple[str, ...]]] = {
    "sync": (0, NO_GUARD),
    "async1": (1, NO_GUARD),
    "async2": (2, NO_GUARD),
    "async1-none": (1, ("staleness.correction=none", *NO_GUARD)),
    "async2-none": (2, ("staleness.correction=none", *NO_GUARD)),
    "async4-none": (4, ("staleness.correction=none", *NO_GUARD)),
    "async1-mask": (1, ("staleness.correction=mask", *NO_GUARD)),
    "async1-sequence": (1, ("staleness.level=sequence", *NO_GUARD)),
    "async1-guard": (1, ()),
    "async2-guard": (2, ()),
    "async4-guard": (4, ()),
    "async1-decoupled": (1, ("staleness.behaviour_clip=false",)),
    "async2-decoupled": (2, ("staleness.behaviour_clip=false",)),
    "async4-decoupled": (4, ("staleness.behaviour_clip=false",)),
}
"""name -> (max_staleness, overrides) over the [staleness] defaults: token truncation at 2, the behaviour clip, the
mismatch guard at 0.5 and the token veto at 1e-4 (the ``-guard`` configurations; ``-decoupled``: the defaults without
the behaviour clip, PPO's clip around π_old only; the others turn the guard and the veto off)."""
COLLAPSE_DROP = 0.1
"""A run collapsed when its last two evaluations are both this far below its step-0 accuracy."""


def collapsed(accuracy: dict[str, float]) -> bool:
    steps = sorted(accuracy, key=int)
    start, last_two = accuracy[steps[0]], [accuracy[s] for s in steps[-2:]]
    return all(a < start - COLLAPSE_DROP for a in last_two)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    reached = [r for r in runs if r["time_to_accuracy_s"] is not None]
    return {
        "runs": len(runs),
        "collapses": sum(collapsed(r["accuracy"]) for r in runs),
        "reached": len(reached),
        "time_to_accuracy_median_s": statistics.median(r["time_to_accuracy_s"] for r in reached) if reached else None,
        # a run that never reached it counts as steps + 1 here, so the median says "not reached" when most did not
        "steps_to_accuracy_median": statistics.median(r["steps_to_accuracy"] or r["steps"] + 1 for r in runs),
        "steps_to_accuracy": [r["steps_to_accuracy"] for r in runs],
        "final_accuracy_mean": statistics.mean(r["final_accuracy"] for r in runs),
        "s_per_step_mean": statistics.mean(r["s_per_step"] for r in runs),
        "mismatch_kl_mean": statistics.mean(r["mismatch_kl_mean"] for r in runs),
        "mismatch_kl_max": max(r["mismatch_kl_max"] for r in runs),
        "dropped_frac_mean": statistics.mean(r["dropped_frac_mean"] for r in runs),
    }


def table(results: dict[str, dict[str, Any]], threshold: float) -> str:
    head = (
        f"| config | collapses | reached {threshold} | steps to {threshold}, each seed | median s to {threshold} "
        "| final accuracy | s/step | mismatch KL mean / max | dropped |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        t = r["time_to_accuracy_median_s"]
        lines.append(
            f"| {name} | {r['collapses']}/{r['runs']} | {r['reached']}/{r['runs']} | "
            f"{' / '.join('—' if s is None else str(s) for s in r['steps_to_accuracy'])} | "
            f"{'—' if t is None else f'{t:.1f}'} | {r['final_accuracy_mean']:.3f} | {r['s_per_step_mean']:.3f} | "
            f"{r['mismatch_kl_mean']:.2e} / {r['mismatch_kl_max']:.2e} | {r['dropped_frac_mean']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--threshold", type=float, help="accuracy to time (default: the task's in bench/peer.py)")
    parser.add_argument("--task", default="arithmetic", choices=list(TASKS), help="a task of bench/peer.py")
    parser.add_argument("--model", type=Path, help="a warm model folder for the task (default: warm-start one)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--warm-steps", type=int, help="supervised warm start (default: the task's)")
    parser.add_argument("--lr", type=float, help="learning rate of every run (default: the config's, 3e-4)")
    parser.add_argument("--set", action="append", default=[], help="a config override of every run")
    parser.add_argument("--keep", type=Path, help="keep the runs' folders (logs, metrics) here")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.configs.split(",")
    spec = TASKS[args.task]
    threshold = spec.threshold if args.threshold is None else args.threshold
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = args.keep or Path(tmp_name)
        model = args.model
        if model is None:
            model = tmp / "model"
            init_model(model, list(spec.overrides), args.warm_steps or spec.warm_steps, spec)
        base = [
            *spec.overrides,
            f"model.path={model.resolve()}",
            f"learner.steps={args.steps}",
            f"eval.every={args.eval_every}",
            "eval.limit=64",
            "eval.temperature=0",
            "eval.num_samples=1",
            *([f"learner.lr={args.lr}"] if args.lr is not None else []),
            *args.set,
        ]
        for seed in seeds:  # seeds outermost: a config's runs are spread over the whole study's load
            for name in names:
                staleness, study = CONFIGS[name]
                say(f"[stability] {name} seed {seed} ...")
                run = f"{name}-seed-{seed}"
                overrides = [*base, f"run.seed={seed}", *study]
                figures = run_asyncrl(tmp, overrides, staleness, threshold, run, config_file=spec.config)
                runs[name].append(figures | {"seed": seed})
    results = {name: summary(r) for name, r in runs.items()}
    say(table(results, threshold))
    print(
        json.dumps(
            rounded(
                {
                    "bench": "stability",
                    "task": args.task,
                    "steps": args.steps,
                    "seeds": seeds,
                    "threshold": threshold,
                    "collapse_drop": COLLAPSE_DROP,
                    "configs": {n: {"overrides": list(CONFIGS[n][1]), **results[n]} for n in names},
                    "runs": runs,
                }
            )
        )
    )


if __name__ == "__main__":
    main()
