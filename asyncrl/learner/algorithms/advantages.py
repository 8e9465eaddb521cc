"""Advantage estimators: outcome estimators (one scalar per sequence, broadcast over its response tokens)
and per-token estimators that put the outcome at a response's last token (``gae``, ``reinforce_pp``).

Each takes the WHOLE training batch (complete groups, never a micro-batch: a group's baseline needs
all its members, and whitening needs the batch) and returns advantages [B, T] float32, zero at masked
positions; only ``gae`` returns critic targets. Every settings model derives from
:class:`AdvantageSettings`, whose ``normalize`` whitens the advantages over the batch's response
tokens; :func:`advantage_output` is the one place that applies it.

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

from asyncrl.learner.algorithms.masked import masked_whiten, zero_masked
from asyncrl.learner.algorithms.registries import register_advantage
from asyncrl.learner.algorithms.types import AdvantageInput, AdvantageOutput, Need, Settings


class AdvantageSettings(Settings):
    """Base of every advantage estimator's settings: what all estimators share."""

    normalize: bool = False
    """Whiten the advantages over every response token of the batch after the estimator (mean-shifted,
    unbiased variance: :func:`~asyncrl.learner.algorithms.masked.masked_whiten`); a longer response weighs more."""


class GRPOSettings(AdvantageSettings):
    name: Literal["grpo"] = "grpo"
    epsilon: float = Field(default=1e-6, ge=0.0)
    """Added to the group's std so a group of equal rewards gives advantage 0, not 0/0."""
    scale: bool = True
    """Divide by the group's std; False = mean-centring only (the ``dr_grpo`` estimator)."""


class DrGRPOSettings(AdvantageSettings):
    name: Literal["dr_grpo"] = "dr_grpo"


class RLOOSettings(AdvantageSettings):
    name: Literal["rloo"] = "rloo"


class BatchMeanSettings(AdvantageSettings):
    name: Literal["batch_mean"] = "batch_mean"


class GAESettings(AdvantageSettings):
    name: Literal["gae"] = "gae"
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """γ, the discount per response token (1: the outcome is not discounted, as in verl and OpenRLHF)."""
    lam: float = Field(default=0.95, ge=0.0, le=1.0)
    """λ of GAE. 0.95 as the PPO paper (Schulman et al. 2017, Table 3), TRL's ``PPOConfig.lam`` and
    OpenRLHF's ``--lambd``; verl defaults to 1.0 (A = return − V, no bias from an untrained critic)."""
    kl_coef: float = Field(default=0.0, ge=0.0)
    """Coefficient of the per-token KL penalty in the token rewards (needs ``token_kl``); overridden by
    ``AdvantageInput.kl_coef`` when the learner runs a KL controller."""
    normalize: bool = True
    """Whiten the advantages over the batch's response tokens (verl's ``masked_whiten``); the returns
    are taken before whitening."""

    def requires(self) -> frozenset[Need]:
        return frozenset({Need.VALUES, Need.TOKEN_KL} if self.kl_coef > 0 else {Need.VALUES})


class ReinforcePPSettings(AdvantageSettings):
    name: Literal["reinforce_pp"] = "reinforce_pp"
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """γ of the return-to-go (1 in the REINFORCE++ paper and in verl)."""
    kl_coef: float = Field(default=0.0, ge=0.0)
    """Coefficient of the per-token KL penalty in the token rewards (needs ``token_kl``); 0 runs without
    a reference model. Overridden by ``AdvantageInput.kl_coef`` when the learner runs a KL controller."""
    normalize: bool = True
    """Whiten the returns over the batch's response tokens: the "++" of REINFORCE++ (its global batch
    advantage normalization); False gives plain REINFORCE with a KL-shaped return-to-go."""

    def requires(self) -> frozenset[Need]:
        return frozenset({Need.TOKEN_KL} if self.kl_coef > 0 else set())


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
    return _broadcast(advantage, inp, settings)


@register_advantage("dr_grpo")
def dr_grpo(inp: AdvantageInput, settings: DrGRPOSettings) -> AdvantageOutput:
    """Mean-centred group advantage, no std division (Liu et al. 2025, "Understanding R1-Zero-Like
    Training: A Critical Perspective", Dr. GRPO): A_i = r_i − mean_g. The std division favours
    questions that are too easy or too hard; Dr. GRPO removes that bias."""
    rewards, mean, _, _ = _group_stats(inp)
    return _broadcast(rewards - mean, inp, settings)


@register_advantage("rloo")
def rloo(inp: AdvantageInput, settings: RLOOSettings) -> AdvantageOutput:
    """Leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

    A_i = r_i − (1 / (n − 1)) Σ_{j≠i} r_j = n / (n − 1) · (r_i − mean_g), for a group of n ≥ 2; 0 for n = 1.
    """
    rewards, mean, _, count = _group_stats(inp)
    factor = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return _broadcast(factor * (rewards - mean), inp, settings)


@register_advantage("batch_mean")
def batch_mean(inp: AdvantageInput, settings: BatchMeanSettings) -> AdvantageOutput:
    """REINFORCE with the batch mean as baseline (Williams 1992): A_i = r_i − mean over the batch.
    Groups are ignored."""
    rewards = inp.rewards.to(torch.float64)
    return _broadcast(rewards - rewards.mean(), inp, settings)


@register_advantage("gae")
def gae(inp: AdvantageInput, settings: GAESettings) -> AdvantageOutput:
    """Generalized advantage estimation per response token (Schulman et al. 2016, "High-Dimensional
    Continuous Control Using Generalized Advantage Estimation", eq. 16).

    δ_t = r_t + γ V_{t'} − V_t, with t' the row's next response token and V = 0 after its last one;
    A_t = Σ_k (γλ)^k δ_{t+k} over the row's response tokens, i.e. A_t = δ_t + γλ A_{t'};
    returns_t = A_t + V_t (critic targets, before any whitening). Token rewards are
    :func:`token_rewards`. Positions that are not response tokens (the prompt before a response,
    padding after it, or observation tokens inside a multi-turn response) are skipped: neither their
    value nor a TD error enters, as in verl's ``compute_gae_advantage_return``. float64 throughout.
    Whitened over the batch when ``normalize`` (default True, as verl).
    """
    if inp.values is None:
        raise ValueError("gae needs critic values: AdvantageInput.values is None")
    mask = inp.response_mask
    values = zero_masked(inp.values.detach().to(torch.float64), mask)
    delta = token_rewards(inp, settings.kl_coef) + settings.gamma * _next_response_value(values, mask) - values
    advantages = discounted_suffix_sum(zero_masked(delta, mask), _discounts(mask, settings.gamma * settings.lam))
    returns = zero_masked(advantages + values, mask).to(torch.float32)
    return advantage_output(advantages, inp, settings, returns=returns)


@register_advantage("reinforce_pp")
def reinforce_pp(inp: AdvantageInput, settings: ReinforcePPSettings) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models", arXiv 2501.03262, §3): no critic and no group baseline.

    G_t = Σ_k γ^k r_{t+k} over the row's response tokens (return-to-go of :func:`token_rewards`:
    outcome at the last token, −kl_coef · KL_t at every token), then whitened over every response
    token of the batch (``normalize``, default True). As verl's ``compute_reinforce_plus_plus_outcome_
    advantage``; non-response positions inside a row are skipped rather than resetting the return.
    """
    mask = inp.response_mask
    returns = discounted_suffix_sum(token_rewards(inp, settings.kl_coef), _discounts(mask, settings.gamma))
    return advantage_output(returns, inp, settings)


def token_rewards(inp: AdvantageInput, kl_coef: float) -> Tensor:
    """Per-token rewards [B, T] float64: r_i at the last response token of row i, minus c · token_kl at
    every response token, 0 elsewhere; c = ``inp.kl_coef`` if given, else ``kl_coef`` (the settings').
    With ``inp.turn_rewards`` (a multi-turn episode's per-turn shares u_{i,j} at the last token of each model
    turn j): u_{i,j} there, and r_i − Σ_j u_{i,j} at the last response token, so a row's rewards still sum to r_i
    while each turn is credited where it was earned.

    The KL-shaped reward of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences",
    §2.2) and Stiennon et al. 2020, as verl's ``apply_kl_penalty`` and OpenRLHF's ``compute_reward``.
    """
    mask = inp.response_mask
    seen = mask.cumsum(dim=-1)
    last = mask & (seen == seen[:, -1:])  # the last True position of each row (none in an empty row)
    outcome = inp.rewards.to(torch.float64)
    turns = None
    if inp.turn_rewards is not None:
        turns = zero_masked(inp.turn_rewards.to(torch.float64), mask)
        outcome = outcome - turns.sum(dim=-1)
    rewards = torch.where(last, outcome[:, None], 0.0)
    if turns is not None:
        rewards = rewards + turns
    coef = inp.kl_coef if inp.kl_coef is not None else kl_coef
    if coef > 0:
        if inp.token_kl is None:
            raise ValueError(f"a KL penalty in the reward (kl_coef = {coef}) needs AdvantageInput.token_kl")
        rewards = rewards - coef * zero_masked(inp.token_kl.detach().to(torch.float64), mask)
    return rewards


def discounted_suffix_sum(x: Tensor, discount: Tensor) -> Tensor:
    """y_t = x_t + d_t · y_{t+1} along the last dim, y_T = 0: [B, T] → [B, T].

    Vectorized as a Hillis–Steele scan of the affine maps y ↦ d_t·y + x_t (composition is associative),
    in ⌈log₂ T⌉ steps of [B, T] work instead of T Python steps; only products of discounts ≤ 1 and sums
    appear, so nothing overflows. Use float64: the summation order differs from a sequential loop.
    """
    y, d = x.clone(), discount.clone()
    shift = 1
    while shift < y.shape[-1]:
        # (d_t, y_t) ∘ (d_{t+s}, y_{t+s}): y_t ← y_t + d_t·y_{t+s}, then d_t ← d_t·d_{t+s}; the tail keeps its own.
        y[..., :-shift] = y[..., :-shift] + d[..., :-shift] * y[..., shift:]
        d[..., :-shift] = d[..., :-shift] * d[..., shift:]
        shift *= 2
    return y


def advantage_output(
    advantages: Tensor, inp: AdvantageInput, settings: AdvantageSettings, returns: Tensor | None = None
) -> AdvantageOutput:
    """[B, T] advantages → float32, 0 on padding, whitened over the batch when ``settings.normalize``.

    Every built-in estimator returns through here, so ``normalize`` has one implementation; an estimator
    named by import path whose settings derive from :class:`AdvantageSettings` should do the same.
    """
    mask = inp.response_mask
    advantages = zero_masked(advantages.to(torch.float64), mask)
    if settings.normalize:
        advantages = masked_whiten(advantages, mask)
    return AdvantageOutput(advantages=advantages.to(torch.float32), returns=returns)


def _discounts(mask: Tensor, factor: float) -> Tensor:
    """The scan's d_t: ``factor`` at response tokens, 1 elsewhere (a non-response position carries y through)."""
    ones = torch.ones(mask.shape, dtype=torch.float64, device=mask.device)
    return torch.where(mask, ones * factor, ones)


def _next_response_value(values: Tensor, mask: Tensor) -> Tensor:
    """V at the row's next response token after t, 0 after the last one: [B, T] float64.

    "V at the first response token at or after t" is the scan y_t = V_t at a response token, y_{t+1}
    elsewhere (d = 0 / 1); shifted left by one it is the value after t.
    """
    at_or_after = discounted_suffix_sum(zero_masked(values, mask), (~mask).to(torch.float64))
    return torch.cat([at_or_after[:, 1:], torch.zeros_like(at_or_after[:, :1])], dim=-1)


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


def _broadcast(advantage: Tensor, inp: AdvantageInput, settings: AdvantageSettings) -> AdvantageOutput:
    """One advantage per sequence [B] → [B, T] over its response tokens (see :func:`advantage_output`)."""
    return advantage_output(advantage[:, None].expand(inp.response_mask.shape), inp, settings)
