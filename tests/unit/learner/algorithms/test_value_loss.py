"""The critic's clipped value loss (``learner/algorithms/value.py``): by hand, against a loop, and invariance."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.algorithms import GlobalCounts, build_aggregation
from asyncrl.learner.algorithms.value import clipped_value_loss

NAN = math.nan
T_, F_ = True, False


def hand_batch() -> tuple[torch.Tensor, ...]:
    values = torch.tensor([[1.0, 0.5, 2.0], [3.0, NAN, NAN]], requires_grad=True)
    old = torch.tensor([[0.9, 0.0, 2.0], [0.0, 5.0, 5.0]])
    returns = torch.tensor([[0.0, 1.0, 2.5], [3.0, NAN, 7.0]])
    mask = torch.tensor([[T_, T_, T_], [T_, F_, F_]])
    return values, old, returns, mask


def test_clipped_value_loss_by_hand() -> None:
    values, old, returns, mask = hand_batch()
    out = clipped_value_loss(values, old, returns, mask, clip=0.2)
    # token (0,0): V=1.0 inside [0.7, 1.1]: both branches (1 − 0)² = 1        → ½·1    = 0.5
    # token (0,1): V=0.5 clipped to 0.2:  (0.5 − 1)² = .25 < (0.2 − 1)² = .64  → ½·.64  = 0.32  (clipped)
    # token (0,2): V=2.0 inside [1.8, 2.2]: (2 − 2.5)² = .25                   → ½·.25  = 0.125
    # token (1,0): V=3.0 clipped to 0.2:  (3 − 3)² = 0 < (0.2 − 3)² = 7.84     → ½·7.84 = 3.92  (clipped)
    # masked tokens: 0, whatever they hold (NaN included)
    expected = torch.tensor([[0.5, 0.32, 0.125], [3.92, 0.0, 0.0]])
    torch.testing.assert_close(out.per_token_loss, expected)
    assert out.metrics["value/clip_frac"].item() == pytest.approx(2 / 4)
    assert out.metrics["value/error"].item() == pytest.approx((1 + 0.25 + 0.25 + 0) / 4)
    assert out.metrics["value/mean"].item() == pytest.approx((1.0 + 0.5 + 2.0 + 3.0) / 4)

    # token_mean over the global count of 4 tokens: (0.5 + 0.32 + 0.125 + 3.92) / 4 = 1.21625
    loss = build_aggregation("token_mean")(out.per_token_loss, mask, GlobalCounts(tokens=4, sequences=2))
    assert loss.item() == pytest.approx(1.21625)
    loss.backward()
    # d/dV of ½(V − R)²/4 = (V − R)/4 where unclipped: (1 − 0)/4 = .25, (2 − 2.5)/4 = −.125; clipped tokens
    # sit outside the clip range, so their gradient is 0; masked positions get 0, not NaN.
    torch.testing.assert_close(values.grad, torch.tensor([[0.25, 0.0, -0.125], [0.0, 0.0, 0.0]]))


def test_zero_clip_is_plain_squared_error() -> None:
    values, old, returns, mask = hand_batch()
    out = clipped_value_loss(values, old, returns, mask, clip=0.0)
    # ½(V − R)²: ½·1, ½·.25, ½·.25, ½·0
    torch.testing.assert_close(out.per_token_loss, torch.tensor([[0.5, 0.125, 0.125], [0.0, 0.0, 0.0]]))
    assert out.metrics["value/clip_frac"].item() == 0.0
    with pytest.raises(ValueError, match="value clip must be >= 0"):
        clipped_value_loss(values, old, returns, mask, clip=-0.1)


def test_matches_a_loop_reference_and_ignores_padding() -> None:
    generator = torch.Generator().manual_seed(0)
    shape = (5, 7)
    values, old, returns = (torch.randn(shape, generator=generator) for _ in range(3))
    mask = torch.rand(shape, generator=generator) < 0.7
    eps = 0.3
    out = clipped_value_loss(values, old, returns, mask, clip=eps)
    for b in range(shape[0]):
        for t in range(shape[1]):
            v, o, r = values[b, t].item(), old[b, t].item(), returns[b, t].item()
            clipped = min(max(v, o - eps), o + eps)
            want = 0.5 * max((v - r) ** 2, (clipped - r) ** 2) if mask[b, t] else 0.0
            assert out.per_token_loss[b, t].item() == pytest.approx(want, abs=1e-6), (b, t)

    noisy = [torch.where(mask, x, torch.full_like(x, 1e6)) for x in (values, old, returns)]
    again = clipped_value_loss(*noisy, mask, clip=eps)
    torch.testing.assert_close(again.per_token_loss, out.per_token_loss)
    for name, value in out.metrics.items():
        torch.testing.assert_close(again.metrics[name], value, msg=name)
