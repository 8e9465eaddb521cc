"""Algorithm registries and their maths, three ways (STYLE.md rule 12).

Hand-computed tiny tensors with the arithmetic in a comment; a plain Python loop reference against the
vectorized code over seeded random shapes; invariance (padding never changes a result, micro-batching
never changes the aggregated loss). Registry tests register only inside ``snapshot()``.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest
import torch
from pydantic import BaseModel
from torch import Tensor

from asyncrl.common.config import ConfigError
from asyncrl.learner.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    ALL_REGISTRIES,
    KL_ESTIMATORS,
    LOSSES,
    AdvantageInput,
    AdvantageOutput,
    GlobalCounts,
    LossInput,
    LossOutput,
    OffPolicySettings,
    Settings,
    advantage_settings,
    aggregation_settings,
    build_advantage,
    build_aggregation,
    build_kl_estimator,
    build_loss,
    kl_settings,
    loss_settings,
    register_advantage,
    register_loss,
    settings_tag,
    settings_type,
)
from asyncrl.learner.algorithms.advantages import GRPOSettings
from asyncrl.learner.algorithms.losses import PPOClipSettings, mismatch_kl, ppo_clip
from asyncrl.learner.algorithms.masked import zero_masked

T_ = True
F_ = False
AGGREGATION_OPTIONS: dict[str, dict[str, Any]] = {
    "token_mean": {},
    "seq_mean_token_sum": {},
    "seq_mean_token_mean": {},
    "seq_mean_token_sum_norm": {"norm": 4.0},
}


# --------------------------------------------------------------------------- a user's loss, by import path


class MyLossSettings(Settings):
    scale: float = 1.0


def my_loss(inp: LossInput, settings: MyLossSettings) -> LossOutput:
    """Plain REINFORCE, −scale · A · log π_θ per token: named in tests by its import path
    (``tests.unit.learner.algorithms.test_algorithms:my_loss``)."""
    per_token = -settings.scale * inp.advantages * inp.logprobs
    return LossOutput(per_token_loss=zero_masked(per_token, inp.response_mask), metrics={})


class NeedyLossSettings(Settings):
    wants: tuple[str, ...] = ("entropy",)

    def requires(self) -> frozenset[Any]:
        return frozenset(self.wants)  # strings, as a user's own variant may name them


def needy_loss(inp: LossInput, settings: NeedyLossSettings) -> LossOutput:
    """:func:`my_loss` with scale 1, whose settings require ``wants``."""
    return my_loss(inp, MyLossSettings())


class PlainModelSettings(BaseModel):  # a pydantic model, but no Settings: it cannot say what the loss requires
    scale: float = 1.0


def plain_model_loss(inp: LossInput, settings: PlainModelSettings) -> LossOutput:
    raise AssertionError("never called")


# --------------------------------------------------------------------------- helpers


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, (), generator=gen))


def _advantage_batch(seed: int) -> AdvantageInput:
    """Random groups (sizes 1-5, sparse unsorted int64 ids, shuffled), rewards binary or continuous."""
    gen = _generator(seed)
    sizes = [_randint(gen, 1, 5) for _ in range(_randint(gen, 1, 5))]
    ids = torch.cat([torch.full((n,), 1000 * g + 7) for g, n in enumerate(sizes)])
    ids = ids[torch.randperm(len(ids), generator=gen)]
    b, t = len(ids), _randint(gen, 1, 6)
    rewards = torch.randn(b, generator=gen) if seed % 2 else (torch.rand(b, generator=gen) < 0.5).float()
    return AdvantageInput(rewards, ids, torch.rand(b, t, generator=gen) < 0.7)


def _loss_batch(seed: int, dtype: torch.dtype = torch.float64) -> LossInput:
    """Random log-probs: μ in (−3, 0], π_old and π_θ each ~0.3 nats away, a reference ~0.3 nats from π_θ."""
    gen = _generator(seed)
    b, t = _randint(gen, 1, 6), _randint(gen, 1, 8)

    def noise() -> Tensor:
        return 0.3 * torch.randn(b, t, generator=gen, dtype=dtype)

    behaviour = -3 * torch.rand(b, t, generator=gen, dtype=dtype)
    old = behaviour + noise()
    logprobs = (old + noise()).requires_grad_()
    advantages = torch.randn(b, t, generator=gen, dtype=dtype)
    mask = torch.rand(b, t, generator=gen) < 0.75
    return LossInput(logprobs, old, behaviour, advantages, mask, logprobs.detach() + noise())


def _with_garbage_padding(inp: LossInput, seed: int) -> LossInput:
    """The same batch with NaN, ±inf and huge values at every masked position (a fresh π_θ leaf)."""
    gen = _generator(seed)
    junk = torch.tensor([math.nan, math.inf, -math.inf, 1e30, -1e30], dtype=inp.logprobs.dtype)

    def spoil(x: Tensor) -> Tensor:
        pick = junk[torch.randint(0, len(junk), x.shape, generator=gen)]
        return torch.where(inp.response_mask, x.detach(), pick)

    return LossInput(
        spoil(inp.logprobs).requires_grad_(),
        spoil(inp.old_logprobs),
        spoil(inp.behaviour_logprobs),
        spoil(inp.advantages),
        inp.response_mask,
        spoil(inp.ref_logprobs) if inp.ref_logprobs is not None else None,
    )


def _one_row(values: list[float]) -> Tensor:
    return torch.tensor([values], dtype=torch.float64)


def _loss_input(
    ratios: list[float], advantages: list[float], weights: list[float] | None = None, rows: int = 1
) -> LossInput:
    """rows × T tokens with π_θ/π_old = ratios and π_old/μ = weights (π_old = 0 nats), all unmasked."""
    ratio = torch.tensor(ratios, dtype=torch.float64).reshape(rows, -1)
    weight = torch.tensor(weights or [1.0] * len(ratios), dtype=torch.float64).reshape(rows, -1)
    old = torch.zeros_like(ratio)
    return LossInput(
        ratio.log().requires_grad_(),
        old,
        old - weight.log(),
        torch.tensor(advantages, dtype=torch.float64).reshape(rows, -1),
        torch.ones(ratio.shape, dtype=torch.bool),
    )


def _ppo(inp: LossInput, **options: Any) -> LossOutput:
    return build_loss("ppo_clip", options)(inp)


# --------------------------------------------------------------------------- advantages: by hand


def test_grpo_by_hand_one_group_uses_the_unbiased_std() -> None:
    # rewards [1, 0, 1, 1]: mean 0.75; deviations [0.25, −0.75, 0.25, 0.25];
    # Σd² = 3·0.0625 + 0.5625 = 0.75; unbiased var = 0.75 / (4 − 1) = 0.25, std 0.5
    # (the biased std would be √0.1875 ≈ 0.433); A = d / 0.5 = [0.5, −1.5, 0.5, 0.5].
    mask = torch.tensor([[T_, T_, T_], [T_, F_, F_], [T_, T_, F_], [F_, F_, F_]])
    inp = AdvantageInput(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.zeros(4, dtype=torch.int64), mask)
    out = build_advantage("grpo", {"epsilon": 0.0})(inp)
    expected = torch.tensor([[0.5, 0.5, 0.5], [-1.5, 0, 0], [0.5, 0.5, 0], [0, 0, 0]])
    torch.testing.assert_close(out.advantages, expected)
    assert out.advantages.dtype == torch.float32 and out.returns is None


def test_grpo_by_hand_several_groups_equal_rewards_and_a_lone_sequence() -> None:
    # ids [7, 3, 7, 3, 5], rewards [1, 2, 0, 2, 4]. Group 7: [1, 0], mean 0.5, d ±0.5, var 0.5/1,
    # std √0.5 ≈ 0.70711, A = ±0.5/0.70711 = ±0.70711. Group 3: [2, 2], std 0, A = 0/(0 + ε) = 0.
    # Group 5: one sequence, no baseline: A = 0.
    ids = torch.tensor([7, 3, 7, 3, 5])
    inp = AdvantageInput(torch.tensor([1.0, 2.0, 0.0, 2.0, 4.0]), ids, torch.ones(5, 1, dtype=torch.bool))
    out = build_advantage("grpo")(inp)
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor([0.70711, 0, -0.70711, 0, 0]), atol=1e-5, rtol=0)


def test_dr_grpo_rloo_and_batch_mean_by_hand() -> None:
    inp = AdvantageInput(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.zeros(4, dtype=torch.int64), torch.ones(4, 1).bool())
    # dr_grpo: r − mean = [0.25, −0.75, 0.25, 0.25]; grpo with scale=False is the same.
    dr = torch.tensor([0.25, -0.75, 0.25, 0.25])
    torch.testing.assert_close(build_advantage("dr_grpo")(inp).advantages[:, 0], dr)
    torch.testing.assert_close(build_advantage("grpo", {"scale": False})(inp).advantages[:, 0], dr)
    # rloo: r_i − mean of the others: 1 − (0+1+1)/3 = 1/3; 0 − (1+1+1)/3 = −1; = 4/3 · (r − mean).
    rloo = build_advantage("rloo")(inp).advantages[:, 0]
    torch.testing.assert_close(rloo, torch.tensor([1 / 3, -1.0, 1 / 3, 1 / 3]))
    # batch_mean ignores groups: rewards [1, 0, 2, 3] in two groups, batch mean 1.5.
    two = AdvantageInput(torch.tensor([1.0, 0.0, 2.0, 3.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1).bool())
    torch.testing.assert_close(
        build_advantage("batch_mean")(two).advantages[:, 0], torch.tensor([-0.5, -1.5, 0.5, 1.5])
    )


def test_float32_rewards_that_are_equal_give_exactly_zero() -> None:
    # 0.1 is not representable: a float32 mean leaves a residual that (std + ε) would blow up to ~1e-3.
    inp = AdvantageInput(torch.full((3,), 0.1), torch.zeros(3, dtype=torch.int64), torch.ones(3, 2).bool())
    assert build_advantage("grpo")(inp).advantages.abs().max().item() == 0.0


# --------------------------------------------------------------------------- advantages: loop reference


def _advantage_reference(name: str, rewards: list[float], ids: list[int], epsilon: float = 1e-6) -> list[float]:
    groups: dict[int, list[float]] = {}
    for r, g in zip(rewards, ids, strict=True):
        groups.setdefault(g, []).append(r)
    out = []
    for r, g in zip(rewards, ids, strict=True):
        members, mean = groups[g], statistics.fmean(groups[g])
        n = len(members)
        if name == "batch_mean":
            out.append(r - statistics.fmean(rewards))
        elif n == 1:
            out.append(0.0)
        elif name == "grpo":
            out.append((r - mean) / (statistics.stdev(members) + epsilon))
        elif name == "dr_grpo":
            out.append(r - mean)
        else:  # rloo
            out.append(r - (sum(members) - r) / (n - 1))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "batch_mean"])
def test_advantages_match_a_loop_reference(name: str, seed: int) -> None:
    inp = _advantage_batch(seed)
    per_sequence = _advantage_reference(name, inp.rewards.tolist(), inp.group_ids.tolist())
    expected = torch.tensor(per_sequence)[:, None] * inp.response_mask
    torch.testing.assert_close(build_advantage(name)(inp).advantages, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "batch_mean"])
def test_advantages_ignore_what_padding_holds(name: str) -> None:
    inp = _advantage_batch(3)
    spoiled = torch.where(inp.response_mask, torch.zeros(inp.response_mask.shape), math.nan)
    noisy = AdvantageInput(inp.rewards, inp.group_ids, inp.response_mask, token_kl=spoiled, values=spoiled)
    out, out_noisy = build_advantage(name)(inp), build_advantage(name)(noisy)
    torch.testing.assert_close(out.advantages, out_noisy.advantages)
    assert not out.advantages[~inp.response_mask].any()


# --------------------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand() -> None:
    # log π_θ = 0; log π_ref = ln 2 → log r = 0.693147; ln 0.5 → log r = −0.693147.
    # k1 = −log r: −0.693147, 0.693147.   k2 = (log r)²/2 = 0.480453/2 = 0.240227 (both).
    # k3 = r − 1 − log r: 2 − 1 − 0.693147 = 0.306853; 0.5 − 1 + 0.693147 = 0.193147.
    logprobs = torch.zeros(1, 2, dtype=torch.float64)
    ref = torch.tensor([[math.log(2.0), math.log(0.5)]], dtype=torch.float64)
    expected = {"k1": [-0.693147, 0.693147], "k2": [0.240227, 0.240227], "k3": [0.306853, 0.193147]}
    for name, values in expected.items():
        torch.testing.assert_close(
            build_kl_estimator(name)(logprobs, ref)[0], torch.tensor(values).double(), atol=1e-6, rtol=0
        )


def test_k3_clamps_the_log_ratio() -> None:
    # log r = 50 is clamped to 20: k3 = e^20 − 1 − 20 (finite), not e^50; log r = −50 → e^−20 − 1 + 20.
    unclamped = {"value_clamp": 1e30}
    out = build_kl_estimator("k3", unclamped)(torch.zeros(1, 2), torch.tensor([[50.0, -50.0]]))
    torch.testing.assert_close(out[0], torch.tensor([math.exp(20) - 21, math.exp(-20) + 19]))
    narrower = build_kl_estimator("k3", {"clamp": 1.0})(torch.zeros(1, 1), torch.tensor([[50.0]]))
    torch.testing.assert_close(narrower[0, 0], torch.tensor(math.e - 2))


def test_the_mismatch_of_two_float32_computations_of_one_policy_is_measured_not_zero() -> None:
    # log w = ±1e-6, 2e-6 per token: KL ≈ (log w)² / 2, 1e-12 on average. As exp(x) − 1 − x in float32: −1.1e-8.
    log_w = torch.tensor([[1e-6, -1e-6, 2e-6, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    kl = mismatch_kl(log_w, mask).item()
    assert kl == pytest.approx((1 + 1 + 4) * 1e-12 / 2 / 3, rel=1e-3)


def test_k3_clamps_its_value_as_verl_does() -> None:
    # log r = 19.9: e^19.9 − 1 − 19.9 = 4.39e8 → 10, and no gradient through the clamped token;
    # log r = 2: e^2 − 1 − 2 = 4.389056 (below 10: unchanged, gradient 1 − r = 1 − e^2 = −6.389056).
    logprobs = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[19.9, 2.0]], dtype=torch.float64)
    out = build_kl_estimator("k3")(logprobs, ref)
    torch.testing.assert_close(out[0], torch.tensor([10.0, math.exp(2) - 3], dtype=torch.float64))
    out.sum().backward()
    torch.testing.assert_close(logprobs.grad[0], torch.tensor([0.0, 1 - math.exp(2)], dtype=torch.float64))
    wider = build_kl_estimator("k3", {"value_clamp": 1e9})(logprobs.detach(), ref)
    assert wider[0, 0] == pytest.approx(math.exp(19.9) - 20.9)  # 4.4e8: what one token used to contribute


@pytest.mark.parametrize("seed", range(3))
def test_kl_estimators_match_a_loop_reference_and_k2_k3_are_non_negative(seed: int) -> None:
    gen = _generator(seed)
    logprobs, ref = -3 * torch.rand(4, 5, generator=gen, dtype=torch.float64), torch.randn(4, 5, generator=gen).double()
    formulas = {"k1": lambda lr: -lr, "k2": lambda lr: lr * lr / 2, "k3": lambda lr: min(math.exp(lr) - 1 - lr, 10)}
    for name, formula in formulas.items():
        out = build_kl_estimator(name)(logprobs, ref)
        log_r = (ref - logprobs).flatten().tolist()
        torch.testing.assert_close(out.flatten(), torch.tensor([formula(x) for x in log_r], dtype=torch.float64))
        assert name == "k1" or bool((out >= 0).all())


def test_kl_gradient_reaches_the_policy_only() -> None:
    # d k3 / d log π_θ = d (r − 1 − log r)/d log π_θ with log r = log π_ref − log π_θ: −r + 1 = 1 − 2 = −1.
    logprobs, ref = torch.zeros(1, 1, requires_grad=True), torch.full((1, 1), math.log(2.0), requires_grad=True)
    build_kl_estimator("k3")(logprobs, ref).sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0]]))
    assert ref.grad is None


# --------------------------------------------------------------------------- ppo_clip: by hand


def test_ppo_clip_by_hand_and_the_clip_fraction() -> None:
    # ε = 0.2, π_old = μ (w = 1). Token: r, A → −A·r vs −A·clip(r, 0.8, 1.2) → max (clipped branch larger?)
    # t0: 1.5, +1 → −1.5 vs −1.2 → −1.2 (yes)   t1: 0.5, +1 → −0.5 vs −0.8 → −0.5 (no)
    # t2: 1.1, −1 → 1.1 vs 1.1 → 1.1 (tie: no)   t3: 0.7, −1 → 0.7 vs 0.8 → 0.8 (yes)
    # clip fraction 2/4 = 0.5; ratio mean (1.5 + 0.5 + 1.1 + 0.7)/4 = 0.95.
    out = _ppo(_loss_input([1.5, 0.5, 1.1, 0.7], [1, 1, -1, -1]))
    torch.testing.assert_close(out.per_token_loss, _one_row([-1.2, -0.5, 1.1, 0.8]))
    assert out.metrics["loss/clip_frac"].item() == pytest.approx(0.5)
    assert out.metrics["loss/ratio_mean"].item() == pytest.approx(0.95)
    # clip-higher ε_high = 0.28: t0 becomes −1.28, the rest are unchanged.
    higher = _ppo(_loss_input([1.5, 0.5, 1.1, 0.7], [1, 1, -1, -1]), clip_high=0.28)
    torch.testing.assert_close(higher.per_token_loss, _one_row([-1.28, -0.5, 1.1, 0.8]))


def test_dual_clip_by_hand() -> None:
    # c = 3. t0: r 5, A −1 → max(5, 1.2) = 5 → min(5, 3) = 3 (bound).   t1: r 2, A −1 → max(2, 1.2) = 2 → 2.
    # t2: r 5, A +1 → max(−5, −1.2) = −1.2 (A > 0: no dual clip). Dual-clip fraction 1/3.
    out = _ppo(_loss_input([5.0, 2.0, 5.0], [-1, -1, 1]), dual_clip=3.0)
    torch.testing.assert_close(out.per_token_loss, _one_row([3.0, 2.0, -1.2]))
    assert out.metrics["loss/dual_clip_frac"].item() == pytest.approx(1 / 3)
    without = _ppo(_loss_input([5.0, 2.0, 5.0], [-1, -1, 1]))
    torch.testing.assert_close(without.per_token_loss, _one_row([5.0, 2.0, -1.2]))


NO_BEHAVIOUR_CLIP = {"behaviour_clip": False}
"""The weight tests below show π_old/μ alone; the behaviour clip has its own test."""


def test_behaviour_clip_by_hand() -> None:
    # r = 1, ε = 0.2 (band [0.8, 1.2] around μ), truncation at 2. ρ = π_old/μ, A → kept?
    # t0: 1.5, +1 → above 1.2 pushing up: clipped.   t1: 1.5, −1 → pushing down, towards μ: kept, −A·min(ρ, 2) = 1.5.
    # t2: 0.5, −1 → below 0.8 pushing down: clipped.  t3: 0.5, +1 → kept, −0.5.   t4: 1.1, +1 → inside: kept, −1.1.
    inp = _loss_input([1, 1, 1, 1, 1], [1, -1, -1, 1, 1], weights=[1.5, 1.5, 0.5, 0.5, 1.1])
    out = _ppo(inp, off_policy={"max_sequence_kl": 0, "veto": 0})
    torch.testing.assert_close(out.per_token_loss, _one_row([0.0, 1.5, 0.0, -0.5, -1.1]))
    assert out.metrics["offpolicy/behaviour_clip_frac"].item() == pytest.approx(2 / 5)
    # clip-higher moves the upper edge: ε_high = 0.6 keeps t0 (1.5 < 1.6)
    higher = _ppo(inp, clip_high=0.6, off_policy={"max_sequence_kl": 0, "veto": 0})
    torch.testing.assert_close(higher.per_token_loss, _one_row([-1.5, 1.5, 0.0, -0.5, -1.1]))
    # off, or with μ standing in for π_old (correction none: ρ = 1), nothing is clipped by it
    off = _ppo(inp, off_policy={"max_sequence_kl": 0, "veto": 0, **NO_BEHAVIOUR_CLIP})
    torch.testing.assert_close(off.per_token_loss, _one_row([-1.5, 1.5, 0.5, -0.5, -1.1]))
    assert "offpolicy/behaviour_clip_frac" not in off.metrics


def test_off_policy_corrections_by_hand_token_level() -> None:
    # π_θ = π_old (r = 1), A = 1 → surrogate −1 per token; w = π_old/μ = [3, 0.25, 1.5, 1], cap 2.
    # truncate: w = [2, 0.25, 1.5, 1], 1 of 4 corrected; weight mean 4.75/4 = 1.1875; raw max 3.
    # mask (band [0.5, 2]): w = [0, 0, 1.5, 1], 2 of 4 corrected.   none: w = 1.
    inp = _loss_input([1, 1, 1, 1], [1, 1, 1, 1], weights=[3, 0.25, 1.5, 1])
    truncate = _ppo(inp, off_policy={**NO_BEHAVIOUR_CLIP, "correction": "truncate", "cap": 2.0})
    torch.testing.assert_close(truncate.per_token_loss, _one_row([-2.0, -0.25, -1.5, -1.0]))
    assert truncate.metrics["offpolicy/corrected_frac"].item() == pytest.approx(0.25)
    assert truncate.metrics["offpolicy/weight_mean"].item() == pytest.approx(1.1875)
    assert truncate.metrics["offpolicy/weight_max"].item() == pytest.approx(3.0)
    masked = _ppo(inp, off_policy={**NO_BEHAVIOUR_CLIP, "correction": "mask", "cap": 2.0})
    torch.testing.assert_close(masked.per_token_loss, _one_row([0.0, 0.0, -1.5, -1.0]))
    assert masked.metrics["offpolicy/corrected_frac"].item() == pytest.approx(0.5)
    none = _ppo(inp, off_policy={**NO_BEHAVIOUR_CLIP, "correction": "none"})
    torch.testing.assert_close(none.per_token_loss, _one_row([-1.0] * 4))
    # mismatch KL(μ ‖ π_old) = mean of w − 1 − ln w: 3 → 0.901388; 0.25 → 0.636294; 1.5 → 0.094535; 1 → 0;
    # (0.901388 + 0.636294 + 0.094535)/4 = 0.408054.
    assert truncate.metrics["offpolicy/mismatch_kl"].item() == pytest.approx(0.408054, abs=1e-6)


def test_off_policy_corrections_by_hand_sequence_level() -> None:
    # Two sequences of two tokens, r = 1, A = 1. Token w: [1.5, 2] and [0.5, 1.2];
    # sequence w = product: 3 and 0.6. truncate cap 2: [2, 2] and [0.6, 0.6]; mask band [0.5, 2]: [0, 0], [0.6, 0.6].
    inp = _loss_input([1, 1, 1, 1], [1, 1, 1, 1], weights=[1.5, 2, 0.5, 1.2], rows=2)
    level = {"level": "sequence", "cap": 2.0, **NO_BEHAVIOUR_CLIP}
    truncate = _ppo(inp, off_policy={"correction": "truncate", **level})
    torch.testing.assert_close(truncate.per_token_loss, -torch.tensor([[2.0, 2.0], [0.6, 0.6]], dtype=torch.float64))
    masked = _ppo(inp, off_policy={"correction": "mask", **level})
    torch.testing.assert_close(masked.per_token_loss, -torch.tensor([[0.0, 0.0], [0.6, 0.6]], dtype=torch.float64))


def test_mismatch_guard_and_token_veto_drop_whole_sequences_by_hand() -> None:
    # Two sequences of two tokens, r = 1, A = 1, token w = [1.5, 2] and [0.5, 1.2], token-level truncation at 2.
    # k3 = w − 1 − ln w: 1.5 → 0.094535, 2 → 0.306853 (mean 0.200694); 0.5 → 0.193147, 1.2 → 0.017678 (mean 0.105413).
    inp = _loss_input([1, 1, 1, 1], [1, 1, 1, 1], weights=[1.5, 2, 0.5, 1.2], rows=2)
    rows = lambda *r: -torch.tensor(r, dtype=torch.float64)  # noqa: E731
    # the first sequence only: 0.2007 > 0.15
    guard = _ppo(inp, off_policy={**NO_BEHAVIOUR_CLIP, "cap": 2.0, "max_sequence_kl": 0.15, "veto": 0})
    torch.testing.assert_close(guard.per_token_loss, rows([0.0, 0.0], [0.5, 1.2]))
    assert guard.metrics["offpolicy/dropped_frac"].item() == pytest.approx(0.5)
    # 0.1054 > 0.1 too
    both = _ppo(inp, off_policy={**NO_BEHAVIOUR_CLIP, "cap": 2.0, "max_sequence_kl": 0.1, "veto": 0})
    torch.testing.assert_close(both.per_token_loss, rows([0.0, 0.0], [0.0, 0.0]))
    assert both.metrics["offpolicy/dropped_frac"].item() == pytest.approx(1.0)
    # the second sequence has w = 0.5 < 0.6
    veto = _ppo(inp, off_policy={**NO_BEHAVIOUR_CLIP, "cap": 2.0, "max_sequence_kl": 0, "veto": 0.6})
    torch.testing.assert_close(veto.per_token_loss, rows([1.5, 2.0], [0.0, 0.0]))
    assert veto.metrics["offpolicy/dropped_frac"].item() == pytest.approx(0.5)
    off = _ppo(inp, off_policy={**NO_BEHAVIOUR_CLIP, "cap": 2.0, "max_sequence_kl": 0, "veto": 0})
    torch.testing.assert_close(off.per_token_loss, rows([1.5, 2.0], [0.5, 1.2]))
    defaults = _ppo(inp, off_policy={**NO_BEHAVIOUR_CLIP, "cap": 2.0})  # 0.5 and 1e-4: neither sequence is near them
    torch.testing.assert_close(defaults.per_token_loss, off.per_token_loss)
    assert off.metrics["offpolicy/dropped_frac"].item() == 0.0
    # The mismatch KL reported is still every token's: (0.094535 + 0.306853 + 0.193147 + 0.017678)/4 = 0.153053.
    assert guard.metrics["offpolicy/mismatch_kl"].item() == pytest.approx(0.153053, abs=1e-6)


def test_mismatch_guard_judges_real_tokens_only() -> None:
    # Padding holds a wild log-weight that must not count; a sequence without tokens is neither dropped nor counted.
    inp = _loss_input([1, 1, 1, 1], [1, 1, 1, 1], weights=[1.5, 1e-6, 1.2, 1.0], rows=2)
    mask = torch.tensor([[True, False], [False, False]])
    padded = LossInput(inp.logprobs, inp.old_logprobs, inp.behaviour_logprobs, inp.advantages, mask)
    out = _ppo(padded, off_policy={**NO_BEHAVIOUR_CLIP, "max_sequence_kl": 0.2, "veto": 1e-3})
    torch.testing.assert_close(out.per_token_loss, -torch.tensor([[1.5, 0.0], [0.0, 0.0]], dtype=torch.float64))
    assert out.metrics["offpolicy/dropped_frac"].item() == 0.0


def test_kl_term_is_added_only_with_a_reference_and_a_coefficient() -> None:
    # r = 1, A = 0 → surrogate 0; π_ref = 2·π_θ → k3 = 0.306853; kl_coef 0.5 → 0.153426 per token.
    base = _loss_input([1.0, 1.0], [0.0, 0.0])
    ref = base.logprobs.detach() + math.log(2.0)
    inp = LossInput(base.logprobs, base.old_logprobs, base.behaviour_logprobs, base.advantages, base.response_mask, ref)
    torch.testing.assert_close(_ppo(inp, kl_coef=0.5).per_token_loss, _one_row([0.153426, 0.153426]), atol=1e-6, rtol=0)
    assert _ppo(inp, kl_coef=0.5).metrics["loss/kl_ref"].item() == pytest.approx(0.306853, abs=1e-6)
    assert not _ppo(inp).per_token_loss.any()  # kl_coef 0
    assert not _ppo(base, kl_coef=0.5).per_token_loss.any()  # no reference


def test_gradient_flows_only_through_the_current_logprobs() -> None:
    # token_mean over 3 tokens; π_θ = π_old except t2 (r = 1.5, A = 1: clipped, no gradient).
    # d(w·(−A·r))/d log π_θ = −A·w·r: t0: A 1, w 1.5 → −1.5; t1: A −1, w 1 → +1; divided by 3 tokens.
    inp = _loss_input([1.0, 1.0, 1.5], [1, -1, 1], weights=[1.5, 1.0, 1.0])
    leaves = [inp.old_logprobs, inp.behaviour_logprobs, inp.advantages]
    for leaf in leaves:
        leaf.requires_grad_()
    ref = torch.zeros_like(inp.old_logprobs, requires_grad=True)
    inp = LossInput(inp.logprobs, *leaves[:2], leaves[2], inp.response_mask, ref)
    out = _ppo(inp, off_policy=NO_BEHAVIOUR_CLIP)  # kl_coef 0: the reference contributes nothing
    build_aggregation("token_mean")(
        out.per_token_loss, inp.response_mask, GlobalCounts.of(inp.response_mask)
    ).backward()
    torch.testing.assert_close(inp.logprobs.grad, _one_row([-0.5, 1 / 3, 0.0]))
    assert all(leaf.grad is None for leaf in [*leaves, ref])
    assert all(not value.requires_grad for value in out.metrics.values())


# --------------------------------------------------------------------------- ppo_clip: loop reference


def _ppo_reference(inp: LossInput, s: PPOClipSettings) -> tuple[list[list[float]], float]:
    """Per-token loss and clip fraction, one token at a time."""
    mask, lp, old = inp.response_mask.tolist(), inp.logprobs.tolist(), inp.old_logprobs.tolist()
    mu, adv, ref = inp.behaviour_logprobs.tolist(), inp.advantages.tolist(), inp.ref_logprobs.tolist()
    loss = [[0.0] * len(row) for row in mask]
    clipped = 0
    for i, row in enumerate(mask):
        sequence_log_w = sum(old[i][t] - mu[i][t] for t, m in enumerate(row) if m)
        for t in (t for t, m in enumerate(row) if m):
            r, a = math.exp(lp[i][t] - old[i][t]), adv[i][t]
            bounded = -a * min(max(r, 1 - s.clip_low), 1 + s.clip_high)
            surrogate = max(-a * r, bounded)
            clipped += bounded > -a * r
            if s.dual_clip is not None and a < 0:
                surrogate = min(surrogate, -a * s.dual_clip)
            w = math.exp(sequence_log_w if s.off_policy.level == "sequence" else old[i][t] - mu[i][t])
            cap = s.off_policy.cap
            w = {"none": 1.0, "truncate": min(w, cap), "mask": w if 1 / cap <= w <= cap else 0.0}[
                s.off_policy.correction
            ]
            rho = math.exp(old[i][t] - mu[i][t])  # the behaviour clip: PPO's band around μ, in A's direction
            if s.off_policy.behaviour_clip and s.off_policy.correction != "none":
                w *= not ((a > 0 and rho > 1 + s.clip_high) or (a < 0 and rho < 1 - s.clip_low))
            log_r = ref[i][t] - lp[i][t]
            loss[i][t] = w * surrogate + s.kl_coef * (math.exp(log_r) - 1 - log_r)
    return loss, clipped / max(sum(map(sum, mask)), 1)


PPO_OPTIONS: list[dict[str, Any]] = [
    {},
    {"clip_high": 0.28, "dual_clip": 3.0},
    {"off_policy": {"correction": "mask", "level": "sequence", "cap": 1.5}},
    {"off_policy": {"correction": "none"}, "kl_coef": 0.1},
    {"off_policy": {"correction": "truncate", "level": "sequence"}, "kl_coef": 0.05, "dual_clip": 2.0},
    {"clip_high": 0.28, "off_policy": {"correction": "truncate", "behaviour_clip": False}},
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("options", PPO_OPTIONS)
def test_ppo_clip_matches_a_loop_reference(options: dict[str, Any], seed: int) -> None:
    inp = _loss_batch(seed)
    settings = loss_settings("ppo_clip", options)
    out = ppo_clip(inp, settings)
    expected, clip_frac = _ppo_reference(inp, settings)
    torch.testing.assert_close(out.per_token_loss, torch.tensor(expected, dtype=torch.float64))
    assert out.metrics["loss/clip_frac"].item() == pytest.approx(clip_frac)


@pytest.mark.parametrize("seed", range(3))
def test_correction_none_is_plain_ppo_clip_when_old_is_behaviour(seed: int) -> None:
    # With π_old = μ every weight is 1: all three corrections, at either level, give plain PPO-clip.
    batch = _loss_batch(seed)
    inp = LossInput(
        batch.logprobs, batch.behaviour_logprobs, batch.behaviour_logprobs, batch.advantages, batch.response_mask
    )
    plain = _ppo(inp, off_policy={"correction": "none"})
    r = (inp.logprobs - inp.old_logprobs).exp()
    formula = torch.maximum(-inp.advantages * r, -inp.advantages * r.clamp(0.8, 1.2)) * inp.response_mask
    torch.testing.assert_close(plain.per_token_loss, formula)
    for correction in ("truncate", "mask"):
        for level in ("token", "sequence"):
            other = _ppo(inp, off_policy={"correction": correction, "level": level})
            torch.testing.assert_close(other.per_token_loss, plain.per_token_loss)
    assert plain.metrics["offpolicy/mismatch_kl"].item() == 0.0


# --------------------------------------------------------------------------- ppo_clip: invariance


@pytest.mark.parametrize("options", PPO_OPTIONS)
def test_ppo_clip_ignores_what_padding_holds(options: dict[str, Any]) -> None:
    clean = _loss_batch(4)
    spoiled = _with_garbage_padding(clean, seed=4)
    counts = GlobalCounts.of(clean.response_mask)
    results = []
    for inp in (clean, spoiled):
        out = _ppo(inp, **options)
        build_aggregation("token_mean")(out.per_token_loss, inp.response_mask, counts).backward()
        results.append((out, inp.logprobs.grad))
    (out, grad), (out_spoiled, grad_spoiled) = results
    torch.testing.assert_close(out_spoiled.per_token_loss, out.per_token_loss)
    torch.testing.assert_close(grad_spoiled, grad)
    assert out.metrics.keys() == out_spoiled.metrics.keys()
    for name, value in out.metrics.items():
        torch.testing.assert_close(out_spoiled.metrics[name], value, msg=name)


# --------------------------------------------------------------------------- aggregations


def test_aggregations_by_hand() -> None:
    # loss [[1, 2, 3], [4, pad, pad]] (pad holds 9): 4 tokens, 2 sequences, token sums 6 and 4.
    # token_mean (1+2+3+4)/4 = 2.5; seq_mean_token_sum (6+4)/2 = 5;
    # seq_mean_token_mean (6/3 + 4/1)/2 = 3; seq_mean_token_sum_norm, norm 4: (6+4)/(2·4) = 1.25.
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[T_, T_, T_], [T_, F_, F_]])
    expected = {
        "token_mean": 2.5,
        "seq_mean_token_sum": 5.0,
        "seq_mean_token_mean": 3.0,
        "seq_mean_token_sum_norm": 1.25,
    }
    for name, value in expected.items():
        result = build_aggregation(name, AGGREGATION_OPTIONS[name])(loss, mask, GlobalCounts.of(mask))
        assert result.item() == pytest.approx(value), name


def _aggregate_reference(name: str, loss: Tensor, mask: Tensor, counts: GlobalCounts) -> float:
    rows = [[x for x, m in zip(lr, mr, strict=True) if m] for lr, mr in zip(loss.tolist(), mask.tolist(), strict=True)]
    total = sum(map(sum, rows))
    if name == "token_mean":
        return total / max(counts.tokens, 1)
    if name == "seq_mean_token_sum":
        return total / max(counts.sequences, 1)
    if name == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows if r) / max(counts.sequences, 1)
    return total / (max(counts.sequences, 1) * AGGREGATION_OPTIONS[name]["norm"])


def _random_loss(seed: int) -> tuple[Tensor, Tensor]:
    gen = _generator(seed)
    b, t = _randint(gen, 1, 9), _randint(gen, 1, 7)
    return torch.randn(b, t, generator=gen, dtype=torch.float64).requires_grad_(), torch.rand(b, t, generator=gen) < 0.6


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(AGGREGATION_OPTIONS))
def test_aggregations_match_a_loop_reference_and_ignore_padding(name: str, seed: int) -> None:
    loss, mask = _random_loss(seed)
    counts, aggregate = GlobalCounts.of(mask), build_aggregation(name, AGGREGATION_OPTIONS[name])
    result = aggregate(loss, mask, counts)
    assert result.item() == pytest.approx(_aggregate_reference(name, loss, mask, counts))
    spoiled = torch.where(mask, loss.detach(), math.nan)
    assert aggregate(spoiled, mask, counts).item() == pytest.approx(result.item())


def _splits(seed: int, rows: int) -> list[slice]:
    """Two 'ranks' (the rows cut in two), each cut into micro-batches of random sizes."""
    gen, cuts = _generator(seed + 100), []
    for start, stop in ((0, rows // 2), (rows // 2, rows)):
        at = start
        while at < stop:
            size = _randint(gen, 1, 3)
            cuts.append(slice(at, min(at + size, stop)))
            at += size
    return cuts


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(AGGREGATION_OPTIONS))
def test_aggregations_do_not_depend_on_micro_batching_or_ranks(name: str, seed: int) -> None:
    loss, mask = _random_loss(seed)
    aggregate = build_aggregation(name, AGGREGATION_OPTIONS[name])
    parts = _splits(seed, len(mask))
    counts = sum((GlobalCounts.of(mask[p]) for p in parts), GlobalCounts(0, 0))
    assert counts == GlobalCounts.of(mask)  # what the learner's all-reduce of per-micro-batch counts yields
    full = aggregate(loss, mask, counts)
    (full_grad,) = torch.autograd.grad(full, loss)
    summed = sum(aggregate(loss[p], mask[p], counts) for p in parts)
    (summed_grad,) = torch.autograd.grad(summed, loss)
    assert summed.item() == pytest.approx(full.item())
    torch.testing.assert_close(summed_grad, full_grad)


def test_ppo_clip_with_sequence_weights_does_not_depend_on_micro_batching() -> None:
    inp = _loss_batch(7)
    options = {"off_policy": {"level": "sequence", "correction": "mask"}}
    aggregate, counts = build_aggregation("seq_mean_token_mean"), GlobalCounts.of(inp.response_mask)
    full = aggregate(_ppo(inp, **options).per_token_loss, inp.response_mask, counts)
    summed = sum(
        aggregate(_ppo(_rows(inp, p), **options).per_token_loss, inp.response_mask[p], counts)
        for p in _splits(7, len(inp.response_mask))
    )
    assert summed.item() == pytest.approx(full.item())


def _rows(inp: LossInput, rows: slice) -> LossInput:
    fields = (inp.logprobs, inp.old_logprobs, inp.behaviour_logprobs, inp.advantages, inp.response_mask)
    return LossInput(*(x[rows] for x in fields), inp.ref_logprobs[rows] if inp.ref_logprobs is not None else None)


def test_global_counts() -> None:
    mask = torch.tensor([[T_, T_, F_], [F_, F_, F_], [T_, F_, F_]])
    assert GlobalCounts.of(mask) == GlobalCounts(tokens=3, sequences=2)  # the empty row is not a sequence
    assert GlobalCounts(3, 2) + GlobalCounts(1, 1) == GlobalCounts(4, 3)
    with pytest.raises(ValueError, match="inconsistent"):
        GlobalCounts(tokens=1, sequences=2)
    assert (
        build_aggregation("token_mean")(torch.zeros(0, 3), torch.zeros(0, 3).bool(), GlobalCounts(0, 0)).item() == 0.0
    )


# --------------------------------------------------------------------------- registries


def test_every_registered_function_has_a_settings_model_tagged_with_its_key() -> None:
    for registry in ALL_REGISTRIES:
        assert registry.names(), registry.kind
        for name in registry.names():
            assert settings_tag(settings_type(registry.get(name))) == name, (registry.kind, name)


def _all_subclasses(cls: type) -> list[type]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _all_subclasses(child))]


def test_every_settings_model_has_a_registered_function() -> None:
    tagged = [
        m
        for m in _all_subclasses(Settings)
        if m.__module__.startswith("asyncrl.learner.algorithms") and settings_tag(m)
    ]
    assert len(tagged) == sum(len(r.names()) for r in ALL_REGISTRIES)
    for model in tagged:
        owners = [r for r in ALL_REGISTRIES if settings_tag(model) in r]
        assert len(owners) == 1, model
        assert settings_type(owners[0].get(settings_tag(model))) is model


def test_a_duplicate_name_is_refused_and_the_registry_restored() -> None:
    def impostor(inp: LossInput, settings: PPOClipSettings) -> LossOutput:
        raise AssertionError("never called")

    with LOSSES.snapshot():
        with pytest.raises(ValueError, match="already registered"):
            register_loss("ppo_clip")(impostor)
        assert register_loss("ppo_clip")(ppo_clip) is ppo_clip  # the same function again is fine
    assert LOSSES.get("ppo_clip") is ppo_clip


def test_a_settings_tag_that_is_not_the_key_is_refused() -> None:
    def mislabelled(inp: AdvantageInput, settings: GRPOSettings) -> AdvantageOutput:
        raise AssertionError("never called")

    def unannotated(inp: AdvantageInput, settings):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")

    with ADVANTAGES.snapshot():
        with pytest.raises(ValueError, match="tag 'grpo'"):
            register_advantage("mine")(mislabelled)
        with pytest.raises(ValueError, match="settings"):
            register_advantage("mine")(unannotated)
        assert "mine" not in ADVANTAGES


@pytest.mark.parametrize(
    ("lookup", "name", "options", "named"),
    [
        (advantage_settings, "grpo", {"epsilonn": 1.0}, "'epsilonn'"),
        (loss_settings, "ppo_clip", {"clip": 0.1, "kl_coef": 0.1}, "'clip'"),
        (loss_settings, "ppo_clip", {"off_policy": {"capp": 3.0}}, "'off_policy.capp'"),
        (aggregation_settings, "token_mean", {"norm": 2.0}, "'norm'"),
        (kl_settings, "k3", {"clip": 1.0}, "'clip'"),
        (loss_settings, "tests.unit.learner.algorithms.test_algorithms:my_loss", {"scal": 2.0}, "'scal'"),
    ],
)
def test_unknown_options_are_refused_by_name(lookup: Any, name: str, options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown option.*{named}"):
        lookup(name, options)


@pytest.mark.parametrize(
    ("lookup", "name", "options", "message"),
    [
        (loss_settings, "ppo_clip", {"clip_low": 1.5}, "'clip_low'"),
        (loss_settings, "ppo_clip", {"kl_estimator": "k4"}, "unknown KL estimator 'k4'"),
        (loss_settings, "ppo_clip", {"off_policy": {"correction": "clip"}}, "'off_policy.correction'"),
        (aggregation_settings, "seq_mean_token_sum_norm", {}, "'norm': Field required"),
        (advantage_settings, "grpo", {"name": "rloo"}, "'name'"),
        (advantage_settings, "gae_typo", {}, "unknown advantage estimator 'gae_typo'"),
    ],
)
def test_bad_values_and_names_are_refused(lookup: Any, name: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lookup(name, options)


def test_a_user_loss_named_by_import_path_is_used() -> None:
    # −scale · A · log π_θ with scale 2, A [1, −1], log π_θ [ln 0.5, ln 2] = [−0.693147, 0.693147]:
    # [1.386294, 1.386294]; token_mean over 2 tokens: 1.386294.
    inp = _loss_input([0.5, 2.0], [1.0, -1.0])
    path = "tests.unit.learner.algorithms.test_algorithms:my_loss"
    out = build_loss(path, {"scale": 2.0})(inp)
    torch.testing.assert_close(out.per_token_loss, _one_row([1.386294, 1.386294]), atol=1e-6, rtol=0)
    assert path not in LOSSES  # used without being registered under a name


def test_a_user_loss_whose_settings_are_no_settings_model_is_refused_by_name() -> None:
    # Its settings once passed as "a pydantic model", and assembling the config then failed on .requires().
    with pytest.raises(ValueError, match=r"plain_model_loss must annotate its `settings` parameter .*types\.Settings"):
        loss_settings("tests.unit.learner.algorithms.test_algorithms:plain_model_loss", {})


def test_settings_and_types_validate_early() -> None:
    assert OffPolicySettings(correction="none").recompute_proximal is False
    assert OffPolicySettings().recompute_proximal is True
    assert loss_settings("ppo_clip").off_policy == OffPolicySettings()  # the [staleness] defaults
    with pytest.raises(ValueError, match="response_mask"):
        AdvantageInput(torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.ones(2, 3))
    with pytest.raises(ValueError, match="group_ids"):
        AdvantageInput(torch.zeros(2), torch.zeros(2, dtype=torch.int32), torch.ones(2, 3).bool())
    with pytest.raises(ValueError, match="old_logprobs"):
        LossInput(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3).bool())
    assert sorted(KL_ESTIMATORS.names()) == ["k1", "k2", "k3"] and "token_mean" in AGGREGATIONS


def test_every_requirement_a_variant_names_is_one_the_learner_knows() -> None:
    from asyncrl.learner.algorithms import REQUIREMENTS

    for registry in ALL_REGISTRIES:
        for name in registry.names():
            settings = settings_type(registry.get(name)).model_construct()  # defaults, required fields unset
            assert settings.requires() <= REQUIREMENTS.keys(), (registry.kind, name)


def test_a_user_variant_names_its_needs_as_strings_and_an_unknown_one_is_refused_by_name() -> None:
    from asyncrl.common.config import load_config
    from asyncrl.learner.algorithms import Need
    from asyncrl.learner.algorithms.assembly import assemble

    path = "tests.unit.learner.algorithms.test_algorithms:needy_loss"
    algorithm = assemble(load_config(None, [f"algorithm.loss={path}"]))
    assert algorithm.needs == {Need.ENTROPY} and all(isinstance(n, Need) for n in algorithm.needs)
    typo = load_config(None, [f"algorithm.loss={path}", 'algorithm.loss_options={wants=["entropy", "valeus"]}'])
    with pytest.raises(ConfigError, match=r"policy loss '.*needy_loss' requires valeus, which the learner does not"):
        assemble(typo)


def test_requirements_follow_the_settings() -> None:
    from asyncrl.learner.algorithms import advantage_settings, loss_settings

    assert advantage_settings("grpo").requires() == frozenset()
    assert advantage_settings("gae").requires() == {"values"}
    assert advantage_settings("gae", {"kl_coef": 0.1}).requires() == {"values", "token_kl"}
    assert advantage_settings("reinforce_pp", {"kl_coef": 0.1}).requires() == {"token_kl"}
    assert loss_settings("ppo_clip").requires() == frozenset()
    assert loss_settings("ppo_clip", {"kl_coef": 0.1, "entropy_coef": 0.01}).requires() == {"ref_logprobs", "entropy"}
    assert loss_settings("gspo", {"entropy_coef": 0.01}).requires() == {"entropy"}
    assert loss_settings("dpo").requires() == {"ref_logprobs", "pairs"}


def test_the_reference_lists_every_option_of_every_variant() -> None:
    """``rl-learner fields`` shows what each ``algorithm.*_options`` table takes, variant by variant; options a section
    sets for the whole run are not offered there."""
    from asyncrl.learner.algorithms.assembly import SECTION_OPTIONS
    from asyncrl.learner.algorithms.registries import OPTION_TABLES, variant_help

    rows = variant_help(frozenset(SECTION_OPTIONS))
    shown = {
        (field.split(".")[1].removesuffix("_options"), doc.split('"')[1], field.split(".")[2]) for field, _, doc in rows
    }
    for axis, registry in OPTION_TABLES:
        for name in registry.names():
            options = set(settings_type(registry.get(name)).model_fields) - {"name", *SECTION_OPTIONS}
            assert {(axis, name, option) for option in options} <= shown, (axis, name)
    assert not any(field.endswith((".name", ".off_policy")) for field, _, _ in rows)
    clip_high = {doc.split('"')[1]: d for field, d, doc in rows if field == "algorithm.loss_options.clip_high"}
    assert clip_high == {"gspo": "0.0004", "ppo_clip": "0.2"}
    assert ("algorithm.aggregation_options.norm", "(required)") in {(f, d) for f, d, _ in rows}
