"""Policy losses ``gspo`` and ``dpo``, the entropy bonus and :func:`token_entropy`.

Three ways (STYLE.md rule 12): hand-computed tiny tensors with the arithmetic in a comment; plain Python
loops against the vectorized code over seeded random shapes; invariance (garbage at masked positions
changes nothing; micro-batching with global counts does not change the aggregated loss or its gradient).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl.common.config import ConfigError
from asyncrl.learner.algorithms import (
    GlobalCounts,
    LossInput,
    LossOutput,
    build_aggregation,
    build_loss,
    loss_settings,
    token_entropy,
)
from asyncrl.learner.algorithms.losses import DPOSettings, GSPOSettings, gspo

T_ = True
F_ = False
FIELDS = ("logprobs", "old_logprobs", "behaviour_logprobs", "advantages", "response_mask", "ref_logprobs", "entropy")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, (), generator=gen))


def _double(values: list[list[float]]) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _ratio_input(
    ratios: list[list[float]], advantages: list[float], entropy: list[list[float]] | None = None
) -> LossInput:
    """One row per sequence, all tokens real: π_θ/π_old = ratios, π_old = μ, one advantage per sequence."""
    ratio = _double(ratios)
    old = torch.zeros_like(ratio)
    adv = torch.tensor(advantages, dtype=torch.float64)[:, None].expand_as(ratio).clone()
    return LossInput(
        ratio.log().requires_grad_(),
        old,
        old,
        adv,
        torch.ones(ratio.shape, dtype=torch.bool),
        entropy=_double(entropy).requires_grad_() if entropy is not None else None,
    )


def _random_batch(seed: int, pairs: bool = False) -> LossInput:
    """Rows of [prompt | response | padding], responses starting at random indices (none empty when
    ``pairs``: a preference pair has two responses); per-sequence advantages; entropy and a reference."""
    gen = _generator(seed)
    b = 2 * _randint(gen, 1, 4) if pairs else _randint(gen, 1, 6)
    t = _randint(gen, 2, 9)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for row in range(b):
        start = _randint(gen, 0, t - 2)
        mask[row, start : _randint(gen, start + 1 if pairs else start, t)] = True

    def noise() -> Tensor:
        return 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)

    behaviour = -3 * torch.rand(b, t, generator=gen, dtype=torch.float64)
    old = behaviour + 0.1 * noise()
    logprobs = old + 0.01 * noise() if seed % 2 else old + noise()  # GSPO's tiny clip range: some in, some out
    advantages = torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, t).clone()
    entropy = torch.rand(b, t, generator=gen, dtype=torch.float64)
    return LossInput(
        logprobs.requires_grad_(),
        old,
        behaviour,
        advantages,
        mask,
        logprobs.detach() + noise(),
        entropy.requires_grad_(),
    )


def _spoil(inp: LossInput, seed: int) -> LossInput:
    """The same batch with NaN, ±inf and huge values at every masked position (fresh leaves)."""
    gen = _generator(seed)
    junk = torch.tensor([math.nan, math.inf, -math.inf, 1e30, -1e30], dtype=torch.float64)

    def spoil(x: Tensor | None, grad: bool = False) -> Tensor | None:
        if x is None:
            return None
        pick = junk[torch.randint(0, len(junk), x.shape, generator=gen)]
        return torch.where(inp.response_mask, x.detach(), pick).requires_grad_(grad)

    return LossInput(
        spoil(inp.logprobs, grad=True),
        spoil(inp.old_logprobs),
        spoil(inp.behaviour_logprobs),
        spoil(inp.advantages),
        inp.response_mask,
        spoil(inp.ref_logprobs),
        spoil(inp.entropy, grad=inp.entropy is not None and inp.entropy.requires_grad),
    )


def _take(inp: LossInput, rows: slice) -> LossInput:
    return LossInput(*(None if getattr(inp, f) is None else getattr(inp, f)[rows] for f in FIELDS))


def _aggregate(name: str, out: LossOutput, inp: LossInput, counts: GlobalCounts | None = None) -> Tensor:
    mask = inp.response_mask
    return build_aggregation(name)(out.per_token_loss, mask, counts or GlobalCounts.of(mask))


# --------------------------------------------------------------------------- gspo: by hand


def test_gspo_by_hand_clips_the_sequence_ratio() -> None:
    # ε_low = ε_high = 0.2, π_old = μ (w = 1). s_i = exp(mean_t log r_t) = (Π r_t)^(1/|y|):
    # seq 0: r [2, 0.5], A +1: s = √1 = 1     → max(−1, −1) = −1            (not clipped)
    # seq 1: r [4, 1],   A +1: s = √4 = 2     → max(−2, −1.2) = −1.2        (clipped)
    # seq 2: r [0.25, 1], A −1: s = √0.25 = 0.5 → max(0.5, 0.8) = 0.8        (clipped)
    # seq 3: r [1.21, 1], A −1: s = 1.1        → max(1.1, 1.1) = 1.1        (tie: not clipped)
    # Every token of a sequence gets its sequence's value. clip_frac 2/4; ratio mean (1+2+0.5+1.1)/4 = 1.15.
    inp = _ratio_input([[2, 0.5], [4, 1], [0.25, 1], [1.21, 1]], [1, 1, -1, -1])
    out = build_loss("gspo", {"clip_low": 0.2, "clip_high": 0.2})(inp)
    torch.testing.assert_close(out.per_token_loss, _double([[-1, -1], [-1.2, -1.2], [0.8, 0.8], [1.1, 1.1]]))
    assert out.metrics["loss/clip_frac"].item() == pytest.approx(0.5)
    assert out.metrics["loss/ratio_mean"].item() == pytest.approx(1.15)
    # Gradient under seq_mean_token_mean (4 sequences of 2 tokens): an unclipped token gets −A·s/(4·2):
    # seq 0: −1·1/8 = −0.125 per token; seq 3: +1.1/8 = 0.1375; clipped sequences 1 and 2: 0.
    _aggregate("seq_mean_token_mean", out, inp).backward()
    torch.testing.assert_close(inp.logprobs.grad, _double([[-0.125, -0.125], [0, 0], [0, 0], [0.1375, 0.1375]]))


def test_gspo_default_clip_range_is_the_papers() -> None:
    # ε_low 3e-4, ε_high 4e-4 (Zheng et al. 2025, §5.1). s = e^0.001 ≈ 1.0010005 with A = 1 → clipped at 1.0004;
    # s = e^−0.001 ≈ 0.9990005 with A = −1 → clipped at 0.9997: loss 0.9997.
    settings = loss_settings("gspo")
    assert isinstance(settings, GSPOSettings) and (settings.clip_low, settings.clip_high) == (3e-4, 4e-4)
    inp = _ratio_input([[math.exp(0.002), 1.0], [math.exp(-0.002), 1.0]], [1, -1])
    out = build_loss("gspo")(inp)
    torch.testing.assert_close(out.per_token_loss, _double([[-1.0004] * 2, [0.9997] * 2]))
    assert out.metrics["loss/clip_frac"].item() == 1.0


def test_entropy_bonus_by_hand_in_ppo_clip_and_gspo() -> None:
    # r = 1, A = 0 → surrogate 0. Entropy [0.5, 1.0], entropy_coef 0.1 → loss [−0.05, −0.1];
    # loss/entropy = (0.5 + 1.0)/2 = 0.75. token_mean over 2 tokens: d/dH = −0.1/2 = −0.05 per token.
    for name in ("ppo_clip", "gspo"):
        inp = _ratio_input([[1.0, 1.0]], [0.0], entropy=[[0.5, 1.0]])
        out = build_loss(name, {"entropy_coef": 0.1})(inp)
        torch.testing.assert_close(out.per_token_loss, _double([[-0.05, -0.1]]))
        assert out.metrics["loss/entropy"].item() == pytest.approx(0.75)
        _aggregate("token_mean", out, inp).backward()
        torch.testing.assert_close(inp.entropy.grad, _double([[-0.05, -0.05]]))
        # coefficient 0: no bonus, the metric is still reported; no entropy given: no metric.
        assert not build_loss(name)(inp).per_token_loss.any()
        assert build_loss(name)(inp).metrics["loss/entropy"].item() == pytest.approx(0.75)
        assert "loss/entropy" not in build_loss(name, {"entropy_coef": 0.1})(_ratio_input([[1.0]], [0.0])).metrics


# --------------------------------------------------------------------------- gspo: loop reference


def _weight(old: list[float], mu: list[float], t: int, tokens: list[int], s: Any) -> float:
    log_w = sum(old[u] - mu[u] for u in tokens) if s.off_policy.level == "sequence" else old[t] - mu[t]
    w, cap = math.exp(log_w), s.off_policy.cap
    return {"none": 1.0, "truncate": min(w, cap), "mask": w if 1 / cap <= w <= cap else 0.0}[s.off_policy.correction]


def _gspo_reference(inp: LossInput, s: GSPOSettings) -> tuple[list[list[float]], float]:
    """Per-token loss and the sequence-level clip fraction, one sequence and token at a time."""
    lp, old, mu = inp.logprobs.tolist(), inp.old_logprobs.tolist(), inp.behaviour_logprobs.tolist()
    adv, ref, ent = inp.advantages.tolist(), inp.ref_logprobs.tolist(), inp.entropy.tolist()
    loss = [[0.0] * len(row) for row in lp]
    clip_fracs = []
    for i, row in enumerate(inp.response_mask.tolist()):
        tokens = [t for t, m in enumerate(row) if m]
        if not tokens:
            continue
        ratio = math.exp(sum(lp[i][t] - old[i][t] for t in tokens) / len(tokens))
        clipped = 0
        for t in tokens:
            a = adv[i][t]
            bounded = -a * min(max(ratio, 1 - s.clip_low), 1 + s.clip_high)
            clipped += bounded > -a * ratio
            log_r = ref[i][t] - lp[i][t]
            kl = math.exp(log_r) - 1 - log_r
            w = _weight(old[i], mu[i], t, tokens, s)
            loss[i][t] = w * max(-a * ratio, bounded) + s.kl_coef * kl - s.entropy_coef * ent[i][t]
        clip_fracs.append(clipped / len(tokens))
    return loss, sum(clip_fracs) / max(len(clip_fracs), 1)


GSPO_OPTIONS: list[dict[str, Any]] = [
    {},
    {"clip_low": 0.2, "clip_high": 0.28, "entropy_coef": 0.01},
    {"off_policy": {"correction": "mask", "level": "sequence", "cap": 1.5}, "kl_coef": 0.1},
    {"off_policy": {"correction": "truncate", "level": "token"}, "kl_coef": 0.05, "entropy_coef": 0.02},
    {"off_policy": {"correction": "none"}},
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("options", GSPO_OPTIONS)
def test_gspo_matches_a_loop_reference(options: dict[str, Any], seed: int) -> None:
    inp = _random_batch(seed)
    settings = loss_settings("gspo", options)
    out = gspo(inp, settings)
    expected, clip_frac = _gspo_reference(inp, settings)
    torch.testing.assert_close(out.per_token_loss, torch.tensor(expected, dtype=torch.float64))
    assert out.metrics["loss/clip_frac"].item() == pytest.approx(clip_frac)


@pytest.mark.parametrize("seed", range(6))
def test_gspo_token_form_is_the_sequence_objective(seed: int) -> None:
    # With one advantage per sequence and seq_mean_token_mean, GSPO-token's value and gradient are those
    # of GSPO's sequence objective (1/G) Σ_i max(−A_i s_i, −A_i clip(s_i)) (Zheng et al. 2025, eq. 13 vs 7).
    batch = _random_batch(seed)
    inp = LossInput(batch.logprobs, batch.old_logprobs, batch.old_logprobs, batch.advantages, batch.response_mask)
    options = {"clip_low": 0.1, "clip_high": 0.1}
    token_form = _aggregate("seq_mean_token_mean", build_loss("gspo", options)(inp), inp)
    (grad,) = torch.autograd.grad(token_form, inp.logprobs)

    mask = inp.response_mask
    has = mask.any(dim=-1)
    log_ratio = torch.where(mask, inp.logprobs - inp.old_logprobs, 0.0)
    s = (log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).exp()
    a = inp.advantages[:, 0]
    per_sequence = torch.maximum(-a * s, -a * s.clamp(0.9, 1.1))
    sequence_form = torch.where(has, per_sequence, 0.0).sum() / has.sum()
    (expected_grad,) = torch.autograd.grad(sequence_form, inp.logprobs)
    torch.testing.assert_close(token_form, sequence_form)
    torch.testing.assert_close(grad, expected_grad)


# --------------------------------------------------------------------------- gspo: invariance


@pytest.mark.parametrize("options", GSPO_OPTIONS)
def test_gspo_ignores_what_padding_holds(options: dict[str, Any]) -> None:
    clean = _random_batch(4)
    results = []
    for inp in (clean, _spoil(clean, seed=4)):
        out = build_loss("gspo", options)(inp)
        _aggregate("seq_mean_token_mean", out, inp).backward()
        results.append((out, inp.logprobs.grad, inp.entropy.grad))
    (out, grad, entropy_grad), (spoiled, spoiled_grad, spoiled_entropy_grad) = results
    torch.testing.assert_close(spoiled.per_token_loss, out.per_token_loss)
    torch.testing.assert_close(spoiled_grad, grad)
    torch.testing.assert_close(spoiled_entropy_grad, entropy_grad)
    assert out.metrics.keys() == spoiled.metrics.keys()
    for name, value in out.metrics.items():
        torch.testing.assert_close(spoiled.metrics[name], value, msg=name)
    assert all(not value.requires_grad for value in out.metrics.values())


def _micro_batches(seed: int, rows: int, step: int = 1) -> list[slice]:
    """Consecutive micro-batches of random sizes (multiples of ``step``: 2 keeps DPO pairs together)."""
    gen, cuts, at = _generator(seed + 100), [], 0
    while at < rows:
        size = step * _randint(gen, 1, 2)
        cuts.append(slice(at, min(at + size, rows)))
        at += size
    return cuts


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"])
def test_gspo_does_not_depend_on_micro_batching(aggregation: str, seed: int) -> None:
    inp = _random_batch(seed)
    options = {"off_policy": {"level": "sequence", "correction": "mask"}, "entropy_coef": 0.01, "kl_coef": 0.1}
    counts = GlobalCounts.of(inp.response_mask)
    full = _aggregate(aggregation, build_loss("gspo", options)(inp), inp, counts)
    (full_grad,) = torch.autograd.grad(full, inp.logprobs)
    parts = _micro_batches(seed, len(inp.response_mask))
    summed = sum(
        _aggregate(aggregation, build_loss("gspo", options)(_take(inp, p)), _take(inp, p), counts) for p in parts
    )
    (summed_grad,) = torch.autograd.grad(summed, inp.logprobs)
    assert summed.item() == pytest.approx(full.item())
    torch.testing.assert_close(summed_grad, full_grad)


# --------------------------------------------------------------------------- dpo: by hand


def _pair() -> LossInput:
    """One pair; padding (masked) holds NaN. chosen: log π_θ [−1, −2], log π_ref [−1.5, −2.5];
    rejected: log π_θ [−2, −1, −1], log π_ref [−1, −1, −1]."""
    nan = math.nan
    logprobs = _double([[-1, -2, nan], [-2, -1, -1]]).requires_grad_()
    ref = _double([[-1.5, -2.5, nan], [-1, -1, -1]])
    mask = torch.tensor([[T_, T_, F_], [T_, T_, T_]])
    unused = torch.full_like(ref, nan)  # π_old, μ and advantages are never read by dpo
    return LossInput(logprobs, unused, unused, unused, mask, ref)


def test_dpo_sigmoid_by_hand() -> None:
    # Sums: chosen π_θ −3, π_ref −4 → log ratio +1; rejected π_θ −4, π_ref −3 → −1. β = 0.1:
    # r_c = 0.1, r_r = −0.1, h = 0.2; l = −log σ(0.2) = log(1 + e^−0.2) = 0.598139.
    # Spread: chosen row [l/2, l/2], rejected row [l/3, l/3, l/3]; each row's sum is l.
    inp = _pair()
    out = build_loss("dpo")(inp)
    pair_loss = 0.598139
    torch.testing.assert_close(
        out.per_token_loss, _double([[pair_loss / 2, pair_loss / 2, 0], [pair_loss / 3] * 3]), atol=1e-6, rtol=0
    )
    expected = {"dpo/chosen_reward": 0.1, "dpo/rejected_reward": -0.1, "dpo/reward_margin": 0.2, "dpo/accuracy": 1.0}
    for name, value in {**expected, "dpo/loss": pair_loss}.items():
        assert out.metrics[name].item() == pytest.approx(value, abs=1e-6), name
    # seq_mean_token_sum over 2 sequences: (l + l)/2 = l. d l/d log π_θ = ∓β σ(−h) = ∓0.1 · 0.450166 = ∓0.0450166
    # (− for chosen tokens, + for rejected), 0 on padding.
    loss = _aggregate("seq_mean_token_sum", out, inp)
    assert loss.item() == pytest.approx(pair_loss, abs=1e-6)
    loss.backward()
    g = 0.0450166
    torch.testing.assert_close(inp.logprobs.grad, _double([[-g, -g, 0], [g, g, g]]), atol=1e-7, rtol=0)
    # Label smoothing ε = 0.1: 0.9 · log(1 + e^−0.2) + 0.1 · log(1 + e^0.2) = 0.538325 + 0.079814 = 0.618139.
    smoothed = build_loss("dpo", {"label_smoothing": 0.1})(_pair())
    assert smoothed.metrics["dpo/loss"].item() == pytest.approx(0.618139, abs=1e-6)


def test_dpo_ipo_by_hand() -> None:
    # IPO uses token-mean log-probs (TRL): chosen −1.5 vs −2 → 0.5; rejected −4/3 vs −1 → −1/3.
    # h/β = 0.5 + 1/3 = 0.833333; l = (0.833333 − 1/(2·0.1))² = (0.833333 − 5)² = 17.361111.
    out = build_loss("dpo", {"kind": "ipo"})(_pair())
    assert out.metrics["dpo/loss"].item() == pytest.approx(17.361111, abs=1e-5)
    assert out.metrics["dpo/reward_margin"].item() == pytest.approx(0.0833333, abs=1e-6)
    pair_loss = 17.361111
    torch.testing.assert_close(
        out.per_token_loss, _double([[pair_loss / 2, pair_loss / 2, 0], [pair_loss / 3] * 3]), atol=1e-5, rtol=0
    )


def test_dpo_refuses_what_it_cannot_read() -> None:
    inp = _pair()
    with pytest.raises(ValueError, match="ref_logprobs"):
        build_loss("dpo")(LossInput(*(getattr(inp, f) for f in FIELDS[:5])))
    with pytest.raises(ValueError, match="odd 1 rows"):
        build_loss("dpo")(_take(inp, slice(0, 1)))
    with pytest.raises(ConfigError, match="label_smoothing applies to kind 'sigmoid'"):
        loss_settings("dpo", {"kind": "ipo", "label_smoothing": 0.1})
    with pytest.raises(ConfigError, match="'off_policy'"):
        loss_settings("dpo", {"off_policy": {"correction": "none"}})  # the learner injects it only where declared
    assert "off_policy" not in DPOSettings.model_fields and "off_policy" in GSPOSettings.model_fields


# --------------------------------------------------------------------------- dpo: loop reference and invariance


def _dpo_reference(inp: LossInput, beta: float, kind: str, eps: float) -> tuple[list[float], list[list[float]]]:
    """Per-pair losses and per-token losses, from plain sums over each row's response tokens."""
    mask, lp, ref = inp.response_mask.tolist(), inp.logprobs.tolist(), inp.ref_logprobs.tolist()
    ratios, lengths = [], []
    for i, row in enumerate(mask):
        tokens = [t for t, m in enumerate(row) if m]
        ratio = sum(lp[i][t] - ref[i][t] for t in tokens)
        ratios.append(ratio / len(tokens) if kind == "ipo" else ratio)
        lengths.append(len(tokens))
    pairs, per_token = [], [[0.0] * len(row) for row in mask]
    for p in range(len(mask) // 2):
        h = beta * (ratios[2 * p] - ratios[2 * p + 1])
        if kind == "ipo":
            loss = (h / beta - 1 / (2 * beta)) ** 2
        else:
            loss = -(1 - eps) * math.log(1 / (1 + math.exp(-h))) - eps * math.log(1 / (1 + math.exp(h)))
        pairs.append(loss)
        for i in (2 * p, 2 * p + 1):
            per_token[i] = [loss / lengths[i] if m else 0.0 for m in mask[i]]
    return pairs, per_token


DPO_OPTIONS: list[dict[str, Any]] = [{}, {"beta": 0.5, "label_smoothing": 0.2}, {"kind": "ipo", "beta": 0.3}]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("options", DPO_OPTIONS)
def test_dpo_matches_a_loop_reference_and_its_closed_form(options: dict[str, Any], seed: int) -> None:
    inp = _random_batch(seed, pairs=True)
    s = loss_settings("dpo", options)
    out = build_loss("dpo", options)(inp)
    pairs, per_token = _dpo_reference(inp, s.beta, s.kind, s.label_smoothing)
    torch.testing.assert_close(out.per_token_loss, torch.tensor(per_token, dtype=torch.float64))
    loss = _aggregate("seq_mean_token_sum", out, inp)  # 2P sequences: exactly the mean over pairs
    assert loss.item() == pytest.approx(sum(pairs) / len(pairs))
    if s.kind == "sigmoid" and s.label_smoothing == 0:
        # Closed form: d mean(l)/d log π_θ = −β σ(−h)/P at chosen tokens and +β σ(−h)/P at rejected ones.
        loss.backward()
        mask = inp.response_mask
        sums = torch.where(mask, inp.logprobs.detach() - inp.ref_logprobs, 0.0).sum(dim=-1)
        h = s.beta * (sums[0::2] - sums[1::2])
        torch.testing.assert_close(loss.detach(), -F.logsigmoid(h).mean())
        sign = torch.tensor([-1.0, 1.0], dtype=torch.float64).repeat(len(h))
        expected = (sign * s.beta * torch.sigmoid(-h).repeat_interleave(2) / len(h))[:, None] * mask
        torch.testing.assert_close(inp.logprobs.grad, expected)


@pytest.mark.parametrize("options", DPO_OPTIONS)
def test_dpo_ignores_what_padding_holds(options: dict[str, Any]) -> None:
    clean = _random_batch(3, pairs=True)
    results = []
    for inp in (clean, _spoil(clean, seed=3)):
        out = build_loss("dpo", options)(inp)
        _aggregate("seq_mean_token_sum", out, inp).backward()
        results.append((out, inp.logprobs.grad))
    (out, grad), (spoiled, spoiled_grad) = results
    torch.testing.assert_close(spoiled.per_token_loss, out.per_token_loss)
    torch.testing.assert_close(spoiled_grad, grad)
    for name, value in out.metrics.items():
        torch.testing.assert_close(spoiled.metrics[name], value, msg=name)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("options", DPO_OPTIONS)
def test_dpo_does_not_depend_on_micro_batching_that_keeps_pairs(options: dict[str, Any], seed: int) -> None:
    inp = _random_batch(seed, pairs=True)
    counts = GlobalCounts.of(inp.response_mask)
    full = _aggregate("seq_mean_token_sum", build_loss("dpo", options)(inp), inp, counts)
    (full_grad,) = torch.autograd.grad(full, inp.logprobs)
    parts = _micro_batches(seed, len(inp.response_mask), step=2)
    summed = sum(
        _aggregate("seq_mean_token_sum", build_loss("dpo", options)(_take(inp, p)), _take(inp, p), counts)
        for p in parts
    )
    (summed_grad,) = torch.autograd.grad(summed, inp.logprobs)
    assert summed.item() == pytest.approx(full.item())
    torch.testing.assert_close(summed_grad, full_grad)


# --------------------------------------------------------------------------- token entropy


def test_entropy_of_uniform_logits_is_log_vocabulary() -> None:
    # p = 1/V everywhere: H = −V · (1/V) log(1/V) = log V, whatever the (shared) logit value.
    for vocabulary in (1, 2, 7, 50_000):
        logits = torch.full((2, 3, vocabulary), 3.5)
        torch.testing.assert_close(token_entropy(logits), torch.full((2, 3), math.log(vocabulary)))


def test_entropy_by_hand_with_ruled_out_tokens() -> None:
    # logits [0, ln 3, −inf]: p = [1/4, 3/4, 0]; H = −(1/4 ln 1/4 + 3/4 ln 3/4) = 0.346574 + 0.215762 = 0.562335.
    # A one-hot distribution ([0, −inf, −inf]) has H = 0. No NaN in the value or the gradient.
    logits = torch.tensor([[[0.0, math.log(3.0), -math.inf], [0.0, -math.inf, -math.inf]]], requires_grad=True)
    entropy = token_entropy(logits)
    torch.testing.assert_close(entropy, torch.tensor([[0.562335, 0.0]]), atol=1e-6, rtol=0)
    entropy.sum().backward()
    assert bool(logits.grad.isfinite().all())
    # dH/dz_j = −p_j (log p_j + H): p = 1/4 → −(1/4)(−1.386294 + 0.562335) = 0.205990; p = 3/4 → −0.205990.
    torch.testing.assert_close(logits.grad[0, 0], torch.tensor([0.205990, -0.205990, 0.0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_entropy_matches_a_loop_reference_and_is_float32(seed: int) -> None:
    logits = 4 * torch.randn(2, 3, 11, generator=_generator(seed))
    expected = []
    for row in logits.double().tolist():
        for z in row:
            top = max(z)
            total = sum(math.exp(v - top) for v in z)
            expected.append(-sum(math.exp(v - top) / total * (v - top - math.log(total)) for v in z))
    torch.testing.assert_close(token_entropy(logits).flatten(), torch.tensor(expected, dtype=torch.float32))
    low = token_entropy(logits.bfloat16())
    assert low.dtype == torch.float32 and low.shape == (2, 3)


def test_entropy_without_a_graph_in_chunks_equals_the_whole(monkeypatch) -> None:
    """The figure every step reports: the same values as :func:`token_entropy`, a few positions at a time (the chunk
    set to 2 vocabulary rows here: 3 chunks for 6 positions), with no graph."""
    from asyncrl.learner.algorithms import entropy

    logits = (4 * torch.randn(2, 3, 11, generator=_generator(5))).requires_grad_()
    monkeypatch.setattr(entropy, "ENTROPY_CHUNK_ELEMENTS", 22)
    chunked = entropy.token_entropy_no_grad(logits)
    torch.testing.assert_close(chunked, token_entropy(logits).detach())
    assert not chunked.requires_grad and chunked.shape == (2, 3) and chunked.dtype == torch.float32


def test_loss_input_validates_the_entropy_shape() -> None:
    zeros, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="entropy"):
        LossInput(zeros, zeros, zeros, zeros, mask, entropy=torch.zeros(2, 2))
