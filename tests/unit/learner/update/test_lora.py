"""``[lora]`` without an engine: the settings' checks, the names adapters travel under, the merge formula, and what
the actors' engine is asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.actors.engine import VLLM_LORA_RANKS, adapter_settings, lora_engine_settings
from asyncrl.common.config import ConfigError, load_config
from asyncrl.learner.update.lora import ADAPTER, adapter_tensors, merged_weights, saved_name


def test_lora_is_off_by_default_and_its_fields_are_checked() -> None:
    assert not load_config(None, []).lora.enabled
    assert load_config(None, ["lora.rank=8"]).lora.enabled
    with pytest.raises(ConfigError, match=r"lora.dropout: .*without dropout.*set lora.dropout = 0"):
        load_config(None, ["lora.rank=8", "lora.dropout=0.05"])
    with pytest.raises(ConfigError, match=r"lora.rank: .*less than or equal to 512"):
        load_config(None, ["lora.rank=1024"])
    assert load_config(None, ['lora.target_modules=["q_proj", "v_proj"]']).lora.target_modules == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match=r"learner.reference_precision = 'bfloat16' with \[lora\]: .*remove"):
        load_config(None, ["lora.rank=8", "learner.reference_precision=bfloat16"])


def test_adapters_travel_under_the_names_a_saved_peft_adapter_has() -> None:
    peft = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert saved_name(peft) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    frozen = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    named = [(peft, torch.ones(2, 3)), (frozen, torch.ones(3, 3))]
    sent = adapter_tensors(iter(named), torch.bfloat16)
    assert list(sent) == [saved_name(peft)] and sent[saved_name(peft)].dtype == torch.bfloat16


def test_a_merged_layer_is_w_plus_scale_times_b_a_and_the_rest_keep_their_hf_names() -> None:
    generator = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(shape, generator=generator) for shape in ((6, 5), (2, 5), (6, 2)))
    layer = "base_model.model.model.layers.0.mlp.down_proj"
    params = {
        f"{layer}.base_layer.weight": w,
        f"{layer}.lora_A.default.weight": a,
        f"{layer}.lora_B.default.weight": b,
        "base_model.model.model.norm.weight": torch.ones(5),
        "base_model.model.lm_head.weight": torch.zeros(7, 5),
    }
    merged = merged_weights(params, scale=4.0)
    assert set(merged) == {"model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"}
    torch.testing.assert_close(merged["model.layers.0.mlp.down_proj.weight"], w + 4.0 * b @ a)
    x = torch.randn(3, 5, generator=generator)  # the merged layer computes what the adapted one does
    torch.testing.assert_close(x @ merged["model.layers.0.mlp.down_proj.weight"].T, x @ w.T + 4.0 * (x @ a.T) @ b.T)


@pytest.mark.parametrize(("rank", "served"), [(1, 1), (4, 8), (8, 8), (9, 16), (300, 320), (512, 512)])
def test_the_engine_gets_one_adapter_slot_of_the_smallest_rank_vllm_offers(rank: int, served: int) -> None:
    config = load_config(None, [f"lora.rank={rank}", "lora.alpha=32"])
    one_slot = {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1}
    assert lora_engine_settings(config) == {**one_slot, "max_lora_rank": served}
    assert served in VLLM_LORA_RANKS
    assert adapter_settings(config) == {"r": rank, "lora_alpha": 32.0, "target_modules": "all-linear", "bias": "none"}
    assert lora_engine_settings(load_config(None, [])) == {}


@pytest.mark.parametrize("local", [True, False])
def test_the_exported_adapter_names_a_local_base_model_by_its_absolute_path(
    local: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """adapter_config.json's base_model_name_or_path: model.path made absolute when it is a local folder (PEFT loads
    a relative one only from the run's working directory), a hub name as it is; the policy's own settings unchanged."""
    from peft import LoraConfig

    from asyncrl.learner.checkpoint.checkpointer import export_adapter

    monkeypatch.chdir(tmp_path)
    if local:
        (tmp_path / "models" / "tiny").mkdir(parents=True)
    given = "models/tiny" if local else "Qwen/Qwen2.5-0.5B-Instruct"
    module = torch.nn.Module()
    module.peft_config = {ADAPTER: LoraConfig(r=4, target_modules=["q_proj"], base_model_name_or_path=given)}
    export_adapter(module, {"a.lora_A.weight": torch.zeros(4, 2)}, tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    if local:
        assert Path(written).is_absolute() and Path(written).resolve() == (tmp_path / "models" / "tiny").resolve()
    else:
        assert written == given
    assert module.peft_config[ADAPTER].base_model_name_or_path == given
