"""Masked tensor helpers: every value at a masked position is replaced before it can reach a result.

``torch.where`` (not multiplication by the mask) is used throughout: ``NaN * 0`` is NaN, and padding
may hold anything. Shapes: ``x`` and ``mask`` are both [B, T]; ``mask`` is bool.
"""

from __future__ import annotations

import torch
from torch import Tensor


def zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask``, else 0; the gradient at masked positions is 0 as well."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the True positions of ``mask``: a scalar, 0 when there are none."""
    count = mask.sum().clamp(min=1)
    return zero_masked(x, mask).sum() / count


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Largest ``x`` over the True positions of ``mask``: a scalar, 0 when there are none."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return zero
    # No ``if mask.any()``: that would synchronise with the GPU on every call.
    largest = torch.where(mask, x, torch.full((), -torch.inf, dtype=x.dtype, device=x.device)).amax()
    return torch.where(mask.any(), largest, zero)


WHITEN_EPS = 1e-8
"""Added to the variance before the square root, as verl's and TRL's ``masked_whiten``."""


def masked_whiten(x: Tensor, mask: Tensor) -> Tensor:
    """(x − mean) / √(var + 1e-8) over the True positions of ``mask``, 0 elsewhere; ``x``'s dtype.

    mean and the unbiased variance (divisor n − 1, as verl's ``masked_whiten``, which calls ``masked_var``
    with ``unbiased=True``) are taken over every True position of the whole [B, T] tensor, in float64.
    Unlike verl, one or zero True positions do not raise: the variance is then 0 and so is the result.
    """
    x64 = zero_masked(x.to(torch.float64), mask)
    count = mask.sum()
    mean = x64.sum() / count.clamp(min=1)
    centred = zero_masked(x64 - mean, mask)
    var = centred.square().sum() / (count - 1).clamp(min=1)
    return (centred * torch.rsqrt(var + WHITEN_EPS)).to(x.dtype)
