"""Checks of a run's config made before any process starts: :func:`check_config`, which every ``rl-learner`` and
``rl-launch`` command runs, and the config against its model folder.

This module imports no torch, transformers or vLLM itself, so a config the schema refuses (a typo, a bad value) is
answered at once; the checks that need the algorithm registries import them when they run.

The model's context: vLLM refuses ``max_model_len`` above the length it derives from the model's ``config.json``, but
only when an actor builds its engine, after the learner and the other processes have started. Read here the way vLLM
derives it (``vllm/config/model.py``, ``_get_and_verify_max_len``): the smallest of the length keys the config has,
times the RoPE scaling factor for the scaling types that stretch the context.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.common.config import RunConfig

LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
"""Keys of a model's ``config.json`` that bound its context, as vLLM reads them (the smallest present wins)."""
STRETCHING_ROPE = {"linear", "dynamic", "yarn"}
"""RoPE scaling types whose ``factor`` multiplies the positions the model takes (vLLM scales by it for these)."""


def model_context(config_json: dict) -> tuple[int, str] | None:
    """The longest sequence the model takes and the key it came from, or None when the config names none."""
    text = config_json.get("text_config") or config_json  # multimodal configs nest the language model's
    found = [(int(text[key]), key) for key in LENGTH_KEYS if isinstance(text.get(key), int) and text[key] > 0]
    if not found:
        return None
    length, key = min(found)
    scaling = text.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in STRETCHING_ROPE and isinstance(scaling.get("factor"), int | float):
        return int(length * scaling["factor"]), f"{key} x rope_scaling.factor"
    return length, key


def missing_model_folder(path: str) -> str | None:
    """The refusal of a ``model.path`` that names no folder on this host and cannot be a Hugging Face repo id
    (``name`` or ``namespace/name``: at most one slash, no leading ``/``, ``.`` or ``~``), which the engine and the
    learner would otherwise try to fetch minutes into the run; None for a folder here or a repo id."""
    if Path(path).is_dir():
        return None
    if not (path.startswith(("/", ".", "~")) or path.count("/") > 1):
        return None  # a repo id: the model loaders fetch it (or say why they cannot)
    return (
        f"model.path: {path} is not a folder on this host (nor a Hugging Face repo id, which is namespace/name); "
        "point model.path at the model's folder, or make a tiny one there with rl-learner init-model CONFIG"
    )


HALF_PRECISION_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}
"""The CPU instructions (``/proc/cpuinfo`` flags) that compute each half precision natively. Without any of them
PyTorch's half-precision matrix products are far slower: measured on an AVX2-only EPYC, the forward and backward of a
151,936 × 896 LM head over 64 tokens took 66 s in bfloat16 against 0.9 s in float32."""


def slow_precision(config: RunConfig, cpuinfo: str | None = None) -> str | None:
    """The warning for a learner that would train in a half precision this host's CPU has no instructions for (and no
    NVIDIA GPU to train on instead), or None. ``cpuinfo``: the text of ``/proc/cpuinfo`` (read when None)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return None  # the learner trains on the GPU
    flags = cpu_flags(cpuinfo)
    settings = {
        "learner.precision": config.learner.precision,
        "learner.reference_precision": config.learner.reference_precision,
        "critic.precision": config.critic.precision,
    }
    for setting, precision in settings.items():
        wanted = HALF_PRECISION_FLAGS.get(precision or "")
        if wanted and flags and not flags.intersection(wanted):
            return (
                f"{setting} = {precision!r} on a CPU without {precision} instructions ({' or '.join(wanted)}): its "
                f"matrix products run tens of times slower than in float32 (a step can take many minutes); set "
                f"{setting} = 'float32' on this host, or train on a GPU"
            )
    return None


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's instruction-set flags from ``/proc/cpuinfo`` (its text when given); empty where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    lines = [line.split(":", 1)[1] for line in cpuinfo.splitlines() if line.startswith("flags") and ":" in line]
    return {flag for line in lines for flag in line.split()}


def check_model_context(config: RunConfig) -> int | None:
    """``model.max_model_len`` within the context of the model folder; raises ``ValueError`` naming the setting and
    the fix. Returns the context (None where unknown): a path that is not a local folder with a ``config.json`` is
    left to the engine to check."""
    path = Path(config.model.path) / "config.json"
    if not path.is_file():
        return None
    try:
        found = model_context(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None  # an unreadable config is the model loader's to report, with its own message
    if found is None:
        return None
    length, key = found
    if config.model.max_model_len > length:
        raise ValueError(
            f"model.max_model_len = {config.model.max_model_len} is longer than the model's context of {length} "
            f"tokens ({key} in {path}); set model.max_model_len to at most {length}"
        )
    return length


def check_config(config: RunConfig) -> None:
    """What every ``rl-learner`` command checks before it starts anything: the algorithm's names and options
    (:func:`asyncrl.learner.algorithms.assembly.assemble`), the task's
    (:func:`asyncrl.learner.intake.dispatcher.check_task`) and a built-in eval task's (:func:`check_eval_options`), the
    reward functions' names (an import path must name a reward function) and the verifier of each ``task`` function with
    its options (``common/rewards/functions.py: check_names, check_options``), the rollout workflow's name
    (``actors/workflows.py``), and ``model.max_model_len`` against the model folder's context
    (:func:`check_model_context`). Raises ``ValueError``."""
    from asyncrl.actors.workflows import check_workflow_name
    from asyncrl.common.data.tasks import task_label
    from asyncrl.common.rewards.functions import check_names, check_options
    from asyncrl.learner.algorithms.assembly import assemble
    from asyncrl.learner.intake.dispatcher import check_task

    assemble(config)
    check_task(config.task)
    check_eval_options(config)
    check_workflow_name(config.rollout.workflow)
    check_names(config.reward.functions)
    check_options(config.reward.functions, task_label(config.task))
    check_model_context(config)
    check_episodes(config)
    check_adapters(config)


def check_eval_options(config: RunConfig) -> None:
    """A built-in eval task's ``eval.options``, checked as ``task.options`` are
    (:func:`asyncrl.common.data.tasks.check_task_options`); ``ValueError`` naming the setting otherwise."""
    from asyncrl.common.data.tasks import check_task_options

    section = config.eval
    if not section.every or section.name == "file":
        return
    try:
        check_task_options(section.name, dict(section.options))
    except ValueError as exc:
        raise ValueError(f"eval.options: {exc}") from None


def check_episodes(config: RunConfig) -> None:
    """A ``multi_turn`` run's environment resolves, one that cannot be replayed runs on the reward workers, and the
    model's chat template can carry its episodes (:class:`asyncrl.common.environments.turns.TurnEncoder`), as
    appended tokens or per turn; ``ValueError`` naming the setting otherwise."""
    if config.rollout.workflow != "multi_turn":
        return
    from asyncrl.common.environments.protocol import ENVIRONMENTS, is_replayable
    from asyncrl.common.environments.turns import TemplateError, episode_tools

    section = config.environment
    ENVIRONMENTS.get(section.name, "environment.name")
    if section.isolation != "workers" and not is_replayable(section.name):
        # Only a reward worker's signature vouches for what such an environment said: no replay can check it.
        raise ValueError(
            f"environment.isolation = {section.isolation!r}: environment {section.name!r} cannot be replayed "
            "(replayable = False), so only the run's reward workers may run it; set environment.isolation = 'workers'"
        )
    if not (Path(config.model.path) / "tokenizer_config.json").exists():
        return  # no model folder yet (init-model makes it): the actors check the template when they load it

    try:
        tools = episode_tools(config.model.path, section.past_reasoning)
    except TemplateError as exc:
        raise ValueError(f"model.path: {exc}") from None
    if tools.per_turn:
        check_per_turn_algorithm(config)


def check_per_turn_algorithm(config: RunConfig) -> None:
    """Episodes kept per turn (a template that drops past reasoning, run as served) train only with algorithms whose
    every input is per token or per episode reward; ``ValueError`` naming what the algorithm needs otherwise."""
    from asyncrl.learner.algorithms.assembly import assemble
    from asyncrl.learner.algorithms.types import per_turn_refusal

    if refusal := per_turn_refusal(assemble(config).needs):
        raise ValueError(refusal)


def adapter_targets(model_path: str) -> tuple[set[str], str]:
    """The names a ``[lora]`` target may take in the model at ``model_path`` — the last part of the name of each
    linear layer inside its transformer blocks — and the output head's, which never takes an adapter. The model is
    built on the meta device from its ``config.json``: no weight is read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    head = model.get_output_embeddings()
    linear = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    head_name = next((name for name, module in model.named_modules() if module is head), "lm_head")
    return linear, head_name


def check_adapters(config: RunConfig) -> None:
    """A ``[lora]`` run's ``target_modules`` name linear layers of the model's transformer blocks (the layers PEFT
    adapts and vLLM serves adapters for); ``ValueError`` naming the field otherwise. A run without adapters, or
    without a model folder yet, is not checked."""
    lora = config.lora
    if not lora.enabled or not (Path(config.model.path) / "config.json").is_file():
        return
    if lora.target_modules == "all-linear":
        return
    linear, head = adapter_targets(config.model.path)
    unknown = [name for name in lora.target_modules if name not in linear]
    if unknown:
        why = f"{head!r} is the output head, which takes no adapter" if head in unknown else "no such linear layer"
        raise ValueError(
            f"lora.target_modules: {', '.join(map(repr, unknown))} in {config.model.path}: {why}; the model's "
            f'linear layers are {", ".join(sorted(linear))} (or set "all-linear")'
        )
