"""``rl-learner train --profile N``: where the time of step N goes, for the next person who tunes the learner.

The step runs under :mod:`cProfile` (every Python function, with the time spent in torch's and DeepSpeed's C++
below it charged to the caller that waited) and two files land in the run folder:

- ``profile-step-<N>.txt``: the 40 entries with the most cumulative time, then the 40 with the most own time;
- ``profile-step-<N>.prof``: the raw statistics, for ``python -m pstats`` or ``snakeviz``.

Only rank 0's step is profiled (the others follow it). Profiling slows that one step; the rest are untouched.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from asyncrl.common.observability.logs import get_logger

log = get_logger("learner")
T = TypeVar("T")
TOP = 40


def profiled(step: int, run_dir: Path, work: Callable[[], T]) -> T:
    """``work()`` under cProfile; writes ``profile-step-<step>.txt`` and ``.prof`` in ``run_dir``."""
    profile = cProfile.Profile()
    try:
        return profile.runcall(work)
    finally:
        text, raw = run_dir / f"profile-step-{step}.txt", run_dir / f"profile-step-{step}.prof"
        profile.dump_stats(raw)
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        out.write(f"step {step}: the {TOP} entries with the most cumulative time\n")
        stats.sort_stats("cumulative").print_stats(TOP)
        out.write(f"step {step}: the {TOP} entries with the most own time\n")
        stats.sort_stats("tottime").print_stats(TOP)
        text.write_text(out.getvalue())
        log.info("wrote a profile of one step", step=step, text=text, raw=raw)
