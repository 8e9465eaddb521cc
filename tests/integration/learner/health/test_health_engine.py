"""The non-finite guard on a real DeepSpeed :class:`PolicyEngine` (CPU, one rank): a step with a NaN loss or a NaN
gradient leaves weights, Adam state and lr schedule untouched, so the next finite step equals a fresh engine's first
step; and :func:`asyncrl.learner.health.monitor.scale_lr_schedule` scales the lr DeepSpeed applies.

ZeRO 0 in float32 is the set-up where ``train_step`` skips the step itself; ZeRO 2 is one where DeepSpeed's own
overflow check does it. Warm-up is 2 steps, so a skipped step that advanced the schedule would show in the lr.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from asyncrl.common.config import RunConfig
from asyncrl.learner.health.monitor import scale_lr_schedule
from asyncrl.learner.update.batch import split_micro_batches
from asyncrl.learner.update.engine import Batch, LossFn, PolicyEngine
from tests.helpers.engine_ranks import LEARNING_RATE, LENGTHS, fixed_batch, nll_loss, predicted_tokens

pytestmark = pytest.mark.usefixtures("one_rank_world")

TIGHT = 1e-6  # same process, same maths, same order
WARMUP = 2


def engine_for(model_dir: Path, zero_stage: int) -> PolicyEngine:
    learner = {"zero_stage": zero_stage, "micro_batch_size": 4, "lr": LEARNING_RATE, "warmup_steps": WARMUP}
    return PolicyEngine(RunConfig.model_validate({"learner": learner}), str(model_dir), global_batch=len(LENGTHS))


def weights(engine: PolicyEngine) -> dict[str, Tensor]:
    return {name: tensor.clone() for name, tensor in engine.state_dict_for_broadcast(torch.float32).items()}


def nan_loss(loss: LossFn) -> LossFn:
    """The loss times NaN: a non-finite loss and, through backward, non-finite gradients."""
    return lambda engine, micro_batch: loss(engine, micro_batch) * float("nan")


def nan_gradient(loss: LossFn) -> LossFn:
    """A finite loss whose gradient is NaN (a hook on the log-probs), as a bad kernel or an overflow would give."""

    def poisoned(engine: PolicyEngine, micro_batch: Batch) -> Tensor:
        logprobs = engine.token_logprobs(micro_batch["input_ids"], micro_batch["attention_mask"])
        logprobs.register_hook(lambda grad: grad * float("nan"))
        return -logprobs.sum() / predicted_tokens(fixed_batch()["attention_mask"])

    return poisoned


def assert_same(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=TIGHT, rtol=0, msg=name)


@pytest.mark.parametrize("zero_stage", [0, 2])
@pytest.mark.parametrize("poison", [nan_loss, nan_gradient], ids=["nan_loss", "nan_gradient"])
def test_a_non_finite_step_is_skipped_and_the_next_trains_normally(
    tiny_model_dir: Path, zero_stage: int, poison
) -> None:
    batch = fixed_batch()
    micro = split_micro_batches(batch, 4)
    loss = nll_loss(predicted_tokens(batch["attention_mask"]))

    fresh = engine_for(tiny_model_dir, zero_stage)
    reference = fresh.train_step(micro, loss)  # the first step of an engine that never saw a bad one
    reference_weights = weights(fresh)

    engine = engine_for(tiny_model_dir, zero_stage)
    initial = weights(engine)
    bad = engine.train_step(micro, poison(loss))
    assert not bad.applied
    assert_same(weights(engine), initial)  # not one weight moved, none became NaN

    good = engine.train_step(micro, loss)
    assert good.applied and reference.applied
    assert good.lr == reference.lr == pytest.approx(LEARNING_RATE / WARMUP)  # the schedule did not advance
    assert good.loss == pytest.approx(reference.loss, abs=TIGHT)
    assert good.grad_norm == pytest.approx(reference.grad_norm, rel=1e-5)
    assert_same(weights(engine), reference_weights)  # Adam's state was untouched by the skipped step


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_scale_lr_schedule_scales_the_lr_deepspeed_applies(tiny_model_dir: Path, zero_stage: int) -> None:
    batch = fixed_batch()
    micro = split_micro_batches(batch, 4)
    loss = nll_loss(predicted_tokens(batch["attention_mask"]))
    engine = engine_for(tiny_model_dir, zero_stage)
    scale_lr_schedule(engine.engine.lr_scheduler, [LEARNING_RATE], 0.5)
    assert engine.engine.get_lr()[0] == pytest.approx(0.5 * LEARNING_RATE / WARMUP)
    initial = weights(engine)
    lrs = [engine.train_step(micro, loss).lr for _ in range(3)]
    assert lrs == pytest.approx([0.25 * LEARNING_RATE, 0.5 * LEARNING_RATE, 0.5 * LEARNING_RATE])
    moved = max((weights(engine)[name] - tensor).abs().max().item() for name, tensor in initial.items())
    assert moved < 3 * 0.5 * LEARNING_RATE * 1.05  # Adam moves each weight by about the lr per step, at most
