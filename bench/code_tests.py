"""Per-call cost of the ``code_tests`` reward: one sandboxed run of a small correct program against its tests.

Each call scores a group of one response with the registered ``code_tests`` function (``workers=1``), so one call
is one sandbox run: the launcher, the fence this machine detects (logged once, and printed here), the interpreter's
start and the tests. A few warm-up calls first (the fence is detected at the first one). Besides wall-clock time per
call, ``cpu_ms`` is the CPU time (user + system) of the sandbox's processes per call, from ``RUSAGE_CHILDREN`` (every
process of the tree is reaped by its parent, so it counts them all): a figure a loaded machine disturbs less. The last
line printed is one JSON object with the figures. A benchmark: nothing here asserts a time.

    python bench/code_tests.py [--calls 40] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from asyncrl.common.rewards.functions import get_reward
from asyncrl.common.sandbox import isolation
from asyncrl.common.wire.messages import RolloutGroup

PROGRAM = "```python\ndef add(a, b):\n    return a + b\n```\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def group() -> RolloutGroup:
    """One response: the correct program (token fields are zeros of the right sizes; the reward reads only text)."""
    n = len(PROGRAM)
    return RolloutGroup(
        group_id="bench", task="code_tests", prompt="write add", prompt_ids=np.zeros(9, np.int32), answer=TESTS,
        token_ids=np.zeros(n, np.int32), logprobs=np.zeros(n, np.float32), versions=np.zeros(n, np.int32),
        lengths=np.asarray([n], np.int32), texts=[PROGRAM], finish_reasons=["stop"],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    score, batch = get_reward("code_tests"), group()
    for _ in range(args.warmup):
        if score(batch, {"workers": 1}) != [1.0]:
            raise SystemExit("the correct program did not score 1.0")
    seconds = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(args.calls):
        start = time.perf_counter()
        result = score(batch, {"workers": 1})
        seconds.append(time.perf_counter() - start)
        if result != [1.0]:
            raise SystemExit("the correct program did not score 1.0")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    ms = sorted(s * 1000 for s in seconds)
    figures = {
        "calls": len(ms),
        "fence": isolation().fence,
        "median_ms": round(statistics.median(ms), 2),
        "p95_ms": round(ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))], 2),
        "min_ms": round(ms[0], 2),
        "max_ms": round(ms[-1], 2),
        "cpu_ms": round(cpu_s * 1000 / len(ms), 2),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
