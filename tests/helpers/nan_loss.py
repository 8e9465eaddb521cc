"""A policy loss that turns non-finite on chosen calls: ``ppo_clip`` otherwise.

Named in a run config by import path (``tests.helpers.nan_loss:ppo_clip_with_nans``) to plant non-finite
steps in a real learner; with one micro-batch per step, call N is step N's loss.
"""

from __future__ import annotations

from asyncrl.learner.algorithms import LossInput, LossOutput, Settings
from asyncrl.learner.algorithms.losses import PPOClipSettings, ppo_clip

_calls = 0


class NaNCallsSettings(Settings):
    nan_calls: tuple[int, ...] = ()
    """1-based numbers of the calls whose loss is NaN."""


def ppo_clip_with_nans(inp: LossInput, settings: NaNCallsSettings) -> LossOutput:
    global _calls
    _calls += 1
    out = ppo_clip(inp, PPOClipSettings())
    if _calls in settings.nan_calls:
        return LossOutput(per_token_loss=out.per_token_loss * float("nan"), metrics=out.metrics)
    return out
