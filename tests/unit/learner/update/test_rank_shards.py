"""How a batch every learner rank holds whole is cut into each rank's micro-batches (learner/update/engine.py)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.update.batch import (
    longest_first,
    rank_micro_batches,
    split_micro_batches,
    training_passes,
    trimmed,
)


def batch(rows: int, width: int = 3) -> dict[str, torch.Tensor]:
    """Row r holds r·width, r·width+1, …; its length is 1 + r % width (right-padded)."""
    lengths = torch.tensor([1 + r % width for r in range(rows)])
    attention = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return {
        "input_ids": torch.arange(rows * width).reshape(rows, width),
        "attention_mask": attention,
        "response_mask": attention.bool(),
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
        lengths = mb["attention_mask"].sum(-1)
        assert mb["input_ids"].shape[1] == int(lengths.max())  # cut to its own longest row
        assert len(rows_here) % unit == 0 and all(
            r // unit == rows_here[i - i % unit] // unit for i, r in enumerate(rows_here)
        )  # a pair stays together
        trained += [r for r, keep in zip(rows_here, mb["response_mask"].any(-1).tolist(), strict=True) if keep]
    assert sorted(trained) == list(range(rows))  # each row counted by exactly one rank


def test_filler_micro_batches_train_nothing_and_one_rank_is_the_plain_split() -> None:
    whole = batch(3)
    *_, filler = rank_micro_batches(whole, 1, 1, 2)  # rank 1 of 2 holds row 2 of 3; the shards are 2 rows each
    assert not filler["response_mask"].any() and whole["response_mask"][0].any()  # a copy, masked
    one = rank_micro_batches(whole, 2, 0, 1)  # rows of lengths 1, 2, 3: longest first, each cut to its longest
    assert [mb["input_ids"].tolist() for mb in one] == [[[6, 7, 8], [3, 4, 5]], [[0]]]
    assert len(one) == len(split_micro_batches(whole, 2))


def test_pairs_go_longest_first_together_and_the_cut_changes_no_logit_a_row_attends_to() -> None:
    """A pair is ordered by its longer row; a causal model's values at a row's real tokens do not depend on the pad
    columns after them, so cutting those columns changes nothing trained."""
    whole = batch(6, width=5)  # lengths 1 2 3 4 5 1: pairs (1, 2), (3, 4), (5, 1)
    ordered = longest_first(whole, unit=2)
    assert (ordered["input_ids"][:, 0] // 5).tolist() == [4, 5, 2, 3, 0, 1]
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    embed = torch.nn.Embedding(30, 8)

    def causal_values(mb: dict[str, torch.Tensor]) -> torch.Tensor:
        width = mb["input_ids"].shape[1]
        causal = torch.triu(torch.full((width, width), float("-inf")), diagonal=1)
        return layer(embed(mb["input_ids"]), src_mask=causal)

    short = {k: v[4:] for k, v in ordered.items()}  # lengths 1 and 2 of width 5
    cut = trimmed(short)
    assert cut["input_ids"].shape[1] == 2
    full = causal_values(short)
    assert torch.allclose(causal_values(cut)[:, :2, 0], full[:, :2, 0], atol=1e-6)


@pytest.mark.parametrize(("world", "size", "unit"), [(1, 2, 1), (2, 2, 1), (3, 2, 2)])
def test_the_no_grad_passes_run_the_training_passes_rows_and_shapes(world: int, size: int, unit: int) -> None:
    """π_old's and V_old's passes go through every rank's micro-batches as training does, fillers aside: each row
    once, in a pass of the same rows and width as the one that trains it."""
    whole = batch(12, width=5)
    passes = training_passes(whole, size, world, unit)
    assert sorted(torch.cat([rows for rows, _ in passes]).tolist()) == list(range(12))
    trained = [mb for rank in range(world) for mb in rank_micro_batches(whole, size, rank, world, unit, fillers=False)]
    assert [mb["input_ids"].tolist() for _, mb in passes] == [mb["input_ids"].tolist() for mb in trained]
    for rows, mb in passes:
        assert torch.equal(mb["input_ids"], whole["input_ids"][rows][:, : mb["input_ids"].shape[1]])


def test_the_policys_step_is_cut_as_its_tensors_are_and_a_missing_one_stays_none() -> None:
    """:class:`PolicyRows` cuts by the same rules as named tensors: every field present is cut alike, and a pass the
    step did not run (π_old, π_ref) is ``None`` in every micro-batch, not a missing key."""
    from asyncrl.learner.update.batch import PolicyRows

    whole = batch(5)
    mu = torch.randn(5, 3)
    step = PolicyRows(**whole, behaviour_logprobs=mu, advantages=mu * 2, ref_logprobs=mu - 1)
    pieces = step.micro_batches(2, rank=0, world=1)
    named = rank_micro_batches(step.tensors(), 2, 0, 1)
    assert [type(p) for p in pieces] == [PolicyRows] * len(named) == [PolicyRows] * 3
    for piece, same in zip(pieces, named, strict=True):
        assert piece.old_logprobs is None and set(piece.tensors()) == set(same) == set(step.tensors())
        for name, value in same.items():
            assert torch.equal(getattr(piece, name), value)
    assert "old_logprobs" not in step.tensors() and step.to("cpu").advantages.device.type == "cpu"
