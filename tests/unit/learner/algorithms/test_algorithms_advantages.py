"""Per-token advantage estimators (``gae``, ``reinforce_pp``), ``normalize``, whitening and the KL controller.

Three ways (STYLE.md rule 12): hand-computed tiny tensors with the arithmetic in a comment; plain Python
loops against the vectorized scans over seeded random shapes (responses starting at different indices
after a prompt, some with gaps); invariance (NaN at masked positions changes nothing).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest
import torch
from torch import Tensor

from asyncrl.common.config import ConfigError
from asyncrl.learner.algorithms import (
    ADVANTAGES,
    AdvantageInput,
    AdvantageSettings,
    KLController,
    KLRewardSettings,
    advantage_settings,
    build_advantage,
    settings_type,
)
from asyncrl.learner.algorithms.advantages import discounted_suffix_sum
from asyncrl.learner.algorithms.masked import masked_whiten

T_ = True
F_ = False
NAN = math.nan


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, (), generator=gen))


def _rows(values: list[list[float]]) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _ids(n: int) -> Tensor:
    return torch.zeros(n, dtype=torch.int64)


# --------------------------------------------------------------------------- by hand


def test_gae_by_hand_responses_starting_at_different_indices() -> None:
    # γ = 1, λ = 0.5, no whitening. NaN at every non-response position (prompt, padding).
    # Row 0: prompt at 0, response at 1..3, V = [·, 0.5, 0.4, 0.8], r = 1.
    #   δ3 = 1 + 0 − 0.8 = 0.2;  δ2 = 0 + 0.8 − 0.4 = 0.4;  δ1 = 0 + 0.4 − 0.5 = −0.1
    #   A3 = 0.2;  A2 = 0.4 + 0.5·0.2 = 0.5;  A1 = −0.1 + 0.5·0.5 = 0.15
    #   returns = A + V: 0.65, 0.9, 1.0
    # Row 1: response at 0..1, V = [0.2, 0.6], r = 0.
    #   δ1 = 0 + 0 − 0.6 = −0.6;  δ0 = 0 + 0.6 − 0.2 = 0.4;  A1 = −0.6;  A0 = 0.4 + 0.5·(−0.6) = 0.1
    #   returns: 0.3, 0.0
    mask = torch.tensor([[F_, T_, T_, T_, F_], [T_, T_, F_, F_, F_]])
    values = _rows([[NAN, 0.5, 0.4, 0.8, NAN], [0.2, 0.6, NAN, NAN, NAN]])
    inp = AdvantageInput(torch.tensor([1.0, 0.0]), _ids(2), mask, values=values)
    out = build_advantage("gae", {"gamma": 1.0, "lam": 0.5, "normalize": False})(inp)
    expected = torch.tensor([[0, 0.15, 0.5, 0.2, 0], [0.1, -0.6, 0, 0, 0]])
    torch.testing.assert_close(out.advantages, expected)
    assert out.returns is not None
    torch.testing.assert_close(out.returns, torch.tensor([[0, 0.65, 0.9, 1.0, 0], [0.3, 0.0, 0, 0, 0]]))
    assert out.advantages.dtype == torch.float32 and out.returns.dtype == torch.float32

    # Whitened (the default): tokens [0.15, 0.5, 0.2, 0.1, −0.6], mean 0.35/5 = 0.07; deviations
    # [0.08, 0.43, 0.13, 0.03, −0.67], Σd² = 0.658, unbiased var 0.658/4 = 0.1645, std 0.405586;
    # A = d / √(0.1645 + 1e-8) = [0.19725, 1.06019, 0.32052, 0.07397, −1.65193]. Returns are unchanged.
    whitened = build_advantage("gae", {"gamma": 1.0, "lam": 0.5})(inp)
    expected = torch.tensor([[0, 0.19725, 1.06019, 0.32052, 0], [0.07397, -1.65193, 0, 0, 0]])
    torch.testing.assert_close(whitened.advantages, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(whitened.returns, out.returns)


def test_gae_by_hand_with_discount_and_a_kl_penalty() -> None:
    # γ = 0.5, λ = 1, kl_coef 0.5, one row of two tokens, V = [1, 2], r = 4, token KL [0.2, 0.4].
    # token rewards: [−0.5·0.2, 4 − 0.5·0.4] = [−0.1, 3.8]
    # δ1 = 3.8 + 0 − 2 = 1.8;  δ0 = −0.1 + 0.5·2 − 1 = −0.1;  A1 = 1.8;  A0 = −0.1 + 0.5·1.8 = 0.8
    # returns: 0.8 + 1 = 1.8, 1.8 + 2 = 3.8 (= the discounted return −0.1 + 0.5·3.8 and 3.8, as λ = 1)
    mask = torch.ones(1, 2, dtype=torch.bool)
    inp = AdvantageInput(torch.tensor([4.0]), _ids(1), mask, token_kl=_rows([[0.2, 0.4]]), values=_rows([[1, 2]]))
    options = {"gamma": 0.5, "lam": 1.0, "kl_coef": 0.5, "normalize": False}
    out = build_advantage("gae", options)(inp)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.8, 1.8]]))
    torch.testing.assert_close(out.returns, torch.tensor([[1.8, 3.8]]))


def test_turn_rewards_credit_each_turn_where_it_was_earned() -> None:
    # REINFORCE++, γ = 0.5, no KL, no whitening. One episode: model turn [0, 1], an environment token at 2 (not a
    # response token), model turn [3, 4]; r = 1.5 of which the turns earned u = 0.5 (turn 1) and 1.0 (turn 2).
    # token rewards: 0.5 at 1, 1.0 + (1.5 − 0.5 − 1.0) = 1.0 at 4;
    #   G4 = 1.0;  G3 = 0.5·1.0 = 0.5;  G1 = 0.5 + 0.5·0.5 = 0.75;  G0 = 0.5·0.75 = 0.375.
    # Without turn rewards r sits at 4: G4 = 1.5, G3 = 0.75, G1 = 0.375, G0 = 0.1875.
    mask = torch.tensor([[T_, T_, F_, T_, T_]])
    turns = _rows([[0.0, 0.5, 0.0, 0.0, 1.0]])
    estimator = build_advantage("reinforce_pp", {"gamma": 0.5, "normalize": False})
    credited = estimator(AdvantageInput(torch.tensor([1.5]), _ids(1), mask, turn_rewards=turns))
    torch.testing.assert_close(credited.advantages, torch.tensor([[0.375, 0.75, 0.0, 0.5, 1.0]]))
    outcome = estimator(AdvantageInput(torch.tensor([1.5]), _ids(1), mask))
    torch.testing.assert_close(outcome.advantages, torch.tensor([[0.1875, 0.375, 0.0, 0.75, 1.5]]))
    # Group estimators see the episode's reward only: the same advantages with and without turn rewards.
    grpo = build_advantage("grpo", {})
    pair = (torch.tensor([1.5, 0.5]), _ids(2), mask.expand(2, -1))
    torch.testing.assert_close(
        grpo(AdvantageInput(*pair, turn_rewards=turns.expand(2, -1))).advantages, grpo(AdvantageInput(*pair)).advantages
    )


def test_reinforce_pp_by_hand() -> None:
    # γ = 0.5, kl_coef 0.5. Row 0: r = 1, KL [0.2, 0.4, 0.2] → token rewards [−0.1, −0.2, 1 − 0.1 = 0.9];
    #   G2 = 0.9;  G1 = −0.2 + 0.5·0.9 = 0.25;  G0 = −0.1 + 0.5·0.25 = 0.025.
    # Row 1: prompt at 0, response at 1..2, r = −1, KL [·, 0, 0.2] → rewards [0, −1 − 0.1 = −1.1];
    #   G2 = −1.1;  G1 = 0 + 0.5·(−1.1) = −0.55.
    mask = torch.tensor([[T_, T_, T_, F_], [F_, T_, T_, F_]])
    token_kl = _rows([[0.2, 0.4, 0.2, NAN], [NAN, 0.0, 0.2, NAN]])
    inp = AdvantageInput(torch.tensor([1.0, -1.0]), _ids(2), mask, token_kl=token_kl)
    raw = build_advantage("reinforce_pp", {"gamma": 0.5, "kl_coef": 0.5, "normalize": False})(inp)
    torch.testing.assert_close(raw.advantages, torch.tensor([[0.025, 0.25, 0.9, 0], [0, -0.55, -1.1, 0]]))
    assert raw.returns is None
    # Whitened (the default): tokens [0.025, 0.25, 0.9, −0.55, −1.1], mean −0.475/5 = −0.095; deviations
    # [0.12, 0.345, 0.995, −0.455, −1.005], Σd² = 2.3405, var 2.3405/4 = 0.585125, std 0.764935;
    # A = d/std = [0.15688, 0.45102, 1.30076, −0.59482, −1.31384].
    out = build_advantage("reinforce_pp", {"gamma": 0.5, "kl_coef": 0.5})(inp)
    expected = torch.tensor([[0.15688, 0.45102, 1.30076, 0], [0, -0.59482, -1.31384, 0]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=0)
    # The coefficient may come with the input (a KL controller's value), overriding the settings' 0.
    with_coef = AdvantageInput(inp.rewards, inp.group_ids, mask, token_kl=token_kl, kl_coef=0.5)
    torch.testing.assert_close(build_advantage("reinforce_pp", {"gamma": 0.5})(with_coef).advantages, out.advantages)


def test_a_kl_penalty_without_token_kl_is_refused() -> None:
    inp = AdvantageInput(torch.tensor([1.0]), _ids(1), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="token_kl"):
        build_advantage("reinforce_pp", {"kl_coef": 0.1})(inp)
    with pytest.raises(ValueError, match="token_kl"):
        build_advantage("reinforce_pp")(AdvantageInput(inp.rewards, inp.group_ids, inp.response_mask, kl_coef=0.1))
    with pytest.raises(ValueError, match="values"):
        build_advantage("gae")(inp)
    with pytest.raises(ValueError, match="kl_coef"):
        AdvantageInput(inp.rewards, inp.group_ids, inp.response_mask, kl_coef=-1.0)
    # A coefficient of 0 needs no KL: plain outcome return-to-go.
    torch.testing.assert_close(
        build_advantage("reinforce_pp", {"normalize": False})(inp).advantages, torch.tensor([[1.0, 1.0]])
    )


def test_normalize_by_hand_on_grpo() -> None:
    # grpo (ε 0) of rewards [1, 0, 1, 1] in one group: [0.5, −1.5, 0.5, 0.5] per sequence; with 3, 1, 2, 0
    # response tokens the token values are 0.5 ×5 and −1.5 ×1: mean 1/6, deviations 1/3 ×5 and −5/3,
    # Σd² = 5/9 + 25/9 = 10/3, unbiased var (10/3)/5 = 2/3, std 0.816497; A = [0.40825 ×5, −2.04124].
    mask = torch.tensor([[T_, T_, T_], [T_, F_, F_], [T_, T_, F_], [F_, F_, F_]])
    inp = AdvantageInput(torch.tensor([1.0, 0.0, 1.0, 1.0]), _ids(4), mask)
    out = build_advantage("grpo", {"epsilon": 0.0, "normalize": True})(inp)
    a, b = 0.40825, -2.04124
    torch.testing.assert_close(
        out.advantages, torch.tensor([[a, a, a], [b, 0, 0], [a, a, 0], [0, 0, 0]]), atol=1e-5, rtol=0
    )


def test_masked_whiten_edge_cases() -> None:
    # Equal values, a single token and no token at all give 0, never NaN; padding is never read.
    mask = torch.tensor([[T_, T_, F_]])
    assert not masked_whiten(torch.tensor([[0.1, 0.1, NAN]]), mask).any()
    assert not masked_whiten(torch.tensor([[5.0, NAN, NAN]]), torch.tensor([[T_, F_, F_]])).any()
    assert not masked_whiten(torch.full((1, 3), NAN), torch.zeros(1, 3, dtype=torch.bool)).any()
    # Two tokens [1, 3]: mean 2, unbiased var ((−1)² + 1²)/1 = 2 → ±1/√2.
    torch.testing.assert_close(
        masked_whiten(torch.tensor([[1.0, 3.0, NAN]]), mask), torch.tensor([[-0.70711, 0.70711, 0]]), atol=1e-5, rtol=0
    )


# --------------------------------------------------------------------------- loop references


def _batch(seed: int) -> tuple[AdvantageInput, dict[str, Any]]:
    """Rows of [prompt | response | padding]: the response starts at a random index; in some rows a span of
    observation tokens (masked) sits inside the response. Values, KL and rewards random; a random empty row."""
    gen = _generator(seed)
    b, t = _randint(gen, 1, 6), _randint(gen, 1, 12)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for row in range(b):
        start = _randint(gen, 0, t - 1)
        stop = _randint(gen, start, t)
        mask[row, start:stop] = True
        if stop - start >= 4 and seed % 2:
            gap = _randint(gen, start + 1, stop - 2)
            mask[row, gap] = False
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    token_kl = 0.1 * torch.rand(b, t, generator=gen, dtype=torch.float64)
    rewards = torch.randn(b, generator=gen)
    options = {
        "gamma": float(torch.rand((), generator=gen)) if seed % 3 else 1.0,
        "lam": float(torch.rand((), generator=gen)),
        "kl_coef": 0.0 if seed % 4 == 0 else 0.3,
    }
    return AdvantageInput(rewards, _ids(b), mask, token_kl=token_kl, values=values), options


def _loop_token_rewards(inp: AdvantageInput, kl_coef: float) -> list[dict[int, float]]:
    rows = []
    for i, row in enumerate(inp.response_mask.tolist()):
        positions = [t for t, m in enumerate(row) if m]
        rows.append({t: -kl_coef * float(inp.token_kl[i, t]) for t in positions})
        if positions:
            rows[-1][positions[-1]] += float(inp.rewards[i])
    return rows


def _loop_gae(inp: AdvantageInput, gamma: float, lam: float, kl_coef: float) -> tuple[list[list[float]], ...]:
    """verl's recursion, one response token at a time, non-response positions skipped."""
    b, t = inp.response_mask.shape
    advantages, returns = [[0.0] * t for _ in range(b)], [[0.0] * t for _ in range(b)]
    for i, rewards in enumerate(_loop_token_rewards(inp, kl_coef)):
        next_value, running = 0.0, 0.0
        for pos in sorted(rewards, reverse=True):
            value = float(inp.values[i, pos])
            running = rewards[pos] + gamma * next_value - value + gamma * lam * running
            advantages[i][pos], returns[i][pos] = running, running + value
            next_value = value
    return advantages, returns


def _loop_reinforce_pp(inp: AdvantageInput, gamma: float, kl_coef: float) -> list[list[float]]:
    b, t = inp.response_mask.shape
    out = [[0.0] * t for _ in range(b)]
    for i, rewards in enumerate(_loop_token_rewards(inp, kl_coef)):
        running = 0.0
        for pos in sorted(rewards, reverse=True):
            running = rewards[pos] + gamma * running
            out[i][pos] = running
    return out


def _loop_whiten(x: list[list[float]], mask: Tensor) -> list[list[float]]:
    kept = [v for row, mrow in zip(x, mask.tolist(), strict=True) for v, m in zip(row, mrow, strict=True) if m]
    mean = statistics.fmean(kept) if kept else 0.0
    var = sum((v - mean) ** 2 for v in kept) / max(len(kept) - 1, 1)
    scale = 1 / math.sqrt(var + 1e-8)
    return [
        [(v - mean) * scale if m else 0.0 for v, m in zip(row, mrow, strict=True)]
        for row, mrow in zip(x, mask.tolist(), strict=True)
    ]


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_gae_matches_a_loop_reference(seed: int, normalize: bool) -> None:
    inp, options = _batch(seed)
    out = build_advantage("gae", {**options, "normalize": normalize})(inp)
    advantages, returns = _loop_gae(inp, options["gamma"], options["lam"], options["kl_coef"])
    if normalize:
        advantages = _loop_whiten(advantages, inp.response_mask)
    torch.testing.assert_close(out.advantages, torch.tensor(advantages, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.returns, torch.tensor(returns, dtype=torch.float32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_reinforce_pp_matches_a_loop_reference(seed: int, normalize: bool) -> None:
    inp, options = _batch(seed)
    settings = {"gamma": options["gamma"], "kl_coef": options["kl_coef"], "normalize": normalize}
    expected = _loop_reinforce_pp(inp, options["gamma"], options["kl_coef"])
    if normalize:
        expected = _loop_whiten(expected, inp.response_mask)
    out = build_advantage("reinforce_pp", settings)(inp)
    torch.testing.assert_close(out.advantages, torch.tensor(expected, dtype=torch.float32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [0, 1, 2, 3, 7, 8, 9, 33])
def test_discounted_suffix_sum_matches_a_loop(length: int) -> None:
    gen = _generator(length)
    x = torch.randn(3, length, generator=gen, dtype=torch.float64)
    d = torch.rand(3, length, generator=gen, dtype=torch.float64)
    d[0] = 1.0  # a plain suffix sum
    expected = torch.zeros_like(x)
    for t in reversed(range(length)):
        expected[:, t] = x[:, t] + (d[:, t] * expected[:, t + 1] if t + 1 < length else 0.0)
    torch.testing.assert_close(discounted_suffix_sum(x, d), expected)


# --------------------------------------------------------------------------- invariance


@pytest.mark.parametrize("name", ["gae", "reinforce_pp"])
@pytest.mark.parametrize("seed", range(4))
def test_per_token_estimators_ignore_what_padding_holds(name: str, seed: int) -> None:
    inp, options = _batch(seed)
    options = options if name == "gae" else {"gamma": options["gamma"], "kl_coef": options["kl_coef"]}
    junk = torch.tensor([NAN, math.inf, -math.inf, 1e30], dtype=torch.float64)

    def spoil(x: Tensor) -> Tensor:
        return torch.where(inp.response_mask, x, junk[torch.randint(0, 4, x.shape, generator=_generator(seed))])

    spoiled = AdvantageInput(inp.rewards, inp.group_ids, inp.response_mask, spoil(inp.token_kl), spoil(inp.values))
    clean, dirty = build_advantage(name, options)(inp), build_advantage(name, options)(spoiled)
    torch.testing.assert_close(dirty.advantages, clean.advantages)
    assert bool(clean.advantages.isfinite().all()) and not clean.advantages[~inp.response_mask].any()
    if name == "gae":
        torch.testing.assert_close(dirty.returns, clean.returns)


def test_advantages_never_carry_a_gradient() -> None:
    inp, options = _batch(5)
    values, token_kl = inp.values.clone().requires_grad_(), inp.token_kl.clone().requires_grad_()
    out = build_advantage("gae", options)(
        AdvantageInput(inp.rewards, inp.group_ids, inp.response_mask, token_kl, values)
    )
    assert not out.advantages.requires_grad and not out.returns.requires_grad


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "batch_mean", "gae", "reinforce_pp"])
def test_every_estimator_normalizes_over_the_batch_tokens(name: str) -> None:
    inp, _ = _batch(7)
    raw = build_advantage(name, {"normalize": False})(inp).advantages
    out = build_advantage(name, {"normalize": True})(inp).advantages
    torch.testing.assert_close(out, masked_whiten(raw.double(), inp.response_mask).float())
    kept = out[inp.response_mask].double()
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert kept.std().item() == pytest.approx(1.0, abs=1e-4) or raw[inp.response_mask].std() < 1e-6


def test_every_estimator_settings_derive_from_the_advantage_base() -> None:
    for name in ADVANTAGES.names():
        assert issubclass(settings_type(ADVANTAGES.get(name)), AdvantageSettings), name
    assert advantage_settings("grpo").normalize is False
    assert advantage_settings("gae").normalize is True and advantage_settings("reinforce_pp").normalize is True
    assert advantage_settings("gae").lam == 0.95 and advantage_settings("gae").gamma == 1.0
    with pytest.raises(ConfigError, match="'whiten'"):
        advantage_settings("gae", {"whiten": False})
    with pytest.raises(ConfigError, match="'lam'"):
        advantage_settings("gae", {"lam": 1.5})


# --------------------------------------------------------------------------- KL controller


def test_adaptive_kl_controller_by_hand() -> None:
    # β 0.1, target 1, horizon 100.
    # KL 1.5 on 10 samples: e = clip(1.5/1 − 1, ±0.2) = 0.2; β = 0.1 · (1 + 0.2·10/100) = 0.102.
    # KL 0.95 on 20 samples: e = −0.05; β = 0.102 · (1 − 0.05·20/100) = 0.102 · 0.99 = 0.10098.
    # KL 0 on 50 samples: e = clip(−1) = −0.2; β = 0.10098 · (1 − 0.2·0.5) = 0.090882.
    controller = KLController(KLRewardSettings(mode="adaptive", coef=0.1, target=1.0, horizon=100))
    assert controller.coef == 0.1
    assert controller.update(1.5, 10) == pytest.approx(0.102)
    assert controller.update(0.95, 20) == pytest.approx(0.10098)
    assert controller.update(0.0, 50) == pytest.approx(0.090882)
    assert controller.coef == pytest.approx(0.090882)
    resumed = KLController(controller.settings, coef=controller.coef)  # restored from a checkpoint
    assert resumed.coef == controller.coef


def test_fixed_and_off_kl_controllers() -> None:
    fixed = KLController(KLRewardSettings(mode="fixed", coef=0.05))
    assert fixed.update(10.0, 1000) == 0.05 and fixed.coef == 0.05
    off = KLController(KLRewardSettings(coef=0.05))  # mode off is the default
    assert off.coef == 0.0 and off.update(10.0, 1000) == 0.0
    with pytest.raises(ValueError, match="observed KL"):
        fixed.update(math.nan, 1)
    for bad in ({"mode": "pid"}, {"target": 0.0}, {"horizon": -1.0}, {"coef": -0.1}, {"coeff": 1.0}):
        with pytest.raises(ValueError):
            KLRewardSettings(**bad)
