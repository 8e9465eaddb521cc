"""Evaluation on held-out prompts (``[eval]``): the eval set, its prompt groups and the figures of a round — shared by
the learner's rounds during a run (``learner/intake/evaluation.py``) and the offline evaluator (``actors/evaluate.py``).

How an eval group travels, and why each choice:

- **Marked by a field, not a name**: ``PromptGroup.purpose = "eval"``, copied by the actor into
  ``RolloutGroup.purpose`` (both appended with default ``"train"``, so a peer that predates them reads every group as
  training). Provenance compares it with the issue record, so a forged copy cannot turn an eval group into a training
  one or back. Ids are ``<run>-eval<step>-<i>`` (:func:`eval_group_id`) only so that a person reading Redis or a log
  tells them apart; nothing routes on the id.
- **Its own sampling settings travel with it**: ``PromptGroup.temperature`` (0 = greedy), ``max_new_tokens`` and
  ``num_samples`` (k). A training group leaves them at their defaults (below 0, 0), so the actor samples it with
  ``[rollout]`` exactly as before and its behaviour log-probs μ keep their meaning.
- **Priority**: eval groups go to their own list (``eval_prompts``), which ``take_prompts`` pops before ``prompts``
  (one BRPOP over both, in that order): a round overtakes every queued training group.
- **Outside admission and staleness**: no ledger entry, no dispatcher counter, so they never take a place of the
  training capacity ``(s + v + 1) · G``, are never re-issued or counted lost (a round has its own deadline,
  ``eval.deadline_s``), and the learner routes them to its eval rounds before admission, so they are never judged
  stale and never trained. The actor holds an eval group until it serves the version the group was issued at (at most
  ``weight_sync.timeout_s``); the versions stamped on its tokens are recorded (``eval/policy_min``, ``_max``).
- **Scored by the reward workers** with the run's reward functions: eval groups carry the run's task label
  (:func:`asyncrl.common.data.tasks.task_label`), so ``[eval]`` is a held-out file of the run's kind of prompts, or the
  run's own built-in task drawn with another seed.
- **Recorded at the step it was issued**: a round issued when the learner is at version ``s`` (before step ``s + 1``
  trains) evaluates policy ``s`` and its row in metrics.jsonl has ``"step": s`` — the step whose row made that policy —
  written once all its groups are back (or its deadline passed), so it may come after rows of later steps.

Figures of a round (:func:`round_figures`), over its ``n`` groups of ``k`` responses with rewards ``r_ij``, a
response counting as solved when ``r_ij ≥ eval.success_threshold``::

    eval/mean@k   = (1/n) Σ_i (1/k) Σ_j r_ij           the mean reward
    eval/pass@k   = (1/n) Σ_i [max_j r_ij ≥ threshold]  some response of the prompt solves it
    eval/accuracy = (1/nk) Σ_ij [r_ij ≥ threshold]      = the unbiased pass@1 estimate (Chen et al. 2021)
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence

import numpy as np

from asyncrl.common.config import RunConfig
from asyncrl.common.data.file_task import FileTask
from asyncrl.common.data.prompts import Prompter
from asyncrl.common.data.tasks import Task, TaskExample, get_task, prompt_group, task_label
from asyncrl.common.wire.messages import PromptGroup, ScoredGroup
from asyncrl.common.wire.seal import group_tag

ROUND_KEYS = ("eval/step", "eval/version", "eval/k", "eval/groups", "eval/missing")
"""The figures every eval row has besides the scores (see :func:`round_figures`)."""


def eval_max_new_tokens(config: RunConfig) -> int:
    """The longest eval response: ``eval.max_new_tokens``, else ``rollout.max_new_tokens``."""
    return config.eval.max_new_tokens or config.rollout.max_new_tokens


def eval_task(config: RunConfig) -> Task:
    """The held-out task: ``eval.path`` read like ``[task]``'s file (in file order; its keys are ``[task]``'s unless
    ``[eval]`` names its own), or a built-in task."""
    section, task = config.eval, config.task
    if section.name == "file":
        keys = (section.prompt_key or task.prompt_key, section.answer_key or task.answer_key)
        return FileTask(section.path, *keys, section.split, section.limit, False)
    return get_task(section.name, **section.options)


def eval_examples(config: RunConfig, prompter: Prompter) -> list[TaskExample]:
    """The eval set as the model sees it: the file's first ``eval.limit`` rows, or ``eval.limit`` draws of the
    built-in task seeded by ``eval.seed``; a prompt too long to get a whole eval response is skipped or refuses the
    file as ``task.overlong`` says."""
    task = eval_task(config)
    task.fit(prompter, config.model.max_model_len - eval_max_new_tokens(config), config.task.overlong)
    count = len(task.examples) if isinstance(task, FileTask) else config.eval.limit
    rng = random.Random(config.eval.seed)
    return [prompter.apply(task.sample(rng)) for _ in range(count)]


def eval_group_id(run: str, step: int, index: int, secret: bytes = b"") -> str:
    """The id of eval prompt ``index`` of the round at ``step`` (unique in the run; recognisable in Redis); with the
    run ``secret``, it ends in a tag nobody without the secret can predict (``common/wire/seal.py: group_tag``)."""
    stem = f"{run}-eval{step:06d}-{index:05d}"
    return f"{stem}-{group_tag(secret, ('eval', step, index))}" if secret else stem


def eval_groups(
    config: RunConfig,
    examples: Sequence[TaskExample],
    encode: Callable[[str], list[int]],
    step: int,
    version: int,
    now: float | None = None,
    secret: bytes = b"",
) -> list[PromptGroup]:
    """One round's prompt groups: ``purpose = "eval"`` with the round's own sampling settings (ids keyed by the run
    ``secret`` when given: :func:`eval_group_id`)."""
    now = time.time() if now is None else now
    label, section, longest = task_label(config.task), config.eval, eval_max_new_tokens(config)
    ids = [eval_group_id(config.run.name, step, i, secret) for i in range(len(examples))]
    return [
        dataclasses.replace(
            prompt_group(ids[i], label, ex, encode, section.num_samples, version, now),
            purpose="eval",
            temperature=section.temperature,
            max_new_tokens=longest,
        )
        for i, ex in enumerate(examples)
    ]


def round_figures(groups: Sequence[ScoredGroup], threshold: float) -> dict[str, float]:
    """``eval/*`` scores of one round's scored groups (formulas in the module docstring); empty when none came back.

    Besides the scores: ``eval/response_tokens`` (mean length), ``eval/truncated`` (fraction that hit the length
    limit) and ``eval/policy_min`` / ``eval/policy_max`` (the oldest and newest version stamped on a token).
    """
    if not groups:
        return {}
    rewards = [g.rewards.astype(np.float64) for g in groups]
    solved = [r >= threshold for r in rewards]
    lengths = np.concatenate([g.rollout.lengths for g in groups])
    reasons = [reason for g in groups for reason in g.rollout.finish_reasons]
    versions = np.concatenate([g.rollout.versions for g in groups])
    return {
        "eval/mean@k": float(np.mean([r.mean() for r in rewards])),
        "eval/pass@k": float(np.mean([s.any() for s in solved])),
        "eval/accuracy": float(np.concatenate(solved).mean()),
        "eval/reward_std": float(np.concatenate(rewards).std()),
        "eval/response_tokens": float(lengths.mean()) if lengths.size else 0.0,
        "eval/truncated": sum(r == "length" for r in reasons) / max(len(reasons), 1),
        "eval/policy_min": float(versions.min()) if versions.size else -1.0,
        "eval/policy_max": float(versions.max()) if versions.size else -1.0,
    }
