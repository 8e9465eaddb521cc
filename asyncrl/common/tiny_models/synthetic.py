"""Synthetic messages of realistic shape, for benchmarks, tests and smoke checks of a deployment."""

from __future__ import annotations

import uuid

import numpy as np

from asyncrl.common.wire.messages import RolloutGroup, ScoredGroup


def rollout_group(
    num_samples: int = 8,
    tokens: int = 1024,
    vocab_size: int = 32_000,
    seed: int = 0,
    logprob_dtype: str = "float32",
) -> RolloutGroup:
    """A group of ``num_samples`` responses of ``tokens`` tokens each with random ids and log-probs."""
    rng = np.random.default_rng(seed)
    total = num_samples * tokens
    logprobs = -rng.exponential(1.0, total).astype(np.float32)
    if logprob_dtype == "bfloat16":
        import ml_dtypes

        logprobs = logprobs.astype(ml_dtypes.bfloat16)
    return RolloutGroup(
        group_id=uuid.uuid4().hex,
        task="synthetic",
        prompt="12+7=",
        prompt_ids=rng.integers(0, vocab_size, 16, dtype=np.int32),
        answer="19",
        token_ids=rng.integers(0, vocab_size, total, dtype=np.int32),
        logprobs=logprobs,
        versions=np.zeros(total, np.int32),
        lengths=np.full(num_samples, tokens, np.int32),
        texts=["19"] * num_samples,
        finish_reasons=["length"] * num_samples,
        actor_id="synthetic-actor",
        timings={"generate": 0.5},
    )


def scored_group(num_samples: int = 8, tokens: int = 1024, seed: int = 0, **kwargs) -> ScoredGroup:
    """A :func:`rollout_group` with a reward of 0 or 1 per response."""
    rollout = rollout_group(num_samples, tokens, seed=seed, **kwargs)
    rewards = np.random.default_rng(seed + 1).integers(0, 2, num_samples).astype(np.float32)
    return ScoredGroup(rollout=rollout, rewards=rewards, details=[{"task": float(r)} for r in rewards])
