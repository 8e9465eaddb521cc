"""A step's loss metrics from its micro-batches: means weighted by what each micro-batch holds, maxima as maxima.

The losses report per micro-batch means over its response tokens (clip fraction, entropy, ratio mean), some over its
sequences (the share of sequences dropped, GSPO's sequence clip fraction, DPO's pair figures: a loss names them in
``LossOutput.sequence_metrics``), and maxima (``offpolicy/weight_max``). Micro-batches go longest first
(:func:`asyncrl.learner.update.batch.rank_micro_batches`), so with lengths that vary widely one micro-batch holds
thousands of tokens and the last a few dozen. An unweighted mean of their means counts the few as much as the thousands,
and the figure then moves with ``learner.micro_batch_size``. Weighted, it is the whole batch's mean::

    mean = Σ_m n_m · mean_m / Σ_m n_m        n_m = response tokens (or sequences) of micro-batch m

A metric named ``*_max`` is the largest over the micro-batches. A filler pass (zeroed mask) counts for nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch


class MicroBatchMetrics:
    """Collects each micro-batch's metrics over a step; :meth:`figures` gives the step's."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._maxima: dict[str, float] = {}

    def add(
        self,
        values: Mapping[str, float | torch.Tensor],
        response_mask: torch.Tensor,
        per_sequence: Collection[str] = (),
    ) -> None:
        """The metrics of one micro-batch whose response tokens are ``response_mask``'s ones; those named in
        ``per_sequence`` are means over its sequences."""
        tokens = float(response_mask.sum())
        if tokens == 0:
            return
        sequences = float(response_mask.any(dim=-1).sum())
        for name, value in values.items():
            if name.endswith("_max"):
                self._maxima[name] = max(self._maxima.get(name, float("-inf")), float(value))
                continue
            weight = sequences if name in per_sequence else tokens
            self._sums[name] = self._sums.get(name, 0.0) + float(value) * weight
            self._weights[name] = self._weights.get(name, 0.0) + weight

    def figures(self) -> dict[str, float]:
        """Each mean weighted, each maximum the largest; metrics of empty micro-batches only are left out."""
        return {name: self._sums[name] / self._weights[name] for name in self._sums} | self._maxima
