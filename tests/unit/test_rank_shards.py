"""How a batch every learner rank holds whole is cut into each rank's micro-batches (learner/engine.py)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.batch import rank_micro_batches, split_micro_batches


def batch(rows: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.arange(rows * 3).reshape(rows, 3),
        "response_mask": torch.ones(rows, 3, dtype=torch.bool),
    }


@pytest.mark.parametrize(
    ("rows", "world", "size", "unit"),
    [(9, 2, 2, 1), (8, 2, 4, 1), (1, 2, 2, 1), (5, 3, 1, 1), (8, 3, 2, 2), (12, 4, 4, 2)],
)
def test_every_rank_runs_as_many_micro_batches_and_every_row_once(rows: int, world: int, size: int, unit: int) -> None:
    whole = batch(rows)
    shards = [rank_micro_batches(whole, size, rank, world, unit) for rank in range(world)]
    assert len({len(s) for s in shards}) == 1  # ZeRO-3 gathers in every forward: no rank may run one fewer
    trained = []
    for mb in (mb for shard in shards for mb in shard):
        assert 1 <= len(mb["input_ids"]) <= size
        rows_here = (mb["input_ids"][:, 0] // 3).tolist()
        assert len(rows_here) % unit == 0 and all(
            r // unit == rows_here[i - i % unit] // unit for i, r in enumerate(rows_here)
        )  # a pair stays together
        trained += [r for r, keep in zip(rows_here, mb["response_mask"].any(-1).tolist(), strict=True) if keep]
    assert sorted(trained) == list(range(rows))  # each row counted by exactly one rank


def test_filler_micro_batches_train_nothing_and_one_rank_is_the_plain_split() -> None:
    whole = batch(3)
    *_, filler = rank_micro_batches(whole, 1, 1, 2)  # rank 1 of 2 holds row 2 of 3; the shards are 2 rows each
    assert not filler["response_mask"].any() and whole["response_mask"].all()  # a copy, masked
    one = rank_micro_batches(whole, 2, 0, 1)
    plain = split_micro_batches(whole, 2)
    assert [mb["input_ids"].tolist() for mb in one] == [mb["input_ids"].tolist() for mb in plain]
