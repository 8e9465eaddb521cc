"""How long a CPU actor's engine takes to start, its engine core forked (the default) against spawned.

Each start is a fresh process that builds the actor's own engine (``actors/engine.py: RolloutEngine``) on the tiny
demo model with the worker inside the engine core (``rollout.cpu_single_process``, the default on CPUs), then shuts it
down. Spawned is what vLLM's CPU platform asks for, forced here by setting ``VLLM_WORKER_MULTIPROC_METHOD=spawn``,
which the actor keeps when a user sets it. Starts alternate, ``--rounds`` of each.

Figures (medians): ``engine_s``, from building the engine's arguments to the engine ready (the actor's imports
excluded); ``cpu_s``, the CPU seconds of the process and its engine core together; and ``spawned / forked`` of each.

    python bench/engine_start.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(model: str) -> None:
    """One engine start in this process; prints ``{"engine_s", "cpu_s"}``."""
    from asyncrl.common.openmp import passive_waits

    passive_waits()
    from asyncrl.actors.engine import RolloutEngine
    from asyncrl.common.config import load_config

    config = load_config(ROOT / "configs" / "demo.toml", [f"model.path={model}", "rollout.cpu_threads=0"])
    import vllm.v1.engine.async_llm  # noqa: F401  # imported by the actor before its engine starts: not timed

    started = time.perf_counter()
    engine = RolloutEngine(config)
    engine_s = time.perf_counter() - started
    engine.shutdown()
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime
    print(json.dumps({"engine_s": engine_s, "cpu_s": cpu_s}))


def start(model: str, method: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    if method == "spawn":
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    done = subprocess.run(
        [sys.executable, __file__, "--child", model], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    from asyncrl.common.data.tasks import TASK_ALPHABET
    from asyncrl.common.tiny_models.character import init_model

    with tempfile.TemporaryDirectory() as folder:
        model = str(init_model(Path(folder) / "model", alphabet=TASK_ALPHABET))
        runs: dict[str, list[dict[str, float]]] = {"forked": [], "spawned": []}
        for _ in range(args.rounds):
            runs["forked"].append(start(model, "fork"))
            runs["spawned"].append(start(model, "spawn"))
    figures = {
        name: {key: round(statistics.median(r[key] for r in results), 2) for key in ("engine_s", "cpu_s")}
        for name, results in runs.items()
    }
    for key in ("engine_s", "cpu_s"):
        figures[f"spawned_over_forked_{key}"] = round(figures["spawned"][key] / figures["forked"][key], 2)
    print(json.dumps({"rounds": args.rounds, **figures}))


if __name__ == "__main__":
    main()
