"""Learner ranks in the loop's own code path (learner/ranks.py): rank 0 leads ``PolicyUpdate`` and the checkpoint
through its commands, the other ranks follow; real ``torchrun``, DeepSpeed and gloo on CPU.

Two ranks train the same batches as one rank — loss, grad norm and the weights the broadcaster sends agree within
1e-4 — with ZeRO 2 and ZeRO 3 (whose broadcast is a gather every rank takes part in), and PPO's critic with them
(its loss and grad norm too), with a batch that does not split evenly (9 rows: shards of 5 and 4, padded to the
same number of micro-batches). A checkpoint saved by two ranks restores on two (the step trained again gives the
same weights), and is refused by one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.checkpoint import CheckpointError, check_world_size, complete_checkpoints, open_checkpoint
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.integration
HELPER = "tests.helpers.update_ranks"
RANKS_ATOL = 1e-4  # the bound; gloo's reduction order differs from one rank's sums


def trained(model_dir: Path, out: Path, nproc: int, zero_stage: int, preset: str) -> tuple[dict, dict, dict]:
    run_ranks(HELPER, nproc, str(model_dir), str(out), "--zero-stage", str(zero_stage), "--preset", preset)
    stats = json.loads((out / "stats.json").read_text())
    return stats, load_file(out / "step2.safetensors"), load_file(out / "step2-again.safetensors")


ONE_RANK: dict[str, tuple[dict, dict, dict]] = {}


@pytest.fixture
def one_rank(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The one-rank run of a preset (ZeRO-2), made once per module."""

    def of(preset: str) -> tuple[dict, dict, dict]:
        if preset not in ONE_RANK:
            ONE_RANK[preset] = trained(tiny_model_dir, tmp_path_factory.mktemp(f"one-{preset}"), 1, 2, preset)
        return ONE_RANK[preset]

    return of


@pytest.mark.parametrize(("zero_stage", "preset"), [(2, "grpo"), (3, "grpo"), (3, "ppo")])
def test_two_ranks_train_like_one(tiny_model_dir: Path, tmp_path: Path, one_rank, zero_stage: int, preset: str) -> None:
    stats_one, weights_one, _ = one_rank(preset)
    stats, weights, again = trained(tiny_model_dir, tmp_path, 2, zero_stage, preset)
    assert (stats_one["world_size"], stats["world_size"]) == (1, 2)
    for mine, theirs in zip(stats["steps"], stats_one["steps"], strict=True):
        assert mine.keys() == theirs.keys() and ("critic/loss" in mine) == (preset == "ppo")
        for figure, value in theirs.items():  # loss, grad norm (and the critic's)
            assert mine[figure] == pytest.approx(value, abs=RANKS_ATOL), figure
    assert weights.keys() == weights_one.keys() and "lm_head.weight" in weights
    for name, tensor in weights_one.items():  # what the broadcaster sends after step 2
        torch.testing.assert_close(weights[name], tensor, atol=RANKS_ATOL, rtol=0, msg=name)
    moved = max((weights[n] - again[n]).abs().max().item() for n in weights)
    assert moved == 0.0  # step 2 trained again after restoring step 1's checkpoint on two ranks: the same weights

    [(step, folder)] = complete_checkpoints(tmp_path / "runs" / "ranks" / "checkpoints")
    checkpoint = open_checkpoint(folder)
    assert (step, checkpoint.state.world_size, len(checkpoint.state.rank_rngs)) == (1, 2, 1)
    with pytest.raises(CheckpointError, match=r"saved by 2 learner rank\(s\) and this learner has 1.*resume with 2"):
        check_world_size(checkpoint, 1)
