"""The critic on DeepSpeed (CPU, gloo): value alignment, save/load, the loss convention, and learning a fixed target.

Values follow the log-prob alignment (``values[b, t]`` = V of the state before token ``t`` = head of the hidden
state at ``t − 1``), which is checked against the plain model on each row without padding, and against a
left-padded copy of the batch. The clipped value loss, normalised with global counts, must fall on a fixed batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from asyncrl.common.config import RunConfig
from asyncrl.learner.algorithms import GlobalCounts
from asyncrl.learner.update.batch import split_micro_batches
from asyncrl.learner.update.critic import (
    VALUE_HEAD_FILE,
    ValueEngine,
    ValueModel,
    critic_learner_section,
    token_values,
    value_loss_fn,
)
from asyncrl.learner.update.step_metrics import MicroBatchMetrics
from tests.helpers.engine_ranks import LENGTHS, fixed_batch

pytestmark = pytest.mark.usefixtures("one_rank_world")

TIGHT = 1e-5
PROMPT = 3  # the first 3 tokens of every row are "prompt"; the rest are response tokens


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def critic_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved value model with a random (non-zero) head, so that alignment is visible in the values."""
    model = ValueModel.from_pretrained(model_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        nn.init.normal_(model.head.weight, std=0.5)
        nn.init.constant_(model.head.bias, 0.25)
    return model.save(tmp_path_factory.mktemp("critic") / "critic")


def config(model_dir: Path, **critic: object) -> RunConfig:
    return RunConfig.model_validate({"model": {"path": str(model_dir)}, "critic": critic})


def response_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask.bool().clone()
    mask[:, :PROMPT] = False
    return mask


def test_critic_settings_fall_back_to_the_learner() -> None:
    base = {"learner": {"zero_stage": 2, "precision": "bfloat16", "micro_batch_size": 16, "lr": 1e-6}}
    inherited = critic_learner_section(RunConfig.model_validate({**base, "critic": {"lr": 3e-5}}))
    assert (inherited.zero_stage, inherited.precision, inherited.micro_batch_size) == (2, "bfloat16", 16)
    assert inherited.lr == 3e-5
    own = critic_learner_section(RunConfig.model_validate({**base, "critic": {"zero_stage": 0, "micro_batch_size": 4}}))
    assert (own.zero_stage, own.precision, own.micro_batch_size, own.lr) == (0, "bfloat16", 4, 1e-5)


def test_a_policy_checkpoint_gives_a_zero_head_over_the_policy_backbone(model_dir: Path) -> None:
    model = ValueModel.from_pretrained(model_dir)
    assert torch.all(model.head.weight == 0) and torch.all(model.head.bias == 0)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy_weights = dict(policy.model.named_parameters())
    for name, param in model.backbone.named_parameters():
        torch.testing.assert_close(param, policy_weights[name], atol=0, rtol=0, msg=name)


def test_values_are_aligned_with_logprobs_and_ignore_padding(model_dir: Path, critic_dir: Path) -> None:
    assert (critic_dir / VALUE_HEAD_FILE).is_file()
    batch = fixed_batch()
    engine = ValueEngine(config(model_dir, path=str(critic_dir)), global_batch=len(LENGTHS))
    values = engine.values(**batch)
    assert values.shape == batch["input_ids"].shape and values.dtype == torch.float32 and values.requires_grad

    plain = ValueModel.from_pretrained(critic_dir).eval()
    for row, length in enumerate(LENGTHS):
        ids = batch["input_ids"][row : row + 1, :length]  # the row alone, without padding
        with torch.no_grad():
            scores = plain(input_ids=ids, attention_mask=torch.ones_like(ids))[0]
        # values[t] = head(h[t − 1]): the state before token t
        torch.testing.assert_close(values[row, 1:length].detach(), scores[: length - 1], atol=TIGHT, rtol=0)
    assert torch.all(values[:, 0] == 0)  # no state precedes the first token
    assert torch.all(values.detach()[batch["attention_mask"] == 0] == 0)  # padding holds 0
    assert values.detach().abs().max() > 0.1  # the head is not zero: the checks above saw real values

    # Left padding: the same rows shifted right give the same values at the same tokens.
    width = batch["input_ids"].shape[1]
    left = {key: torch.zeros_like(value) for key, value in batch.items()}
    for row, length in enumerate(LENGTHS):
        for key in batch:
            left[key][row, width - length :] = batch[key][row, :length]
    shifted = engine.values_no_grad(**left)
    assert not shifted.requires_grad
    for row, length in enumerate(LENGTHS):
        torch.testing.assert_close(
            shifted[row, width - length + 1 :], values[row, 1:length].detach(), atol=TIGHT, rtol=0
        )


def value_step_batch(engine: ValueEngine) -> dict[str, torch.Tensor]:
    """The fixed batch with V_old and returns: row r's response tokens all have return (−1)^r · (0.5 + r / 8)."""
    batch = fixed_batch()
    mask = response_mask(batch["attention_mask"])
    per_row = torch.tensor([(-1) ** r * (0.5 + r / 8) for r in range(len(LENGTHS))])
    returns = torch.where(mask, per_row[:, None].expand_as(mask), torch.zeros(()))
    old_values = engine.values_no_grad(**batch).cpu()
    return {**batch, "response_mask": mask, "returns": returns, "old_values": old_values}


def test_two_micro_batches_step_like_one(model_dir: Path) -> None:
    results = []
    for micro_batch_size in (8, 3):
        engine = ValueEngine(config(model_dir, lr=1e-3, micro_batch_size=micro_batch_size), global_batch=8)
        batch = value_step_batch(engine)
        counts = GlobalCounts.of(batch["response_mask"])
        stats = engine.train_step(split_micro_batches(batch, micro_batch_size), value_loss_fn(0.2, counts))
        results.append((stats, engine.values_no_grad(**fixed_batch())))
    (one, values_one), (three, values_three) = results
    assert (one.micro_batches, three.micro_batches) == (1, 3)
    # V ≡ 0 at the start (zero head): the loss is the mean of ½R² over response tokens
    batch = value_step_batch(engine)
    expected = (0.5 * batch["returns"][batch["response_mask"]] ** 2).mean().item()
    assert one.loss == pytest.approx(expected, abs=TIGHT) and three.loss == pytest.approx(one.loss, abs=TIGHT)
    assert one.grad_norm > 0 and three.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
    torch.testing.assert_close(values_three, values_one, atol=TIGHT, rtol=0)


def test_value_loss_falls_on_a_fixed_batch(model_dir: Path, tmp_path: Path) -> None:
    engine = ValueEngine(config(model_dir, lr=3e-3, micro_batch_size=4, value_clip=0.2), global_batch=8)
    losses, clip_fracs = [], []
    for _ in range(20):
        batch = value_step_batch(engine)  # V_old recomputed at the start of every step, as PPO does
        metrics = MicroBatchMetrics()
        counts = GlobalCounts.of(batch["response_mask"])
        stats = engine.train_step(split_micro_batches(batch, 4), value_loss_fn(0.2, counts, metrics))
        losses.append(stats.loss)
        clip_fracs.append(metrics.figures()["value/clip_frac"])
    print(f"value loss {losses[0]:.4f} -> {losses[-1]:.4f}; clip fraction first {clip_fracs[0]:.2f}")
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.2 * losses[0]
    assert sum(losses[-3:]) < sum(losses[:3])

    # The trained critic saves as a value-model folder and loads back with the same values.
    folder = engine.save(tmp_path / "trained")
    assert folder is not None and (folder / VALUE_HEAD_FILE).is_file()
    reloaded = ValueModel.from_pretrained(folder).eval()
    with torch.no_grad():
        again = token_values(reloaded, **fixed_batch())
    torch.testing.assert_close(again, engine.values_no_grad(**fixed_batch()), atol=TIGHT, rtol=0)


def test_a_lora_critic_trains_its_adapters_and_value_head_only_and_saves_them_merged(
    model_dir: Path, tmp_path: Path
) -> None:
    """``[lora]`` puts adapters on the critic's backbone too: only they and the value head train, the value loss
    falls, and the saved value-model folder (adapters merged into the backbone) gives the engine's values."""
    settings = {"model": {"path": str(model_dir)}, "critic": {"lr": 3e-3, "micro_batch_size": 4}, "lora": {"rank": 4}}
    engine = ValueEngine(RunConfig.model_validate(settings), global_batch=8)
    trainable = [name for name, p in engine.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in name or name.startswith("head.") for name in trainable), trainable
    assert {"head.weight", "head.bias"} <= set(trainable)
    losses = []
    for _ in range(12):
        batch = value_step_batch(engine)
        loss = value_loss_fn(0.2, GlobalCounts.of(batch["response_mask"]))
        stats = engine.train_step(split_micro_batches(batch, 4), loss)
        losses.append(stats.loss)
    assert losses[-1] < 0.5 * losses[0], losses
    folder = engine.save(tmp_path / "lora-critic")
    reloaded = ValueModel.from_pretrained(folder).eval()
    assert not any(".lora_" in name for name, _ in reloaded.named_parameters())  # a plain value model
    with torch.no_grad():
        again = token_values(reloaded, **fixed_batch())
    torch.testing.assert_close(again, engine.values_no_grad(**fixed_batch()), atol=1e-5, rtol=0)
