"""One optimizer step of :class:`asyncrl.learner.update.engine.PolicyEngine` on each learner rank, for the two-rank
test.

Run under a launcher, from the repository root::

    torchrun --nproc_per_node 2 --master_port PORT -m tests.helpers.engine_ranks MODEL_DIR OUT_DIR --zero-stage 2

Rank ``r`` of ``W`` takes rows ``[r·N/W, (r+1)·N/W)`` of :func:`fixed_batch` and trains one step on them with the
NLL of :func:`nll_loss`, normalised by the token count of the whole batch (all-reduced, as a real loop does). Rank 0
writes ``OUT_DIR/stats.json`` (loss, grad norm, lr, seconds, world size) and ``OUT_DIR/weights.safetensors`` (the
updated weights from ``state_dict_for_broadcast``). The test imports the batch, loss and config from here too, so
both sides train on exactly the same data.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from asyncrl.common.config import RunConfig
from asyncrl.common.data.tasks import TASK_ALPHABET
from asyncrl.learner import dist
from asyncrl.learner.update.batch import split_micro_batches
from asyncrl.learner.update.engine import Batch, LossFn, PolicyEngine

LENGTHS = (12, 5, 9, 3, 11, 7, 10, 6)  # different lengths, so rows carry right padding
FIRST_TOKEN_ID = 4  # ids 0..3 are <pad> <s> </s> <unk> in the tiny model's tokenizer
LEARNING_RATE = 1e-3  # large enough that one step moves the weights visibly


def fixed_batch(seed: int = 0) -> Batch:
    """``[8, 12]`` right-padded random token ids from the task alphabet and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    input_ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    attention_mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        high = FIRST_TOKEN_ID + len(TASK_ALPHABET)
        input_ids[row, :length] = torch.randint(FIRST_TOKEN_ID, high, (length,), generator=generator)
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def predicted_tokens(attention_mask: Tensor) -> int:
    """Tokens that get a log-prob: valid and preceded by a valid token (every valid one but the first of a row)."""
    mask = attention_mask.bool()
    return int((mask[:, 1:] & mask[:, :-1]).sum())


def nll_loss(total_tokens: float) -> LossFn:
    """``-Σ log π(x_t | x_<t) / total_tokens`` over a micro-batch: its share of the full batch's mean NLL."""

    def loss(engine: PolicyEngine, micro_batch: Batch) -> Tensor:
        logprobs = engine.token_logprobs(micro_batch["input_ids"], micro_batch["attention_mask"])
        return -logprobs.sum() / total_tokens

    return loss


def run_config(zero_stage: int, micro_batch_size: int) -> RunConfig:
    return RunConfig.model_validate(
        {"learner": {"zero_stage": zero_stage, "micro_batch_size": micro_batch_size, "lr": LEARNING_RATE}}
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    args = parser.parse_args(argv)

    dist.init_distributed()
    rank, world = dist.rank(), dist.world_size()
    batch = fixed_batch()
    rows = len(LENGTHS) // world
    mine = {key: value[rank * rows : (rank + 1) * rows] for key, value in batch.items()}
    total = dist.all_reduce_sum(predicted_tokens(mine["attention_mask"]))

    engine = PolicyEngine(run_config(args.zero_stage, args.micro_batch_size), args.model_dir, global_batch=len(LENGTHS))
    stats = engine.train_step(split_micro_batches(mine, args.micro_batch_size), nll_loss(total))
    weights = engine.state_dict_for_broadcast(torch.float32)  # collective under ZeRO-3: every rank calls it
    if rank == 0:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, args.out_dir / "weights.safetensors")
        (args.out_dir / "stats.json").write_text(json.dumps({**asdict(stats), "world_size": world}))
    dist.shutdown()


if __name__ == "__main__":
    main()
