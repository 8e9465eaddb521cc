"""From scored groups to the padded tensors one training step works on, and those cut into micro-batches.

Every response becomes one row: prompt tokens then response tokens, right-padded to the longest
row. Token-aligned values follow the engine's convention (``learner/update/engine.py``): the value at index
``t`` belongs to token ``t`` (its log-prob given the tokens before it), so the behaviour log-probs
that vLLM reported for response token ``j`` sit at index ``len(prompt) + j``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch
from torch import Tensor

from asyncrl.common.wire.messages import ScoredGroup

MODEL_INPUTS = ("input_ids", "attention_mask", "response_mask", "behaviour_logprobs")
"""The ``[rows, T]`` tensors the model's passes take (micro-batched together)."""


@dataclass(frozen=True)
class TrainBatch:
    """B rows (one per response) of length T."""

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] int64, 1 on real tokens
    response_mask: torch.Tensor  # [B, T] bool, True on response tokens that are trained (the rollout's loss mask)
    behaviour_logprobs: torch.Tensor  # [B, T] float32, μ at response tokens, 0 elsewhere
    versions: torch.Tensor  # [B, T] int64, policy version of each response token, -1 elsewhere
    rewards: torch.Tensor  # [B] float32
    group_ids: torch.Tensor  # [B] int64, index of the row's group in this batch
    keys: tuple[tuple[str, int], ...] = ()  # [B] (group id, response index) of each row
    turn_rewards: torch.Tensor | None = None  # [B, T] float32: each model turn's reward share at its last token
    served: ServedRows | None = None  # the rows the model runs on, when an episode was kept per turn

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """What the model's passes run on: :meth:`tensors`, or the :class:`ServedRows` of per-turn episodes."""
        return self.served.tensors() if self.served is not None else self.tensors()

    def on_model_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` values of this batch's rows (advantages) on the rows of :meth:`model_tensors`."""
        return self.served.take(values) if self.served is not None else values

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in MODEL_INPUTS}


@dataclass(frozen=True)
class ServedRows:
    """R rows of length T': the prompt, then one row of a response (``RolloutGroup.rows``): every row of a per-turn
    episode, and every other response whole. ``source`` maps each trained position to the flat index of the same
    token in the batch's ``[B, T]`` rows (``-1`` elsewhere)."""

    input_ids: torch.Tensor  # [R, T'] int64
    attention_mask: torch.Tensor  # [R, T'] int64
    response_mask: torch.Tensor  # [R, T'] bool
    behaviour_logprobs: torch.Tensor  # [R, T'] float32
    source: torch.Tensor  # [R, T'] int64

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in MODEL_INPUTS}

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[B, T]`` at the trained positions of these rows, 0 elsewhere."""
        picked = values.reshape(-1)[self.source.clamp(min=0)]
        return torch.where(self.source >= 0, picked, torch.zeros((), dtype=values.dtype))


def served_rows(rows: Sequence[tuple[ScoredGroup, int]], pad_id: int, width: int) -> ServedRows:
    """The :class:`ServedRows` of the batch rows ``rows`` (``[B, width]``, as :func:`collate` lays them out)."""
    parts = [(b, g, i, start, end) for b, (g, i) in enumerate(rows) for start, end in g.rollout.rows(i)]
    served_width = max(len(g.rollout.prompt_ids) + end - start for _, g, _, start, end in parts)
    shape = (len(parts), served_width)
    input_ids, attention = np.full(shape, pad_id, np.int64), np.zeros(shape, np.int64)
    trained, behaviour, source = np.zeros(shape, bool), np.zeros(shape, np.float32), np.full(shape, -1, np.int64)
    for r, (b, group, i, start, end) in enumerate(parts):
        prompt = group.rollout.prompt_ids
        ids, logprobs, _ = group.rollout.response(i)
        first, last = len(prompt), len(prompt) + end - start
        input_ids[r, :first], input_ids[r, first:last] = prompt, ids[start:end]
        attention[r, :last] = 1
        trained[r, first:last] = group.rollout.trained(i)[start:end]
        behaviour[r, first:last] = logprobs[start:end]
        at = b * width + len(prompt) + np.arange(start, end)
        source[r, first:last] = np.where(trained[r, first:last], at, -1)
    return ServedRows(*map(torch.from_numpy, (input_ids, attention, trained, behaviour, source)))


def collate(
    groups: Sequence[ScoredGroup], pad_id: int, rows: Sequence[tuple[ScoredGroup, int]] | None = None
) -> TrainBatch:
    """Pad responses into one batch (see the module docstring for the alignment): every response of every group,
    or the ``(group, response index)`` ``rows`` given, in that order."""
    if rows is None:
        rows = [(g, i) for g in groups for i in range(g.rollout.num_samples)]
    width = max(len(g.rollout.prompt_ids) + int(g.rollout.lengths[i]) for g, i in rows)
    shape = (len(rows), width)
    input_ids = np.full(shape, pad_id, np.int64)
    attention = np.zeros(shape, np.int64)
    response = np.zeros(shape, bool)
    behaviour = np.zeros(shape, np.float32)
    versions = np.full(shape, -1, np.int64)
    turn_rewards = np.zeros(shape, np.float32) if any(len(g.turn_rewards) for g, _ in rows) else None
    shares_of: dict[int, list[np.ndarray]] = {}
    group_index = {id(g): n for n, g in enumerate(groups)}
    for row, (group, i) in enumerate(rows):
        prompt = group.rollout.prompt_ids
        ids, logprobs, token_versions = group.rollout.response(i)
        start, end = len(prompt), len(prompt) + len(ids)
        input_ids[row, :start] = prompt
        input_ids[row, start:end] = ids
        attention[row, :end] = 1
        response[row, start:end] = group.rollout.trained(i)  # the loss mask: tokens the model did not sample stay out
        behaviour[row, start:end] = logprobs.astype(np.float32)
        versions[row, start:end] = token_versions
        if turn_rewards is not None and len(shares := shares_of.setdefault(id(group), group.turn_shares())[i]):
            turn_ends = [start + stop - 1 for _, stop, by_model in group.rollout.segments(i) if by_model]
            turn_rewards[row, turn_ends] = shares
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        response_mask=torch.from_numpy(response),
        behaviour_logprobs=torch.from_numpy(behaviour),
        versions=torch.from_numpy(versions),
        rewards=torch.tensor([float(g.rewards[i]) for g, i in rows], dtype=torch.float32),
        group_ids=torch.tensor([group_index[id(g)] for g, _ in rows], dtype=torch.int64),
        keys=tuple((g.rollout.group_id, i) for g, i in rows),
        turn_rewards=None if turn_rewards is None else torch.from_numpy(turn_rewards),
        served=served_rows(rows, pad_id, width) if any(len(g.rollout.row_starts) for g, _ in rows) else None,
    )


def preference_rows(groups: Sequence[ScoredGroup]) -> list[tuple[ScoredGroup, int]]:
    """Online DPO pairs: from each group its best then its worst scored response (Guo et al. 2024, "Direct Language
    Model Alignment from Online AI Feedback", with the reward as the judge); a group whose rewards are all equal
    prefers nothing and gives no pair. Rows come out as chosen, rejected, chosen, rejected, …"""
    rows: list[tuple[ScoredGroup, int]] = []
    for group in groups:
        rewards = np.asarray(group.rewards, dtype=np.float64)
        best, worst = int(rewards.argmax()), int(rewards.argmin())
        if rewards[best] > rewards[worst]:
            rows += [(group, best), (group, worst)]
    return rows


# --------------------------------------------------------------------------- the policy's step


@dataclass(frozen=True)
class PolicyRows:
    """The policy update's ``[rows, T]`` tensors, of the whole step or of one micro-batch of it, in the engine's
    alignment (module docstring): what the model runs on, μ, the advantages, and the log-probs of a pass before the
    update where the algorithm needs them. A missing one is ``None``, never a missing key."""

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    behaviour_logprobs: Tensor
    """μ: the log-probs the actors sampled with."""
    advantages: Tensor
    old_logprobs: Tensor | None = None
    """π_old from a no-grad pass before the update (only for a KL penalty in the reward): otherwise the training
    forward's own log-probs stand for it (``learner/update/policy.py``)."""
    ref_logprobs: Tensor | None = None
    """π_ref of the frozen reference (a KL term in the loss or the reward)."""

    def tensors(self) -> dict[str, Tensor]:
        """The tensors present, by name: what :func:`rank_micro_batches` cuts by rows."""
        return {f.name: value for f in dataclasses.fields(self) if (value := getattr(self, f.name)) is not None}

    def to(self, device: torch.device | str) -> Self:
        return dataclasses.replace(self, **{name: value.to(device) for name, value in self.tensors().items()})

    def micro_batches(self, size: int, rank: int, world: int, unit: int = 1) -> list[Self]:
        """Rank ``rank``'s micro-batches of the step (:func:`rank_micro_batches`), each a :class:`PolicyRows`."""
        return [type(self)(**piece) for piece in rank_micro_batches(self.tensors(), size, rank, world, unit)]


# --------------------------------------------------------------------------- micro-batches


def split_micro_batches(batch: Mapping[str, Tensor], size: int) -> list[dict[str, Tensor]]:
    """Cut a batch of ``[N, ...]`` tensors along dim 0 into micro-batches of at most ``size`` rows (views)."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    rows = {len(value) for value in batch.values()}
    if len(rows) != 1:
        raise ValueError(f"batch tensors disagree on the row count: {sorted(rows)}")
    total = rows.pop()
    return [{key: value[start : start + size] for key, value in batch.items()} for start in range(0, total, size)]


def rank_micro_batches(
    batch: Mapping[str, Tensor], size: int, rank: int, world: int, unit: int = 1, fillers: bool = True
) -> list[dict[str, Tensor]]:
    """Rank ``rank``'s micro-batches of a batch every one of ``world`` ranks holds whole.

    The rows are cut into ``world`` contiguous shards of ⌈U / world⌉ units of ``unit`` rows (U units in all; a pair
    of a pairwise loss is never split), each shard into micro-batches of at most ``size`` rows. Every rank runs the
    same number, ⌈rows per shard / size⌉, of forward and backward passes — ZeRO-3 gathers parameters in each, so a
    rank with one fewer would hang the others; where a short shard (the last, or an empty one) has too few, the rest
    are one unit of the batch with its ``response_mask`` zeroed, which adds 0 to the loss and the gradient. With one
    rank these are :func:`split_micro_batches`'s passes over the rows reordered as below; ``fillers = False`` leaves
    the filler passes out. Global-count aggregation makes the shards' gradients sum to the whole batch's, so the
    update does not depend on ``world``.

    Within a shard the units go longest first, and each micro-batch is cut to its own longest row
    (:func:`trimmed`): with lengths that differ by 10–100× a pass no longer pads every short row to the batch's longest,
    and neither the order nor the cut changes the loss (rows are right-padded and the attention causal).
    """
    total = len(next(iter(batch.values())))
    per_rank = math.ceil(total // unit / world) * unit
    start, stop = min(rank * per_rank, total), min((rank + 1) * per_rank, total)
    shard = longest_first({k: v[start:stop] for k, v in batch.items()}, unit) if stop > start else {}
    pieces = [trimmed(piece) for piece in split_micro_batches(shard, size)] if shard else []
    if not fillers:
        return pieces
    filler = {k: v[:unit].clone() for k, v in batch.items()}
    if "response_mask" in filler:
        filler["response_mask"].zero_()
    return pieces + [trimmed(filler)] * (max(1, math.ceil(per_rank / size)) - len(pieces))


def training_passes(
    batch: Mapping[str, Tensor], size: int, world: int, unit: int = 1
) -> list[tuple[Tensor, dict[str, Tensor]]]:
    """Every rank's micro-batches of a step (:func:`rank_micro_batches`, fillers aside), each with the indices of the
    batch rows it holds: a no-grad pass over these runs the very shapes the training forward runs, so its values are
    the training forward's own, bit for bit (π_old, the critic's V_old)."""
    rows = torch.arange(len(next(iter(batch.values()))))
    passes = []
    for rank in range(world):
        for piece in rank_micro_batches({**batch, "row": rows}, size, rank, world, unit, fillers=False):
            passes.append((piece.pop("row"), piece))
    return passes


def longest_first(batch: Mapping[str, Tensor], unit: int = 1) -> dict[str, Tensor]:
    """The rows reordered by the length of their unit (``unit`` consecutive rows, kept together), longest first."""
    units = batch["attention_mask"].sum(dim=1).view(-1, unit).max(dim=1).values
    order = torch.argsort(units, descending=True, stable=True)
    rows = (order[:, None] * unit + torch.arange(unit)).flatten()
    return {key: value[rows] for key, value in batch.items()}


def trimmed(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The batch's ``[B, T]`` tensors cut after the last column any row attends to (right padding only)."""
    mask = batch["attention_mask"]
    width = int(mask.any(dim=0).nonzero().max()) + 1 if bool(mask.any()) else 1
    columns = mask.shape[1]
    return {k: v[:, :width] if v.dim() >= 2 and v.shape[1] == columns else v for k, v in batch.items()}
