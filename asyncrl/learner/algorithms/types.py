"""Typed inputs and outputs of the algorithm registries, the settings base, and global batch counts.

Shapes, stated once for the whole package:

- ``B``: sequences (responses) in the tensors handed over — the whole training batch for advantage
  estimators, one micro-batch for losses and aggregations;
- ``T``: response positions, right-padded; ``response_mask [B, T]`` (bool) is True at real response
  tokens and False at padding. Values at masked positions are never read into a result: every function
  in this package replaces them before use, so padding may hold anything, NaN included.

Log-probabilities are of the sampled token at each position, float32 (the learner upcasts bf16).
Every registered function takes one of these inputs plus its own :class:`Settings` and returns one of
these outputs, so the learner loop never inspects which algorithm it runs (STYLE.md rule 5).
Fields are appended, never reordered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor


class Settings(BaseModel):
    """Base of every variant's settings: frozen, unknown options refused, field docstrings are the help.

    A registered variant's settings declare ``name: Literal["<key>"] = "<key>"``: the tag equals its
    registry key (STYLE.md rule 6), which the registering decorator checks.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    def requires(self) -> frozenset[Need]:
        """The optional inputs this variant needs the learner to compute (:class:`Need`).

        The learner builds a critic, a reference model, entropies or preference pairs exactly when the configured
        variants list them — this is how it learns what an algorithm needs without looking at its name.
        """
        return frozenset()


class Need(StrEnum):
    """An optional input a variant needs the learner to compute (:meth:`Settings.requires`). Members equal their
    names as strings, so a variant of a user's own may name them either way."""

    VALUES = "values"
    TOKEN_KL = "token_kl"
    REF_LOGPROBS = "ref_logprobs"
    ENTROPY = "entropy"
    PAIRS = "pairs"


REQUIREMENTS = {
    Need.VALUES: "critic values (AdvantageInput.values): the learner trains a value model beside the policy",
    Need.TOKEN_KL: "per-token KL to the reference in the reward (AdvantageInput.token_kl)",
    Need.REF_LOGPROBS: "log-probs of the frozen reference model (LossInput.ref_logprobs)",
    Need.ENTROPY: "per-token entropy of the policy (LossInput.entropy)",
    Need.PAIRS: "rows in chosen/rejected pairs: row 2i preferred to row 2i + 1",
}
"""What each :class:`Need` means for the learner."""
PER_SEQUENCE = frozenset({Need.VALUES, Need.TOKEN_KL, Need.PAIRS})
"""The requirements that treat a whole response as one sequence the model ran on (a critic's values along it, a KL
penalty summed into its reward, a preference pair of two): refused for multi-turn episodes kept per turn
(``learner/update/batch.py: ServedRows``)."""


def per_turn_refusal(needs: frozenset[Need]) -> str | None:
    """Why an algorithm that needs ``needs`` cannot train episodes kept per turn, in one line; None when it can."""
    if not (refused := needs & PER_SEQUENCE):
        return None
    return (
        "environment.past_reasoning = 'as_served': the chat template of model.path drops past reasoning, so each "
        "episode is trained as one row per context it was served, and this algorithm needs "
        f"{', '.join(sorted(refused))} over whole sequences; choose a group estimator without a KL penalty in the "
        "reward (grpo, dapo, gspo), or set environment.past_reasoning = 'keep'"
    )


@dataclass(frozen=True, slots=True)
class AdvantageInput:
    """What an advantage estimator sees: the whole training batch of complete groups.

    rewards [B] float32 (one scalar per sequence); group_ids [B] int64 (sequences sharing an id were
    sampled from the same prompt; ids need not be contiguous or sorted); response_mask [B, T] bool;
    token_kl [B, T] or None (per-token KL to the reference, for estimators that put KL in the reward);
    values [B, T] or None (critic values, for GAE: ``values[b, t]`` is V of the state before token t, so
    it is aligned with the log-probs, and V after a response's last token is 0);
    kl_coef: the coefficient of ``token_kl`` in the token rewards for this step, e.g. the current value of
    a :class:`~asyncrl.learner.algorithms.kl.KLController`; None = the estimator's own ``settings.kl_coef``;
    turn_rewards [B, T] or None: per-turn shares of ``rewards`` at the last token of each model turn of a multi-turn
    response (``common.wire.messages.ScoredGroup.turn_rewards``), 0 elsewhere; estimators that work per token use them.
    """

    rewards: Tensor
    group_ids: Tensor
    response_mask: Tensor
    token_kl: Tensor | None = None
    values: Tensor | None = None
    kl_coef: float | None = None
    turn_rewards: Tensor | None = None

    def __post_init__(self) -> None:
        mask = _expect_mask(self.response_mask)
        _expect("rewards", self.rewards, mask.shape[:1])
        _expect("group_ids", self.group_ids, mask.shape[:1], torch.int64)
        _expect("token_kl", self.token_kl, mask.shape)
        _expect("values", self.values, mask.shape)
        _expect("turn_rewards", self.turn_rewards, mask.shape)
        if self.kl_coef is not None and not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


@dataclass(frozen=True, slots=True)
class AdvantageOutput:
    """advantages [B, T] float32, zero at masked positions; returns [B, T] (critic targets) or None."""

    advantages: Tensor
    returns: Tensor | None = None


@dataclass(frozen=True, slots=True)
class LossInput:
    """What a policy loss sees for one micro-batch; every tensor is [B, T].

    logprobs: log π_θ, the current policy, carrying the graph (the only input that gets a gradient);
    old_logprobs: log π_old, the proximal policy: the weights at the start of the step (the training forward's
    own log-probs detached, since a batch makes one optimizer step; see ``learner/update/policy.py``), or μ itself when
    the off-policy correction is ``none``; behaviour_logprobs: log μ, shipped by vLLM with each token;
    advantages: from the estimator; response_mask: bool; ref_logprobs: log π_ref of the frozen
    reference model, or None when no KL term is used; entropy: the per-token entropy of π_θ carrying the
    graph (:func:`~asyncrl.learner.algorithms.entropy.token_entropy`), or None when no entropy bonus is used.

    Preference losses (``dpo``) read the rows in pairs: row 2i is the chosen response and row 2i + 1 the
    rejected one for the same prompt, so B is even and a micro-batch split never separates a pair
    (split at even row indices).
    """

    logprobs: Tensor
    old_logprobs: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    response_mask: Tensor
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None

    def __post_init__(self) -> None:
        mask = _expect_mask(self.response_mask)
        for name in ("logprobs", "old_logprobs", "behaviour_logprobs", "advantages", "ref_logprobs", "entropy"):
            _expect(name, getattr(self, name), mask.shape)


@dataclass(frozen=True, slots=True)
class LossOutput:
    """per_token_loss [B, T], zero at masked positions; metrics: detached scalars over the masked tokens
    of this micro-batch, named ``component/metric``; those named in ``sequence_metrics`` are means over its sequences
    instead (a step weighs them by sequences, the others by tokens: ``learner/update/step_metrics.py``)."""

    per_token_loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    sequence_metrics: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class GlobalCounts:
    """Response tokens and sequences in the WHOLE global batch: every micro-batch on every learner rank.

    Aggregations divide by these instead of by a micro-batch's own counts, so the aggregated losses of
    the micro-batches sum to exactly the full-batch loss, whatever the split (micro-batch size, number of
    ranks). The learner sums :meth:`of` over its micro-batches and all-reduces the two numbers.
    A sequence counts when it has at least one response token.
    """

    tokens: int
    sequences: int

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.sequences < 0 or self.sequences > self.tokens:
            raise ValueError(f"inconsistent counts: {self.tokens} tokens, {self.sequences} sequences")

    @classmethod
    def of(cls, response_mask: Tensor) -> GlobalCounts:
        """The counts of one [B, T] mask (one micro-batch's share of the global counts)."""
        mask = _expect_mask(response_mask)
        return cls(tokens=int(mask.sum()), sequences=int(mask.any(dim=-1).sum()))

    def __add__(self, other: GlobalCounts) -> GlobalCounts:
        return GlobalCounts(self.tokens + other.tokens, self.sequences + other.sequences)


# Each signature names its settings parameter: the registries bind it by name (registries.py: build_*).


class AdvantageFn(Protocol):
    """``fn(inp, settings) -> AdvantageOutput``; ``settings`` is annotated with the variant's own :class:`Settings`."""

    def __call__(self, inp: AdvantageInput, /, settings: Any) -> AdvantageOutput: ...


class LossFn(Protocol):
    """``fn(inp, settings) -> LossOutput``."""

    def __call__(self, inp: LossInput, /, settings: Any) -> LossOutput: ...


class AggregationFn(Protocol):
    """``fn(per_token_loss [B, T], response_mask [B, T], counts, settings) -> scalar``."""

    def __call__(
        self, per_token_loss: Tensor, response_mask: Tensor, counts: GlobalCounts, /, settings: Any
    ) -> Tensor: ...


class KLEstimatorFn(Protocol):
    """``fn(logprobs [B, T], ref_logprobs [B, T], settings) -> per-token KL estimate [B, T]``."""

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, /, settings: Any) -> Tensor: ...


def _expect_mask(mask: Tensor) -> Tensor:
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"response_mask must be a [B, T] bool tensor, got {mask.dtype} {tuple(mask.shape)}")
    return mask


def _expect(name: str, tensor: Tensor | None, shape: torch.Size, dtype: torch.dtype | None = None) -> None:
    if tensor is None:
        return
    if tensor.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
