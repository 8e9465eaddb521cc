"""Per-token entropy of the policy: for the entropy bonus of the policy losses (``LossInput.entropy``), and, without a
graph, for the ``loss/entropy`` figure every step has (:func:`token_entropy_no_grad`).

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


ENTROPY_CHUNK_ELEMENTS = 2**24
"""Logit entries per chunk of :func:`token_entropy_no_grad` (64 MiB in float32): positions are taken this many
vocabulary rows at a time, so a 150k-entry vocabulary adds a few chunk-sized buffers, never a copy of the logits."""


@torch.no_grad()
def token_entropy_no_grad(logits: Tensor) -> Tensor:
    """[B, T, V] logits → [B, T] float32 entropy without a graph, computed a chunk of positions at a time (the same
    formula as :func:`token_entropy`): the figure that watches for entropy collapse, whatever the loss."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    rows = max(1, ENTROPY_CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    parts = [token_entropy(flat[start : start + rows]) for start in range(0, flat.shape[0], rows)]
    empty = flat.new_zeros(0, dtype=torch.float32)
    return (torch.cat(parts) if parts else empty).reshape(logits.shape[:-1])
