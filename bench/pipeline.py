"""Pipelining: the same GRPO run synchronous (max_staleness = 0) and asynchronous (max_staleness = 2).

The asynchronous run twice: with the weight broadcast overlapping the next step (the default) and with the
learner waiting for each broadcast (``weight_sync.overlap = false``).

Both runs use the demo config (tiny model, one-digit addition) for the same number of steps, with the
cores split so that the comparison measures pipelining, not contention (DESIGN.md, "Measuring on a
2-core machine"): the learner on core 0 (one torch thread), the two rollout actors and the reward
worker on core 1. Figures from each run's metrics.jsonl:

- ``wall_s``: from the end of step 1 to the end of the last step (engine start-up excluded);
- ``idle_fraction``: mean share of a step the learner spent waiting for its batch;
- ``final_reward``: mean reward of the last 5 steps;
- ``sync_s_mean``, ``sync_wait_s_mean``: a weight broadcast's seconds, and the seconds the learner waited for it
  (with ``max_staleness`` ≥ 1 the broadcast overlaps the next step).

    python bench/pipeline.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.common.config import load_config
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from asyncrl.common.plane.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def pinned(core: int, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(core), *cmd]


def run(tmp: Path, model: Path, staleness: int, steps: int, overlap: bool = True) -> dict[str, float]:
    name = f"staleness-{staleness}-overlap-{int(overlap)}"
    overrides = [
        f"weight_sync.overlap={str(overlap).lower()}",
        f"run.root={tmp}",
        f"run.name={name}",
        f"model.path={model}",
        f"learner.steps={steps}",
        f"staleness.max_staleness={staleness}",
    ]
    config = load_config(ROOT / "configs/demo.toml", overrides)
    with EmbeddedRedis(tmp / name / "redis") as redis:
        ControlPlane(connect(redis.url), name).run.publish_config(config)
        common = ["--run", name]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        env["ASYNCRL_REDIS_URL"] = redis.url  # not in argv: the URL carries the password
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
        helpers = [subprocess.Popen(pinned(1, [str(BIN / "rl-actor"), "reward", *common]), **quiet)]
        helpers += [
            subprocess.Popen(pinned(1, [str(BIN / "rl-actor"), *common, "--id", f"a{i}"]), **quiet) for i in range(2)
        ]
        learner_cmd = [str(BIN / "rl-learner"), "train", str(ROOT / "configs/demo.toml")]
        learner_cmd += [a for o in overrides for a in ("--set", o)]
        try:
            code = subprocess.run(pinned(0, learner_cmd), timeout=3600, **quiet).returncode
        finally:
            for proc in helpers:
                proc.send_signal(signal.SIGTERM)
            for proc in helpers:
                proc.wait(120)
    if code:
        raise RuntimeError(f"learner of {name} exited with {code}")
    rows = [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "eval/step" not in r]  # the training steps (the demo also evaluates)
    return {
        "wall_s": rows[-1]["time"] - rows[0]["time"],
        "idle_fraction": sum(r["step/idle_fraction"] for r in rows[1:]) / (len(rows) - 1),
        "final_reward": sum(r["rollout/reward_mean"] for r in rows[-5:]) / 5,
        "first_reward": sum(r["rollout/reward_mean"] for r in rows[:5]) / 5,
        "staleness_max": max(r["rollout/staleness_max"] for r in rows),
        # A broadcast's own time, and the part of it the learner waited for (overlap hides the rest).
        "sync_s_mean": _mean(r.get("sync/seconds") for r in rows),
        "sync_wait_s_mean": _mean(r.get("sync/wait_s") for r in rows),
    }


def _mean(values) -> float:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = tmp / "model"
        subprocess.run(
            [
                str(BIN / "rl-learner"),
                "init-model",
                str(ROOT / "configs/demo.toml"),
                "--set",
                f"model.path={model}",
                "--warm-steps",
                "120",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        sync = run(tmp, model, 0, args.steps)
        serial = run(tmp, model, 2, args.steps, overlap=False)
        asynchronous = run(tmp, model, 2, args.steps)
    result = {
        "steps": args.steps,
        "cores": "learner on core 0 (1 thread); 2 actors + reward worker on core 1",
        "synchronous": {k: round(v, 3) for k, v in sync.items()},
        "asynchronous_broadcast_after_step": {k: round(v, 3) for k, v in serial.items()},
        "asynchronous": {k: round(v, 3) for k, v in asynchronous.items()},
        "async_vs_sync_wall": round(asynchronous["wall_s"] / sync["wall_s"], 3),
        "overlap_vs_no_overlap_wall": round(asynchronous["wall_s"] / serial["wall_s"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
