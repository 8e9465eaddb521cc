"""Per-token entropy of the policy, for the entropy bonus of the policy losses (``LossInput.entropy``).

H_t = −Σ_v p_v log p_v with p = softmax(logits_t): the entropy of π_θ(· | x_<t) at each position,
as verl's ``entropy_from_logits`` (which computes logsumexp(z) − Σ p·z). The logits are those the
log-probs were taken from, temperature already applied.
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_entropy(logits: Tensor) -> Tensor:
    """[B, T, V] logits → [B, T] float32 entropy, differentiable.

    From ``log_softmax`` in float32, so no probability is formed by dividing exponentials. A token the
    model rules out (logit −inf: p = 0, log p = −inf) adds 0 rather than 0·(−inf) = NaN, and its
    gradient is 0: log p is floored at the smallest float32 before the product. Memory: a few float32
    copies of the logits; call it per micro-batch (or per chunk of positions) on large vocabularies.
    """
    log_p = torch.log_softmax(logits.float(), dim=-1)
    floored = log_p.clamp(min=torch.finfo(log_p.dtype).min)
    return -(log_p.exp() * floored).sum(dim=-1)
