"""Low-rank adapters on the learner's policy (``[lora]``), with PEFT.

A targeted linear layer computes ``W x + s · B A x`` with ``s = alpha / rank`` (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", eq. 3): ``W`` stays frozen, ``A`` (``rank × in``, random) and ``B``
(``out × rank``, zero at the start) train. So the optimizer holds state for the adapters only, and the reference
policy needs no second model: it is the same module with the adapters switched off (:class:`AdapterOffReference`),
which computes exactly ``W x``.

Names. PEFT wraps the model (``base_model.model.`` in front of every name) and names each adapter tensor after the
adapter (``….q_proj.lora_A.default.weight``); a saved adapter, and vLLM, spell it without the adapter's name
(``….q_proj.lora_A.weight``, :func:`saved_name`). The frozen weight of a targeted layer moves to
``….q_proj.base_layer.weight``; :func:`merged_weights` gives the HF names and ``W + s · B A`` back.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from asyncrl.common.config.training import LoraSection

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from transformers import PreTrainedModel

ADAPTER = "default"
"""PEFT's name for the one adapter the policy has."""
PEFT_PREFIX = "base_model.model."


def add_adapters(model: torch.nn.Module, lora: LoraSection, task_type: str | None = "CAUSAL_LM") -> torch.nn.Module:
    """``model`` wrapped by PEFT with ``lora``'s adapters (every other parameter frozen); ``task_type = None`` for a
    transformer without its LM head (the critic's backbone)."""
    from peft import LoraConfig, get_peft_model

    settings = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # pyright: ignore[reportArgumentType]  # PEFT annotates int, uses it in alpha / r
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
        task_type=task_type,
    )
    return get_peft_model(model, settings)


def base_model_reference(path: str | None) -> str | None:
    """``model.path`` as a saved adapter names its base (``base_model_name_or_path``): a local folder as an absolute
    path, since PEFT reads a relative one from the working directory of whoever loads the adapter; a hub name (no
    such folder) as it is."""
    return os.path.abspath(path) if path and os.path.isdir(path) else path


def saved_name(name: str) -> str:
    """A PEFT parameter's name as a saved adapter (``adapter_model.safetensors``) and vLLM spell it."""
    return name.replace(f".{ADAPTER}.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_tensors(named: Iterator[tuple[str, Tensor]], dtype: torch.dtype) -> dict[str, Tensor]:
    """The adapter tensors of ``named`` (a PEFT model's parameters), detached, in ``dtype``, by :func:`saved_name`."""
    return {saved_name(name): p.detach().to(dtype) for name, p in named if is_adapter(name)}


def merged_weights(params: Mapping[str, Tensor], scale: float) -> dict[str, Tensor]:
    """The full model's weights under their HF names, each targeted layer merged: ``W' = W + scale · B A``.

    ``params`` are a PEFT model's parameters (:func:`saved_name` or PEFT's own names both work); ``scale`` is
    ``alpha / rank``. transformers and vLLM load the result as a plain checkpoint of the base architecture."""
    adapters = {saved_name(name): value for name, value in params.items() if is_adapter(name)}
    merged: dict[str, Tensor] = {}
    for name, value in params.items():
        name = saved_name(name)
        if is_adapter(name):
            continue
        layer = name.removesuffix(".base_layer.weight")
        if layer != name:  # a targeted layer's frozen W
            a, b = adapters[f"{layer}.lora_A.weight"], adapters[f"{layer}.lora_B.weight"]
            value = value + (scale * (b.to(torch.float32) @ a.to(torch.float32))).to(value.dtype)
        merged[name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")] = value
    return merged


def save_pretrained_merged(model: torch.nn.Module, folder: str | Path) -> None:
    """``save_pretrained`` of ``model`` as a plain model of its base architecture: a PEFT model's targeted layers
    merged (:func:`merged_weights`, ``scale`` from the adapter's own settings), without a second copy of the model.
    Whole parameters only (not ZeRO-3 partitions)."""
    if not hasattr(model, "peft_config"):  # a Hugging Face model as it is
        cast("PreTrainedModel", model).save_pretrained(folder, safe_serialization=True)
        return
    peft_model = cast("PeftModel", model)
    settings = cast("LoraConfig", peft_model.peft_config[ADAPTER])  # add_adapters' one adapter
    merged = merged_weights(peft_model.state_dict(), settings.lora_alpha / settings.r)
    base = cast("PreTrainedModel", peft_model.get_base_model())
    base.save_pretrained(folder, state_dict=merged, safe_serialization=True)


class AdapterOffReference:
    """The reference policy of a LoRA run: the policy's own module with its adapters switched off, no gradients.

    Its log-probs are the base model's, exactly (``B A`` is left out, not multiplied by zero), and it costs no memory
    beyond the policy's. Collective under ZeRO-3, like the policy's own forward: every rank calls it in the same order.
    ``policy`` is the :class:`asyncrl.learner.update.engine.PolicyEngine` whose module holds the adapters.
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def token_logprobs(self, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0) -> Tensor:
        """``[B, T]`` log π_ref(x_t | x_<t); see :func:`asyncrl.learner.update.engine.sequence_logprobs`."""
        with self.policy.module.disable_adapter():  # PEFT's own switch: the base layers alone compute
            return self.policy.token_logprobs_no_grad(input_ids, attention_mask, temperature)
