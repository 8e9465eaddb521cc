"""The learner's policy with ``[lora]`` adapters (PEFT inside DeepSpeed, on CPU): only the adapters train, the
reference is the base model exactly, the broadcast carries the adapters alone, and what a checkpoint exports (the
adapter folder, the merged HF folder) computes what the engine computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.cli.preflight import check_adapters
from asyncrl.common.config import RunConfig
from asyncrl.learner.checkpoint.checkpointer import export_adapter, export_hf
from asyncrl.learner.update.batch import split_micro_batches
from asyncrl.learner.update.engine import PolicyEngine, ReferenceModel, reference_for, sequence_logprobs
from asyncrl.learner.update.lora import AdapterOffReference
from tests.helpers.engine_ranks import LEARNING_RATE, LENGTHS, fixed_batch, nll_loss, predicted_tokens

pytestmark = pytest.mark.usefixtures("one_rank_world")

RANK = 4
EXACT = 1e-6  # the same forward with the adapters left out
MERGED = 1e-5  # W + s·BA summed once against x·Wᵀ + s·(x·Aᵀ)·Bᵀ in the forward


def lora_config(model_dir: Path, zero_stage: int = 0, **lora) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "learner": {"zero_stage": zero_stage, "micro_batch_size": 4, "lr": LEARNING_RATE},
            "lora": {"rank": RANK, "alpha": 8.0, **lora},
        }
    )


def trained(config: RunConfig, steps: int = 2) -> PolicyEngine:
    """An engine after ``steps`` updates on :func:`fixed_batch`: its adapters' B is no longer zero."""
    engine = PolicyEngine(config, global_batch=len(LENGTHS))
    batch = fixed_batch()
    for _ in range(steps):
        engine.train_step(split_micro_batches(batch, 4), nll_loss(predicted_tokens(batch["attention_mask"])))
    return engine


@pytest.fixture(scope="module", params=[0, 3], ids=["zero0", "zero3"])
def engine(request, tiny_model_dir: Path) -> PolicyEngine:
    return trained(lora_config(tiny_model_dir, request.param))


def adapter_numel(engine: PolicyEngine) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) for n, p in engine.module.named_parameters() if "lora_" in n)


def test_only_the_adapters_train_and_the_base_weights_stay(engine: PolicyEngine, tiny_model_dir: Path) -> None:
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    groups = engine.engine.optimizer.param_groups
    in_optimizer = sum(getattr(p, "ds_numel", p.numel()) for group in groups for p in group["params"])
    total = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    assert in_optimizer <= adapter_numel(engine) < total / 4  # ZeRO-3 flattens: its groups hold one partition
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    merged = engine.full_state_dict(torch.float32)
    moved = [name for name, w in base.state_dict().items() if name in merged and not torch.equal(merged[name], w)]
    # only the adapted layers changed, and only through B·A (the embedding, norms and head are the base's)
    assert moved and all(name.rsplit(".", 2)[-2].endswith("proj") for name in moved), moved


def test_the_reference_with_the_adapters_off_is_the_base_model(engine: PolicyEngine, tiny_model_dir: Path) -> None:
    batch = fixed_batch(seed=1)
    reference = reference_for(engine)
    assert isinstance(reference, AdapterOffReference)  # no second model
    base = ReferenceModel(tiny_model_dir, "float32").token_logprobs(**batch)
    got = reference.token_logprobs(**batch)
    assert torch.allclose(got, base, atol=EXACT, rtol=0), (got - base).abs().max()
    policy = engine.token_logprobs_no_grad(**batch)
    assert (policy - base).abs().max() > 1e-3  # the adapters did move the policy: the check above means something


def test_the_broadcast_carries_the_adapters_alone_named_as_a_saved_adapter(engine: PolicyEngine) -> None:
    sent = engine.state_dict_for_broadcast(torch.float32)
    assert sent and all(n.startswith("base_model.model.model.layers.") for n in sent), list(sent)[:3]
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) and ".default." not in n for n in sent)
    assert sum(t.numel() for t in sent.values()) == adapter_numel(engine)


def test_the_exported_adapter_and_merged_folder_compute_the_engines_log_probs(
    engine: PolicyEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    batch = fixed_batch(seed=2)
    want = engine.token_logprobs_no_grad(**batch)
    export_adapter(engine.module, engine.state_dict_for_broadcast(torch.float32), tmp_path / "adapter")
    export_hf(engine.module, engine.full_state_dict(torch.float32), None, tmp_path / "hf")

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    for model, tolerance in ((with_adapter, EXACT), (merged, MERGED)):
        with torch.no_grad():
            got = sequence_logprobs(model, **batch)
        assert torch.allclose(got, want, atol=tolerance, rtol=0), (type(model).__name__, (got - want).abs().max())


def test_unknown_or_head_targets_are_refused_naming_the_field(tiny_model_dir: Path) -> None:
    check_adapters(lora_config(tiny_model_dir, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"lora.target_modules: 'qkv' .*no such linear layer.*down_proj"):
        check_adapters(lora_config(tiny_model_dir, target_modules=["q_proj", "qkv"]))
    with pytest.raises(ValueError, match=r"lora.target_modules: 'lm_head' .*output head"):
        check_adapters(lora_config(tiny_model_dir, target_modules=["lm_head"]))
