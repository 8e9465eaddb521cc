"""Loss aggregations: per-token loss [B, T] of one micro-batch → its share of the global-batch loss.

Every aggregation divides by :class:`~asyncrl.learner.algorithms.types.GlobalCounts` of the WHOLE global batch,
never by the micro-batch's own counts, so Σ over micro-batches and ranks of the aggregated losses is the
full-batch loss exactly, and the gradient does not depend on how the batch was split. The per-sequence
mean of ``seq_mean_token_mean`` uses the sequence's own token count, which is local because a sequence is
never split across micro-batches. Empty counts give 0 rather than NaN.

Note for the caller: DeepSpeed (like DDP) averages gradients over ranks and divides the loss by the
gradient-accumulation steps; with global counts both must be undone (multiply by the world size, do not
scale by accumulation steps), or the sum described above is divided twice.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import Tensor

from asyncrl.learner.algorithms.masked import zero_masked
from asyncrl.learner.algorithms.registries import register_aggregation
from asyncrl.learner.algorithms.types import GlobalCounts, Settings


class TokenMeanSettings(Settings):
    name: Literal["token_mean"] = "token_mean"


class SeqMeanTokenSumSettings(Settings):
    name: Literal["seq_mean_token_sum"] = "seq_mean_token_sum"


class SeqMeanTokenMeanSettings(Settings):
    name: Literal["seq_mean_token_mean"] = "seq_mean_token_mean"


class SeqMeanTokenSumNormSettings(Settings):
    name: Literal["seq_mean_token_sum_norm"] = "seq_mean_token_sum_norm"
    norm: float = Field(gt=0.0)
    """The constant each sequence's token sum is divided by; Dr. GRPO uses the generation budget
    (``rollout.max_new_tokens``). Required: no default could match every run."""


@register_aggregation("token_mean")
def token_mean(
    per_token_loss: Tensor, response_mask: Tensor, counts: GlobalCounts, settings: TokenMeanSettings
) -> Tensor:
    """Σ_{i,t} mask · loss / N_tokens: every token weighs the same, so long responses are not diluted
    (DAPO's token-level policy gradient loss, Yu et al. 2025, §3.3)."""
    return zero_masked(per_token_loss, response_mask).sum() / max(counts.tokens, 1)


@register_aggregation("seq_mean_token_sum")
def seq_mean_token_sum(
    per_token_loss: Tensor, response_mask: Tensor, counts: GlobalCounts, settings: SeqMeanTokenSumSettings
) -> Tensor:
    """Σ_i Σ_t mask · loss / N_sequences: the token sum of each sequence, averaged over sequences
    (verl's ``seq-mean-token-sum``)."""
    return zero_masked(per_token_loss, response_mask).sum() / max(counts.sequences, 1)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(
    per_token_loss: Tensor, response_mask: Tensor, counts: GlobalCounts, settings: SeqMeanTokenMeanSettings
) -> Tensor:
    """Σ_i (Σ_t mask · loss / |o_i|) / N_sequences: the per-sequence mean, averaged over sequences
    (the GRPO objective as written, Shao et al. 2024, eq. 3; a sequence with no tokens adds 0)."""
    per_sequence = zero_masked(per_token_loss, response_mask).sum(dim=-1)
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    return (per_sequence / lengths).sum() / max(counts.sequences, 1)


@register_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    per_token_loss: Tensor, response_mask: Tensor, counts: GlobalCounts, settings: SeqMeanTokenSumNormSettings
) -> Tensor:
    """Σ_{i,t} mask · loss / (N_sequences · norm): token sums divided by a constant, so the response
    length does not scale the per-token weight (Dr. GRPO, Liu et al. 2025)."""
    return zero_masked(per_token_loss, response_mask).sum() / (max(counts.sequences, 1) * settings.norm)
