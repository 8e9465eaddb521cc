"""Collating scored groups into training rows: all responses, or online-DPO pairs of best and worst."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from asyncrl.common.wire.messages import ScoredGroup
from asyncrl.learner.update.batch import collate, preference_rows
from tests.helpers.rollouts import make_group


def scored(texts: list[str], rewards: list[float]) -> ScoredGroup:
    return ScoredGroup(rollout=make_group(texts), rewards=np.asarray(rewards, np.float32))


def test_pairs_are_each_groups_best_then_worst_and_equal_groups_give_none() -> None:
    a = scored(["1", "22", "333"], [0.5, 1.0, 0.0])
    flat = scored(["1", "2"], [1.0, 1.0])
    b = scored(["4444", "5"], [0.0, 2.0])
    rows = preference_rows([a, flat, b])
    assert [(g is a, g is b, i) for g, i in rows] == [
        (True, False, 1),
        (True, False, 2),
        (False, True, 1),
        (False, True, 0),
    ]


def test_collate_of_pairs_keeps_their_order_rewards_and_groups() -> None:
    a = scored(["1", "22", "333"], [0.5, 1.0, 0.0])
    b = scored(["4444", "5"], [0.0, 2.0])
    batch = collate([a, b], pad_id=0, rows=preference_rows([a, b]))
    assert batch.rewards.tolist() == [1.0, 0.0, 2.0, 0.0]  # chosen, rejected, chosen, rejected
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.response_mask.sum(dim=1).tolist() == [2, 3, 1, 4]  # the responses' lengths
    assert torch.equal(collate([a, b], pad_id=0).rewards, torch.tensor([0.5, 1.0, 0.0, 0.0, 2.0]))


def test_tokens_the_loss_mask_leaves_out_are_context_but_not_trained() -> None:
    """A multi-turn response: the environment's tokens (mask 0) stay in the row the model reads, out of the loss."""
    group = scored(["1234", "56"], [1.0, 0.0])
    masked = dataclasses.replace(group.rollout, loss_mask=np.array([1, 0, 0, 1, 1, 1], np.int32))
    batch = collate([ScoredGroup(rollout=masked, rewards=group.rewards)], pad_id=0)
    start = len(masked.prompt_ids)
    assert batch.attention_mask[0].sum() == start + 4  # every token is context
    assert batch.response_mask[0, start : start + 4].tolist() == [True, False, False, True]
    assert batch.response_mask.sum(dim=1).tolist() == [2, 2]
    assert torch.equal(batch.input_ids[0, start : start + 4], torch.from_numpy(masked.token_ids[:4]).long())


def test_turn_rewards_sit_at_the_last_token_of_each_model_turn() -> None:
    """Two model turns around an environment's token ([1, 1, 0, 1, 1]): their rewards at the turns' last tokens; a
    group without turn rewards in the same batch has zeros; a batch where no group has them has none."""
    rollout = dataclasses.replace(make_group(["abcde"]), loss_mask=np.array([1, 1, 0, 1, 1], np.int32))
    episode = ScoredGroup(rollout=rollout, rewards=np.array([1.5], np.float32), turn_rewards=np.array([0.5, 1.0]))
    plain = scored(["12"], [1.0])
    batch = collate([episode, plain], pad_id=0)
    prompt = len(rollout.prompt_ids)
    assert batch.turn_rewards is not None
    assert batch.turn_rewards[0].nonzero().flatten().tolist() == [prompt + 1, prompt + 4]
    assert batch.turn_rewards[0, [prompt + 1, prompt + 4]].tolist() == [0.5, 1.0]
    assert not batch.turn_rewards[1].any()
    assert collate([plain], pad_id=0).turn_rewards is None
