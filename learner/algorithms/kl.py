"""Per-token estimators of KL(π_θ ‖ π_ref) from tokens sampled by the policy (Schulman 2020).

J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html. With
``log r = log π_ref − log π_θ`` at each sampled token [B, T]:

- ``k1 = −log r``: unbiased, high variance, negative on some tokens;
- ``k2 = (log r)² / 2``: biased, low variance, always ≥ 0 (its gradient is that of the true KL's
  second-order expansion);
- ``k3 = (r − 1) − log r``: unbiased, low variance, always ≥ 0 — the GRPO paper's choice
  (Shao et al. 2024, eq. 4).

The functions are elementwise; the caller masks padding. Gradients flow into ``logprobs`` only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor

from learner.algorithms.registries import KL_ESTIMATORS, kl_settings, register_kl_estimator
from learner.algorithms.types import Settings


class K1Settings(Settings):
    name: Literal["k1"] = "k1"


class K2Settings(Settings):
    name: Literal["k2"] = "k2"


class K3Settings(Settings):
    name: Literal["k3"] = "k3"
    clamp: float = Field(20.0, gt=0.0)
    """|log r| is clamped to this before exp: exp(89) overflows float32, and a single token the policy
    has made nearly impossible would otherwise dominate the loss and its gradient (verl's ``low_var_kl``
    clamps at the same 20; unlike verl, the resulting k3 itself is not clamped again)."""


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
    """k3 = (r − 1) − log r, with log r clamped to [−clamp, clamp]."""
    log_r = (ref_logprobs.detach() - logprobs).clamp(-settings.clamp, settings.clamp)
    return log_r.exp() - 1.0 - log_r


def kl_estimate(name: str, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """The per-token estimate [B, T] of KL estimator ``name`` (a key or import path) with default settings."""
    return KL_ESTIMATORS.get(name)(logprobs, ref_logprobs, kl_settings(name))
