"""Offline evaluation: the run's ``[eval]`` set on one vLLM engine in this process, scored by the run's reward
functions — the figures an in-run round records (``common/data/evaluation.py``), for a saved policy.

It lives with the actors because it runs vLLM, which the learner never imports (DESIGN.md's dependency rule): ``rl-actor
eval`` is the command; ``rl-learner eval`` resolves ``--checkpoint latest`` (the learner owns checkpoints) and runs
``rl-actor eval`` as a child process. The model is an HF folder, or a checkpoint's ``step-<N>`` folder, whose ``hf/``
export is loaded. No Redis, no weight group, no reward worker: the engine samples every eval group (its own temperature,
max_new_tokens and k, as an actor would) and :func:`asyncrl.common.rewards.functions.combine` scores it in this process,
without the reward worker's time limits (a user's function that hangs hangs this command).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.actors.workflows import WorkflowContext, check_workflow
from asyncrl.common.config import RunConfig
from asyncrl.common.data.evaluation import eval_examples, eval_groups, round_figures
from asyncrl.common.data.tasks import task_label
from asyncrl.common.environments.protocol import is_replayable, run_prompter
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.rewards.functions import bind_functions, combine, episode_options
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup, ScoredGroup

log = get_logger("eval")


def model_folder(path: str | Path) -> Path:
    """The HF folder of ``path``: itself, or a checkpoint's ``hf/`` (``ValueError`` when neither holds a model)."""
    path = Path(path)
    for folder in (path / "hf", path):
        if (folder / "config.json").is_file():
            return folder
    raise ValueError(
        f"{path}: neither an HF model folder (config.json) nor a checkpoint with an hf/ export "
        "(checkpoint.export_hf = true writes one)"
    )


def evaluate(config: RunConfig, model: str | Path, samples: Path | None = None) -> dict[str, Any]:
    """``eval/*`` of the ``[eval]`` set on the model at ``model`` (see :func:`model_folder`), plus ``model``; with
    ``samples``, every response is written there too (:func:`write_samples`)."""
    from transformers import AutoTokenizer

    from asyncrl.actors.engine import RolloutEngine

    check_scored_offline(config)
    folder = model_folder(model)
    # a LoRA run's checkpoint exports its adapters merged (hf/): the folder is the whole policy
    model_section = config.model.model_copy(update={"path": str(folder)})
    config = config.model_copy(update={"model": model_section, "lora": config.lora.model_copy(update={"rank": 0})})
    prompter = run_prompter(AutoTokenizer.from_pretrained(folder), config)
    groups = eval_groups(config, eval_examples(config, prompter), prompter.encode, step=0, version=0)
    started = time.perf_counter()
    engine = RolloutEngine(config, config.eval.seed)
    try:
        rollouts = asyncio.run(_sample(engine, groups, config))
    finally:
        engine.shutdown()
    functions = bind_functions(config.reward.functions, task_label(config.task), episode_options(config))
    scored = [ScoredGroup(rollout=r, rewards=np.asarray(combine(r, functions)[0], np.float32)) for r in rollouts]
    if samples is not None:
        write_samples(samples, scored)
    figures = {
        "eval/k": float(config.eval.num_samples),
        "eval/groups": float(len(scored)),
        "eval/seconds": time.perf_counter() - started,
        **round_figures(scored, config.eval.success_threshold),
    }
    for stamp in ("eval/policy_min", "eval/policy_max"):  # every token is stamped 0 here: the folder is the policy
        figures.pop(stamp, None)
    return {"model": str(folder), **figures}


def check_scored_offline(config: RunConfig) -> None:
    """``ValueError`` for a run whose episodes only its reward workers can score: an environment that cannot be
    replayed is scored from what they signed, and this command runs none."""
    name = config.environment.name
    if config.rollout.workflow == "multi_turn" and not is_replayable(name):
        raise ValueError(
            f"environment.name = {name!r} cannot be replayed (replayable = False): its episodes are scored from what "
            "the run's reward workers signed, and rl-actor eval runs none; evaluate it in the run (eval.every)"
        )


def write_samples(path: Path, scored: list[ScoredGroup]) -> None:
    """One JSON object per response, in the eval set's order: what the model answered to what, and its reward::

    {"group_id": "eval-0003-offline", "index": 0, "prompt": "3+4=", "answer": "7", "response": "7",
     "reward": 1.0, "finish_reason": "stop", "prompt_ids": [...], "response_ids": [...]}
    """
    with path.open("w") as out:
        for group in scored:
            rollout = group.rollout
            for i in range(rollout.num_samples):
                row = {
                    "group_id": rollout.group_id,
                    "index": i,
                    "prompt": rollout.prompt,
                    "answer": rollout.answer,
                    "response": rollout.texts[i] if i < len(rollout.texts) else "",
                    "reward": float(group.rewards[i]),
                    "finish_reason": rollout.finish_reasons[i] if i < len(rollout.finish_reasons) else "",
                    "prompt_ids": rollout.prompt_ids.tolist(),
                    "response_ids": rollout.response(i)[0].tolist(),
                }
                out.write(json.dumps(row) + "\n")


async def _sample(engine: Any, groups: list[PromptGroup], config: RunConfig) -> list[RolloutGroup]:
    """Every group at once (vLLM batches them) through the run's rollout workflow, each with the settings it
    carries."""
    workflow = check_workflow(config.rollout.workflow)
    turns = [WorkflowContext.of(config, "offline-eval", f"{g.group_id}-offline") for g in groups]
    return list(await asyncio.gather(*(workflow(engine, g, t) for g, t in zip(groups, turns, strict=True))))
