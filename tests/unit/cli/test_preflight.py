"""The run checked against its model folder before anything starts: ``model.max_model_len`` within the model's
context, read from ``config.json`` as vLLM reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.cli.preflight import (
    HALF_PRECISION_FLAGS,
    check_model_context,
    cpu_flags,
    missing_model_folder,
    model_context,
    slow_precision,
)
from asyncrl.common.config import load_config


def folder_with(tmp_path: Path, config_json: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    return tmp_path


def test_the_smallest_length_key_bounds_the_context() -> None:
    assert model_context({"max_position_embeddings": 512}) == (512, "max_position_embeddings")
    assert model_context({"n_positions": 1024, "seq_length": 256}) == (256, "seq_length")
    assert model_context({"text_config": {"max_position_embeddings": 128}}) == (128, "max_position_embeddings")
    assert model_context({"hidden_size": 64}) is None


def test_stretching_rope_scaling_multiplies_the_context_and_llama3_does_not() -> None:
    yarn = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert model_context(yarn) == (16384, "max_position_embeddings x rope_scaling.factor")
    llama3 = {"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert model_context(llama3) == (8192, "max_position_embeddings")


def test_a_max_model_len_beyond_the_context_is_refused_naming_the_setting_and_the_fix(tmp_path: Path) -> None:
    model = folder_with(tmp_path, {"max_position_embeddings": 512})
    too_long = load_config(None, [f"model.path={model}", "model.max_model_len=1024"])
    with pytest.raises(ValueError, match=r"model.max_model_len = 1024 .* context of 512 .* at most 512"):
        check_model_context(too_long)
    check_model_context(load_config(None, [f"model.path={model}", "model.max_model_len=512"]))


def test_a_path_without_a_readable_config_is_left_to_the_engine(tmp_path: Path) -> None:
    check_model_context(load_config(None, ["model.path=org/model-on-a-hub", "model.max_model_len=4096"]))
    (tmp_path / "config.json").write_text("{not json")
    check_model_context(load_config(None, [f"model.path={tmp_path}", "model.max_model_len=4096"]))


@pytest.mark.parametrize("path", ["runs/models/tiny-arith", "/no/such/model", "./model", "../model", "~/model"])
def test_a_local_path_that_names_no_folder_is_refused_naming_init_model(
    path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths name nothing here, even in a checkout where bin/demo made the model
    refusal = missing_model_folder(path)
    assert refusal is not None and refusal.startswith(f"model.path: {path} is not a folder")
    assert "rl-learner init-model CONFIG" in refusal


@pytest.mark.parametrize("path", ["gpt2", "Qwen/Qwen2.5-0.5B-Instruct"])
def test_a_repo_id_or_a_folder_is_left_to_the_loaders(path: str, tmp_path: Path) -> None:
    assert missing_model_folder(path) is None
    assert missing_model_folder(str(tmp_path)) is None


AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n" * 2
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16 avx512_fp16\n"


def test_a_half_precision_the_cpu_cannot_compute_is_warned_about_naming_the_setting_and_the_fix() -> None:
    bf16 = load_config(None, ["learner.precision=bfloat16"])
    warning = slow_precision(bf16, AVX2_ONLY)
    assert warning is not None and warning.startswith("learner.precision = 'bfloat16' on a CPU without bfloat16")
    assert "avx512_bf16 or amx_bf16" in warning and "set learner.precision = 'float32'" in warning
    assert slow_precision(bf16, SAPPHIRE_RAPIDS) is None
    assert slow_precision(load_config(None, []), AVX2_ONLY) is None  # float32: nothing to say
    reference = load_config(None, ["learner.reference_precision=float16"])
    assert "learner.reference_precision = 'float16'" in (slow_precision(reference, AVX2_ONLY) or "")
    assert slow_precision(bf16, "") is None  # no flags to read (not Linux): nothing claimed


def test_the_flags_read_agree_with_what_torch_finds_on_this_machine() -> None:
    import torch

    native = bool(cpu_flags() & set(HALF_PRECISION_FLAGS["bfloat16"]))
    assert native == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()), cpu_flags()
