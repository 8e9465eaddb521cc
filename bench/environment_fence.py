"""What the environment host's fence costs: its start-up and a step's round trip, fenced and unfenced.

- ``start_ms``: from starting ``python -m asyncrl.actors.environments.host`` (behind the fence's launcher, which
  applies its namespaces, read-only view, scratch and uid first) to its ready line — the median of ``--starts``;
- ``step_us``: one ``step`` request of the built-in ``calculator`` environment, written and answered through
  :class:`~asyncrl.actors.environments.host.EnvironmentHost` — the median of ``--steps`` in a row.

Both fences run in the same process, alternating start by start; ratios are the fenced figure over the unfenced one.
The fence is the one this machine picks (``environment.fence = "auto"``; the last line names it).

    python bench/environment_fence.py [--starts 10] [--steps 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.actors import environment_fence
from asyncrl.actors.environments.host import READY, EnvironmentHost
from asyncrl.common.config import load_config

ROW = {"prompt": "", "answer": "1"}


def start_ms(fence) -> float:
    """Milliseconds from the launch of a host behind ``fence`` to its ready line; the host is then ended."""
    started = time.perf_counter()
    proc = environment_fence.launch(fence, 4096)
    line = proc.stdout.readline()
    seconds = time.perf_counter() - started
    proc.stdin.close()
    proc.wait()
    assert json.loads(line) == READY, line
    return seconds * 1000


def step_us(setting: str, steps: int) -> float:
    """Median microseconds of one step's round trip through a host fenced by ``setting``."""
    section = load_config(None, ["environment.name=calculator", f"environment.fence={setting}"]).environment
    host = EnvironmentHost(section)

    async def run() -> list[float]:
        await host.call_async("make", episode="e", name="calculator", options={}, row=ROW)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            await host.call_async("step", episode="e", action="6*7")
            times.append(time.perf_counter() - started)
        return times

    try:
        return statistics.median(asyncio.run(run())) * 1e6
    finally:
        host.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    fences = {"none": environment_fence.host_fence("none"), "fenced": environment_fence.host_fence("auto")}
    starts: dict[str, list[float]] = {name: [] for name in fences}
    for _ in range(args.starts):
        for name, fence in fences.items():
            starts[name].append(start_ms(fence))
    steps = {name: step_us(setting, args.steps) for name, setting in (("none", "none"), ("fenced", "auto"))}
    result = {
        "fence": fences["fenced"].fence,
        "start_ms": {name: round(statistics.median(times), 1) for name, times in starts.items()},
        "step_us": {name: round(value, 1) for name, value in steps.items()},
        "start_ratio": round(statistics.median(starts["fenced"]) / statistics.median(starts["none"]), 3),
        "step_ratio": round(steps["fenced"] / steps["none"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
