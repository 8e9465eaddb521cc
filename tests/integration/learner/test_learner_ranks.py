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

from asyncrl.learner.checkpoint.format import CheckpointError, open_checkpoint
from asyncrl.learner.checkpoint.history import complete_checkpoints
from asyncrl.learner.checkpoint.settings import check_world_size
from tests.helpers.ranks import run_ranks
from tests.helpers.update_ranks import case_dir

HELPER = "tests.helpers.update_ranks"
RANKS_ATOL = 1e-4  # the bound; gloo's reduction order differs from one rank's sums


CASES = [(2, "grpo"), (3, "grpo"), (3, "ppo")]
"""(ZeRO stage, preset) of the two-rank runs."""
ONE_RANK_STAGE = 2
"""The ZeRO stage of the one-rank run of each preset that the two-rank runs are compared with."""
PRESETS = sorted({preset for _, preset in CASES})
Trained = tuple[dict, dict, dict]


def read_case(out: Path, zero_stage: int, preset: str) -> Trained:
    folder = case_dir(out, zero_stage, preset)
    stats = json.loads((folder / "stats.json").read_text())
    return stats, load_file(folder / "step2.safetensors"), load_file(folder / "step2-again.safetensors")


def case_args(cases: list[tuple[int, str]]) -> list[str]:
    return [arg for stage, preset in cases for arg in ("--case", f"{stage}:{preset}")]


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The folders of two launches, one of one rank and one of two, each running its cases in turn (a launch's
    imports and process group are paid once): each preset at :data:`ONE_RANK_STAGE` on one rank, each case on two."""
    one, two = tmp_path_factory.mktemp("one-rank"), tmp_path_factory.mktemp("two-ranks")
    run_ranks(HELPER, 1, str(tiny_model_dir), str(one), *case_args([(ONE_RANK_STAGE, p) for p in PRESETS]))
    run_ranks(HELPER, 2, str(tiny_model_dir), str(two), *case_args(CASES))
    return one, two


@pytest.mark.parametrize(("zero_stage", "preset"), CASES)
def test_two_ranks_train_like_one(runs: tuple[Path, Path], zero_stage: int, preset: str) -> None:
    one, two = runs
    stats_one, weights_one, _ = read_case(one, ONE_RANK_STAGE, preset)
    stats, weights, again = read_case(two, zero_stage, preset)
    assert (stats_one["world_size"], stats["world_size"]) == (1, 2)
    assert all(step["grad_norm"] > 0 for step in stats_one["steps"]), stats_one  # every step trained: not vacuous
    for mine, theirs in zip(stats["steps"], stats_one["steps"], strict=True):
        assert mine.keys() == theirs.keys() and ("critic/loss" in mine) == (preset == "ppo")
        for figure, value in theirs.items():  # loss, grad norm (and the critic's)
            assert mine[figure] == pytest.approx(value, abs=RANKS_ATOL), figure
    assert weights.keys() == weights_one.keys() and "lm_head.weight" in weights
    for name, tensor in weights_one.items():  # what the broadcaster sends after step 2
        torch.testing.assert_close(weights[name], tensor, atol=RANKS_ATOL, rtol=0, msg=name)
    moved = max((weights[n] - again[n]).abs().max().item() for n in weights)
    assert moved == 0.0  # step 2 trained again after restoring step 1's checkpoint on two ranks: the same weights

    [(step, folder)] = complete_checkpoints(case_dir(two, zero_stage, preset) / "runs" / "ranks" / "checkpoints")
    checkpoint = open_checkpoint(folder)
    assert (step, checkpoint.state.world_size, len(checkpoint.state.rank_rngs)) == (1, 2, 1)
    with pytest.raises(CheckpointError, match=r"saved by 2 learner rank\(s\) and this learner has 1.*resume with 2"):
        check_world_size(checkpoint, 1)
