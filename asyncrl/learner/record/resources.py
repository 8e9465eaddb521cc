"""The learner's host memory in every metrics.jsonl row: its resident bytes now and how fast they grow.

``resources/rss_bytes`` is the learner process's resident memory (``/proc/self/statm``; its children, such as a
DeepSpeed build, are not counted). ``resources/rss_growth_bytes_per_h`` is the least-squares slope of that figure
over the last :data:`WINDOW_S` seconds of steps, once :data:`MIN_SPAN_S` and :data:`MIN_STEPS` steps are in the
window (a large model's minute-long steps give three points in two minutes: no trend): a leak shows as
a slope that stays above zero for hours, where a model's first steps (allocator pools, compiled kernels) show as a
rise that flattens. The other processes' memory is each one's ``asyncrl_process_resident_memory_bytes`` series,
which the ``AsyncrlMemoryGrowing`` alert watches.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from asyncrl.common.observability.metrics import resident_bytes

WINDOW_S = 600.0
"""The span of recent steps the growth is fitted over."""
MIN_SPAN_S = 120.0
"""No growth figure before the window holds this much: a slope over seconds says nothing."""
MIN_STEPS = 8
"""Nor before it holds this many steps: a line through a model's first three steps is its warm-up, not a trend."""


class MemoryTrend:
    """The rows' ``resources/*`` figures, one step at a time."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque()

    def figures(self, now: float, rss: float | None = None) -> dict[str, float]:
        rss = resident_bytes() if rss is None else rss
        self.samples.append((now, rss))
        while now - self.samples[0][0] > WINDOW_S:
            self.samples.popleft()
        out = {"resources/rss_bytes": rss}
        if now - self.samples[0][0] >= MIN_SPAN_S and len(self.samples) >= MIN_STEPS:
            t, y = np.asarray(self.samples, np.float64).T
            out["resources/rss_growth_bytes_per_h"] = float(np.polyfit(t - t[0], y, 1)[0] * 3600)
        return out
