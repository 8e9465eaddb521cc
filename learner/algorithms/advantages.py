"""Outcome advantage estimators: one scalar per sequence, broadcast over its response tokens.

Each takes the WHOLE training batch (complete groups, never a micro-batch: a group's baseline needs
all its members) and returns advantages [B, T], zero at masked positions, and no returns.
Group statistics are computed in float64: with float32 a group of equal rewards such as 0.1 can leave
a mean residual of ~1e-9 which, divided by (std ≈ 1e-9) + ε, becomes an advantage of ~1e-3 instead of 0.

A sequence alone in its group has no baseline to compare with, so every group estimator gives it
advantage 0 (its deviation from its own mean). verl's GRPO gives a lone sequence mean 0 and std 1,
i.e. advantage r; we deliberately differ: a lone sample carries no relative signal.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from learner.algorithms.masked import zero_masked
from learner.algorithms.registries import register_advantage
from learner.algorithms.types import AdvantageInput, AdvantageOutput, Settings


class GRPOSettings(Settings):
    name: Literal["grpo"] = "grpo"
    epsilon: float = Field(1e-6, ge=0.0)
    """Added to the group's std so a group of equal rewards gives advantage 0, not 0/0."""
    scale: bool = True
    """Divide by the group's std; False = mean-centring only (the ``dr_grpo`` estimator)."""


class DrGRPOSettings(Settings):
    name: Literal["dr_grpo"] = "dr_grpo"


class RLOOSettings(Settings):
    name: Literal["rloo"] = "rloo"


class BatchMeanSettings(Settings):
    name: Literal["batch_mean"] = "batch_mean"


@register_advantage("grpo")
def grpo(inp: AdvantageInput, settings: GRPOSettings) -> AdvantageOutput:
    """Group-normalized outcome advantage (Shao et al. 2024, DeepSeekMath, §4.1.2).

    A_i = (r_i − mean_g) / (std_g + ε) for sequence i of group g. std is the unbiased sample std
    (Bessel, divisor n − 1), as ``torch.std`` in verl's ``compute_grpo_outcome_advantage`` and TRL's
    ``GRPOTrainer``; with ``scale = False``: A_i = r_i − mean_g.
    """
    rewards, mean, std, _ = _group_stats(inp)
    centred = rewards - mean
    advantage = centred / (std + settings.epsilon) if settings.scale else centred
    return _broadcast(advantage, inp)


@register_advantage("dr_grpo")
def dr_grpo(inp: AdvantageInput, settings: DrGRPOSettings) -> AdvantageOutput:
    """Mean-centred group advantage, no std division (Liu et al. 2025, "Understanding R1-Zero-Like
    Training: A Critical Perspective", Dr. GRPO): A_i = r_i − mean_g. The std division favours
    questions that are too easy or too hard; Dr. GRPO removes that bias."""
    rewards, mean, _, _ = _group_stats(inp)
    return _broadcast(rewards - mean, inp)


@register_advantage("rloo")
def rloo(inp: AdvantageInput, settings: RLOOSettings) -> AdvantageOutput:
    """Leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

    A_i = r_i − (1 / (n − 1)) Σ_{j≠i} r_j = n / (n − 1) · (r_i − mean_g), for a group of n ≥ 2; 0 for n = 1.
    """
    rewards, mean, _, count = _group_stats(inp)
    factor = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return _broadcast(factor * (rewards - mean), inp)


@register_advantage("batch_mean")
def batch_mean(inp: AdvantageInput, settings: BatchMeanSettings) -> AdvantageOutput:
    """REINFORCE with the batch mean as baseline (Williams 1992): A_i = r_i − mean over the batch.
    Groups are ignored."""
    rewards = inp.rewards.to(torch.float64)
    return _broadcast(rewards - rewards.mean(), inp)


def _group_stats(inp: AdvantageInput) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per sequence [B], float64: its reward, its group's mean, unbiased std and size.

    A lone sequence gets std 0 (its sum of squared deviations is 0, divided by max(n − 1, 1)).
    """
    rewards = inp.rewards.to(torch.float64)
    _, group, size = torch.unique(inp.group_ids, return_inverse=True, return_counts=True)
    size = size.to(torch.float64)
    mean = torch.zeros_like(size).index_add_(0, group, rewards) / size
    squares = torch.zeros_like(size).index_add_(0, group, (rewards - mean[group]).square())
    std = (squares / (size - 1).clamp(min=1)).sqrt()
    return rewards, mean[group], std[group], size[group]


def _broadcast(advantage: Tensor, inp: AdvantageInput) -> AdvantageOutput:
    """One advantage per sequence [B] → [B, T] float32 over its response tokens, 0 on padding."""
    mask = inp.response_mask
    per_token = advantage.to(torch.float32)[:, None].expand(mask.shape)
    return AdvantageOutput(advantages=zero_masked(per_token, mask), returns=None)
