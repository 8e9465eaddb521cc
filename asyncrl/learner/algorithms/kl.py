"""Per-token estimators of KL(π_θ ‖ π_ref) from tokens sampled by the policy (Schulman 2020).

J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html. With
``log r = log π_ref − log π_θ`` at each sampled token [B, T]:

- ``k1 = −log r``: unbiased, high variance, negative on some tokens;
- ``k2 = (log r)² / 2``: biased, low variance, always ≥ 0 (its gradient is that of the true KL's
  second-order expansion);
- ``k3 = (r − 1) − log r``: unbiased, low variance, always ≥ 0 — the GRPO paper's choice
  (Shao et al. 2024, eq. 4).

The functions are elementwise; the caller masks padding. Gradients flow into ``logprobs`` only.

:class:`KLController` holds the coefficient of a KL penalty in the REWARD (``AdvantageInput.kl_coef``
for ``gae`` and ``reinforce_pp``), fixed or adapted towards a target KL (Ziegler et al. 2019).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field
from torch import Tensor

from asyncrl.learner.algorithms.registries import KL_ESTIMATORS, kl_settings, register_kl_estimator
from asyncrl.learner.algorithms.types import Settings


class K1Settings(Settings):
    name: Literal["k1"] = "k1"


class K2Settings(Settings):
    name: Literal["k2"] = "k2"


class K3Settings(Settings):
    name: Literal["k3"] = "k3"
    clamp: float = Field(default=20.0, gt=0.0)
    """|log r| is clamped to this before exp: exp(89) overflows float32 (verl's ``low_var_kl`` clamps at 20)."""
    value_clamp: float = Field(default=10.0, gt=0.0)
    """The estimate itself is clamped to [−value_clamp, value_clamp], as verl's ``low_var_kl`` clamps it to
    [−10, 10]: at log r = 19.9 a single token would otherwise contribute e^19.9 ≈ 4.4e8 to the KL term, with a
    gradient to match. Where the clamp binds, that token's KL gradient is zero."""


@register_kl_estimator("k1")
def k1(logprobs: Tensor, ref_logprobs: Tensor, settings: K1Settings) -> Tensor:
    """k1 = log π_θ − log π_ref = −log r."""
    return logprobs - ref_logprobs.detach()


@register_kl_estimator("k2")
def k2(logprobs: Tensor, ref_logprobs: Tensor, settings: K2Settings) -> Tensor:
    """k2 = (log r)² / 2."""
    return 0.5 * (ref_logprobs.detach() - logprobs).square()


@register_kl_estimator("k3")
def k3(logprobs: Tensor, ref_logprobs: Tensor, settings: K3Settings) -> Tensor:
    """k3 = clamp((r − 1) − log r, −value_clamp, value_clamp), with log r clamped to [−clamp, clamp] first.

    Both clamps as in verl's ``kl_penalty(..., "low_var_kl")`` (``verl/trainer/ppo/core_algos.py``: log r to ±20,
    the estimate to ±10). k3 ≥ 0, so only the upper bound of the second clamp ever binds.
    """
    log_r = (ref_logprobs.detach() - logprobs).clamp(-settings.clamp, settings.clamp)
    return (log_r.exp() - 1.0 - log_r).clamp(-settings.value_clamp, settings.value_clamp)


class KLRewardSettings(Settings):
    """The coefficient of the KL penalty in the token rewards, fixed or adaptive (no registry tag: one
    controller, not a family of variants)."""

    mode: Literal["off", "fixed", "adaptive"] = "off"
    """``off``: coefficient 0; ``fixed``: always ``coef``; ``adaptive``: starts at ``coef`` and follows
    :meth:`KLController.update`."""
    coef: float = Field(default=0.001, ge=0.0)
    """The (initial) coefficient β (verl's ``kl_ctrl.kl_coef`` default)."""
    target: float = Field(default=0.1, gt=0.0)
    """The KL the adaptive controller steers to, in the unit of the observed KL the caller passes
    (verl: the batch mean of the per-token KL, target 0.1; Ziegler et al. sum over the sequence, 6 nats)."""
    horizon: float = Field(default=10_000.0, gt=0.0)
    """Samples over which a relative error moves β by its own size: K_β = n / horizon (verl, and
    OpenAI's lm-human-preferences: 10000)."""


class KLController:
    """The current KL-in-reward coefficient ``coef`` and its update.

    adaptive (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", §2.2; as
    verl's and OpenRLHF's ``AdaptiveKLController``): e = clip(KL / target − 1, −0.2, 0.2);
    β ← β · (1 + e · n / horizon), with n the samples (sequences) the KL was observed on.
    ``coef`` restores a saved coefficient when a run resumes.
    """

    def __init__(self, settings: KLRewardSettings, coef: float | None = None) -> None:
        self.settings = settings
        self._coef = 0.0 if settings.mode == "off" else settings.coef if coef is None else float(coef)

    @property
    def coef(self) -> float:
        return self._coef

    def update(self, observed_kl: float, n_steps: int) -> float:
        """Adapt β to the KL just observed on ``n_steps`` samples (only in ``adaptive`` mode); the new β."""
        if not math.isfinite(observed_kl) or n_steps < 0:
            raise ValueError(f"KLController.update: observed KL {observed_kl}, {n_steps} samples")
        if self.settings.mode == "adaptive":
            error = min(max(observed_kl / self.settings.target - 1.0, -0.2), 0.2)
            self._coef *= 1.0 + error * n_steps / self.settings.horizon
        return self._coef


def kl_estimate(name: str, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """The per-token estimate [B, T] of KL estimator ``name`` (a key or import path) with default settings."""
    return KL_ESTIMATORS.get(name)(logprobs, ref_logprobs, kl_settings(name))
