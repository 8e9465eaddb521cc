"""A step's metrics from its micro-batches: means weighted by tokens (or by sequences, for shares of sequences) are the
whole batch's means; maxima are maxima."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.algorithms.masked import masked_mean
from asyncrl.learner.update.step_metrics import MicroBatchMetrics


def test_means_are_the_whole_batchs_token_mean_however_the_batch_is_cut() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 0.0, 0.0, 0.0], [6.0, 7.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    metrics = MicroBatchMetrics()
    for rows in (slice(0, 1), slice(1, 3)):  # 4 tokens, then 3: an unweighted mean of means would read 4.25
        metrics.add({"loss/entropy": masked_mean(values[rows], mask[rows])}, mask[rows])
    assert metrics.figures()["loss/entropy"] == pytest.approx(float(masked_mean(values, mask)))  # 28 / 7


def test_a_max_is_the_largest_and_an_empty_pass_counts_for_nothing() -> None:
    metrics = MicroBatchMetrics()
    metrics.add({"offpolicy/weight_max": 1.5, "loss/clip_frac": 0.2}, torch.ones(2, 3))
    metrics.add({"offpolicy/weight_max": 3.0, "loss/clip_frac": 0.4}, torch.ones(1, 3))
    metrics.add({"offpolicy/weight_max": 9.0, "loss/clip_frac": 1.0}, torch.zeros(1, 3))  # a filler pass
    assert metrics.figures() == pytest.approx({"offpolicy/weight_max": 3.0, "loss/clip_frac": (0.2 * 6 + 0.4 * 3) / 9})


def test_nothing_but_empty_passes_gives_no_figure() -> None:
    metrics = MicroBatchMetrics()
    metrics.add({"loss/entropy": 0.5}, torch.zeros(2, 2))
    assert metrics.figures() == {}


def test_a_metric_over_sequences_is_weighted_by_sequences() -> None:
    """A share of sequences (one of 1 dropped, then none of 3) is the whole batch's share: 1 / 4, not by tokens."""
    metrics = MicroBatchMetrics()
    long_one, three_short = torch.ones(1, 8, dtype=torch.bool), torch.zeros(3, 8, dtype=torch.bool)
    three_short[:, :2] = True
    metrics.add({"offpolicy/dropped_frac": 1.0}, long_one, per_sequence={"offpolicy/dropped_frac"})
    metrics.add({"offpolicy/dropped_frac": 0.0}, three_short, per_sequence={"offpolicy/dropped_frac"})
    assert metrics.figures()["offpolicy/dropped_frac"] == pytest.approx(0.25)  # by tokens it would read 8 / 14
