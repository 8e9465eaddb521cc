"""How long a CPU actor's engine takes to start and to sample its first group: the default (engine core forked,
nothing compiled) against a spawned engine core and against vLLM's compiled sampling helpers.

Each start is a fresh process that builds the actor's own engine (``actors/engine.py: RolloutEngine``) on the tiny
demo model with the worker inside the engine core (``rollout.cpu_single_process``, the default on CPUs), samples one
group of 8 responses with log-probs as an actor does, then shuts it down. Spawned is what vLLM's CPU platform asks for,
forced here by setting ``VLLM_WORKER_MULTIPROC_METHOD=spawn``, which the actor keeps when a user sets it. Compiled is
vLLM's own behaviour in eager mode, two sampling helpers compiled by Inductor (``TORCHDYNAMO_DISABLE=0``, which the
actor keeps when a user sets it; ``actors/engine_processes.py: compile_nothing``). Starts alternate, ``--rounds`` of
each.

Figures (medians): ``engine_s``, from building the engine's arguments to the engine ready (the actor's imports
excluded); ``first_group_s``, the first group sampled; ``cpu_s``, the CPU seconds of the process and its engine core
together; and each other way over the default.

    python bench/engine_start.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
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

    from asyncrl.actors.generation import Sampling

    started = time.perf_counter()
    engine = RolloutEngine(config)
    engine_s = time.perf_counter() - started
    sampling = Sampling(n=8, temperature=1.0, top_p=1.0, max_tokens=6)
    started = time.perf_counter()
    asyncio.run(engine.generate([1, 2, 3, 4], sampling, "first-group"))
    first_group_s = time.perf_counter() - started
    engine.shutdown()
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime
    print(json.dumps({"engine_s": engine_s, "first_group_s": first_group_s, "cpu_s": cpu_s}))


WAYS = {"default": {}, "spawned": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}, "compiled": {"TORCHDYNAMO_DISABLE": "0"}}
FIGURES = ("engine_s", "first_group_s", "cpu_s")


def start(model: str, way: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_WORKER_MULTIPROC_METHOD", "TORCHDYNAMO_DISABLE")}
    env |= WAYS[way]
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
        runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
        for _ in range(args.rounds):
            for way in WAYS:
                runs[way].append(start(model, way))
    figures: dict[str, object] = {
        way: {key: round(statistics.median(r[key] for r in results), 2) for key in FIGURES}
        for way, results in runs.items()
    }
    default = runs["default"]
    for way in ("spawned", "compiled"):
        for key in FIGURES:
            ratio = statistics.median(r[key] for r in runs[way]) / statistics.median(r[key] for r in default)
            figures[f"{way}_over_default_{key}"] = round(ratio, 2)
    print(json.dumps({"rounds": args.rounds, **figures}))


if __name__ == "__main__":
    main()
