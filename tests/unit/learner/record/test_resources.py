"""The learner's memory figures in each row (learner/record/resources.py): resident bytes always, the growth once two
minutes and eight steps are in the ten-minute window, fitted over that window only."""

from __future__ import annotations

import pytest

from asyncrl.learner.record.resources import MemoryTrend


def test_the_growth_is_the_slope_over_the_window_once_it_spans_two_minutes_and_eight_steps() -> None:
    trend = MemoryTrend()
    assert set(trend.figures(0.0, 1e9)) == {"resources/rss_bytes"}
    assert "resources/rss_growth_bytes_per_h" not in trend.figures(60.0, 1e9 + 1e6)
    assert "resources/rss_growth_bytes_per_h" not in trend.figures(120.0, 1e9 + 2e6)  # three steps: no trend yet
    for second in range(130, 170, 10):
        assert "resources/rss_growth_bytes_per_h" not in trend.figures(float(second), 1e9 + second / 60 * 1e6)
    figures = trend.figures(180.0, 1e9 + 3e6)  # the eighth step; 1 MB a minute
    assert figures["resources/rss_bytes"] == 1e9 + 3e6
    assert figures["resources/rss_growth_bytes_per_h"] == pytest.approx(60e6)
    for minute in range(3, 30):  # flat from here on: the first minutes leave the window
        figures = trend.figures(60.0 * minute, 1e9 + 2e6)
    assert figures["resources/rss_growth_bytes_per_h"] == pytest.approx(0.0, abs=1e-3)


def test_without_a_given_figure_it_reads_this_process() -> None:
    assert MemoryTrend().figures(0.0)["resources/rss_bytes"] > 10e6
