"""The critic's loss: clipped squared error between values and returns.

Per token (PPO2's ``vf_loss`` in openai/baselines ``ppo2/model.py``; verl ``core_algos.compute_value_loss``)::

    V_clip = clip(V, V_old − ε, V_old + ε)
    loss_t = ½ · max((V − R)², (V_clip − R)²)

V are the critic's values under training, V_old its values at the start of the step (detached), R the returns
(targets, e.g. GAE's A + V_old). The clip keeps one step from moving a value far from V_old; taking the max makes the
clip pessimistic (it only ever removes gradient, never adds it). ε = 0 switches clipping off (plain ½ (V − R)²),
since clipping to V_old exactly would freeze every value that starts on the wrong side of its return.

All tensors are ``[B, T]`` with the package's conventions (``types.py``): masked positions may hold anything and
never reach a result. The per-token loss is aggregated like a policy loss, normally with ``token_mean`` over
:class:`~asyncrl.learner.algorithms.types.GlobalCounts` of the whole batch, so micro-batch shares sum to the batch loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.learner.algorithms.masked import masked_mean, zero_masked
from asyncrl.learner.algorithms.types import LossOutput


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, clip: float
) -> LossOutput:
    """½ · max((V − R)², (clip(V, V_old ± ε) − R)²) per token, zero at masked positions (formula: module docstring).

    ``values`` carries the graph; ``old_values`` and ``returns`` are detached here. Metrics over the masked tokens
    of this micro-batch: ``value/clip_frac`` (tokens where the clipped branch is strictly larger, i.e. clipping
    removed the gradient; verl's ``vf_clipfrac``), ``value/error`` (mean (V − R)², unclipped) and ``value/mean``.
    """
    if clip < 0:
        raise ValueError(f"value clip must be >= 0, got {clip}")
    mask = response_mask
    v = zero_masked(values.float(), mask)
    old = zero_masked(old_values.detach().float(), mask)
    target = zero_masked(returns.detach().float(), mask)
    unclipped = (v - target) ** 2
    if clip > 0:
        clipped = (torch.clamp(v, old - clip, old + clip) - target) ** 2
        worse = torch.maximum(unclipped, clipped)
        clip_frac = masked_mean((clipped > unclipped).float(), mask)
    else:
        worse, clip_frac = unclipped, torch.zeros((), device=v.device)
    metrics = {
        "value/clip_frac": clip_frac,
        "value/error": masked_mean(unclipped.detach(), mask),
        "value/mean": masked_mean(v.detach(), mask),
    }
    return LossOutput(per_token_loss=zero_masked(0.5 * worse, mask), metrics=metrics)
