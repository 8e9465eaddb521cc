"""The DeepSpeed policy engine on CPU (gloo): log-prob alignment, micro-batch accumulation, two ranks against one.

Every loss here follows the engine's convention: a micro-batch returns its share of the full batch's mean NLL
(normalised by the whole batch's token count), so one micro-batch, two micro-batches and two ranks must give the
same loss, gradient norm and updated weights. The two-rank run is a real ``torchrun`` with two processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncrl.learner.update.batch import split_micro_batches
from asyncrl.learner.update.engine import PolicyEngine, ReferenceModel
from tests.helpers.engine_ranks import LENGTHS, fixed_batch, nll_loss, predicted_tokens, run_config
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.usefixtures("one_rank_world")

TIGHT = 1e-5  # same process, same maths, different summation order
RANKS_RTOL = 1e-4  # two processes: gloo reduction order differs


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def engine_for(model_dir: Path, zero_stage: int, micro_batch_size: int) -> PolicyEngine:
    return PolicyEngine(run_config(zero_stage, micro_batch_size), str(model_dir), global_batch=len(LENGTHS))


def full_batch_step(model_dir: Path, zero_stage: int, micro_batch_size: int):
    """(stats, updated float32 weights) of one step on :func:`fixed_batch` on this one-rank world."""
    batch = fixed_batch()
    engine = engine_for(model_dir, zero_stage, micro_batch_size)
    loss = nll_loss(predicted_tokens(batch["attention_mask"]))
    stats = engine.train_step(split_micro_batches(batch, micro_batch_size), loss)
    return stats, engine.state_dict_for_broadcast(torch.float32)


def test_token_logprobs_are_the_log_prob_of_each_token(model_dir: Path) -> None:
    batch = fixed_batch()
    engine = engine_for(model_dir, zero_stage=0, micro_batch_size=8)
    got = engine.token_logprobs(**batch)
    assert got.shape == batch["input_ids"].shape and got.requires_grad

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for row, t, temperature in [(0, 1, 1.0), (0, 11, 1.0), (1, 4, 1.0), (3, 2, 1.0), (6, 9, 1.0), (4, 5, 0.7)]:
        ids = batch["input_ids"][row : row + 1, : LENGTHS[row]]  # the row alone, without padding
        with torch.no_grad():
            logits = plain(input_ids=ids).logits[0, t - 1]  # position t-1 predicts token t
        expected = torch.log_softmax(logits / temperature, dim=-1)[ids[0, t]].item()
        value = engine.token_logprobs_no_grad(**batch, temperature=temperature)[row, t].item()
        assert value == pytest.approx(expected, abs=TIGHT), (row, t, temperature)

    assert torch.all(got[:, 0] == 0)  # nothing predicts the first token
    assert torch.all(got[batch["attention_mask"] == 0] == 0)  # padding contributes nothing to a sum
    reference = ReferenceModel(model_dir, "float32").token_logprobs(**batch)
    assert not reference.requires_grad
    torch.testing.assert_close(reference, got.detach(), atol=TIGHT, rtol=0)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_two_micro_batches_step_like_one(model_dir: Path, zero_stage: int) -> None:
    one, weights_one = full_batch_step(model_dir, zero_stage, micro_batch_size=8)
    two, weights_two = full_batch_step(model_dir, zero_stage, micro_batch_size=4)
    assert (one.micro_batches, two.micro_batches) == (1, 2)
    assert one.applied and two.applied

    # The summed shares are the full batch's mean NLL: transformers' own causal-LM loss says the same.
    batch = fixed_batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        hf_loss = plain(**batch, labels=labels).loss.item()
    assert one.loss == pytest.approx(hf_loss, abs=TIGHT)
    assert two.loss == pytest.approx(one.loss, abs=TIGHT)
    assert one.grad_norm > 0 and two.grad_norm == pytest.approx(one.grad_norm, abs=TIGHT)

    initial = dict(plain.named_parameters())
    assert weights_one.keys() == weights_two.keys() == initial.keys()
    assert "lm_head.weight" in weights_one and "model.layers.0.self_attn.q_proj.weight" in weights_one
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, atol=TIGHT, rtol=0, msg=name)
    moved = max((weights_one[n] - p.detach()).abs().max().item() for n, p in initial.items())
    assert moved > 0.5 * run_config(0, 1).learner.lr  # Adam's first step moves weights by about lr


def run_two_ranks(model_dir: Path, out_dir: Path) -> dict:
    run_ranks(
        "tests.helpers.engine_ranks", 2, str(model_dir), str(out_dir), "--zero-stage", "2", "--micro-batch-size", "2"
    )
    return json.loads((out_dir / "stats.json").read_text())


def test_two_ranks_match_one_rank(model_dir: Path, tmp_path: Path) -> None:
    ranks = run_two_ranks(model_dir, tmp_path / "ranks")
    one, weights_one = full_batch_step(model_dir, zero_stage=2, micro_batch_size=8)

    assert ranks["world_size"] == 2 and ranks["micro_batches"] == 2  # 4 rows per rank in micro-batches of 2
    assert ranks["loss"] == pytest.approx(one.loss, rel=RANKS_RTOL)
    assert ranks["grad_norm"] == pytest.approx(one.grad_norm, rel=RANKS_RTOL)
    weights_ranks = load_file(tmp_path / "ranks" / "weights.safetensors")
    assert weights_ranks.keys() == weights_one.keys()
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_ranks[name], tensor, atol=TIGHT, rtol=0, msg=name)


def test_the_engine_starts_without_compiling_the_shared_memory_collective(model_dir: Path) -> None:
    """DeepSpeed's CPU all-reduce op serves only tensor-parallel inference: a learner never builds or loads it."""
    import deepspeed.comm.comm as ds_comm

    engine_for(model_dir, zero_stage=0, micro_batch_size=8)
    assert ds_comm.cdb is not None and ds_comm.cdb.is_initialized()
    assert ds_comm.cdb.shm_comm_op is None
