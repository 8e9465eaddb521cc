"""A named preset's real run config, and scored groups answering its dispatcher's prompts as an actor and a reward
worker would: responses of chosen texts, lengths and finish reasons, the policy's own log-probs as μ, scored by the
run's configured reward functions (``common/rewards/functions.py``: ``combine``, as the reward worker scores)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from asyncrl.common.config import RunConfig, load_config
from asyncrl.common.data.tasks import task_label
from asyncrl.common.rewards.functions import bind_functions, combine
from asyncrl.common.wire.messages import PromptGroup, RolloutGroup, ScoredGroup
from asyncrl.learner.update.policy import PolicyUpdate
from tests.helpers.rollouts import encode

REPO = Path(__file__).resolve().parents[2]
EOS_ID = 2  # </s> of the tests' character tokenizer: kept in the ids of a stopped response, dropped from its text
DAPO_REWARDS = '[{name="task"},{name="overlong",options={max_tokens=6,buffer=2}}]'
"""dapo.toml's overlong buffer moved to end at the demo's generation limit (rollout.max_new_tokens = 6)."""


def preset_config(preset: str, tmp_path: Path, model_dir: Path, *overrides: str) -> RunConfig:
    """``configs/<preset>.toml`` over ``configs/demo.toml``, composed as a user composes a preset over the demo: 4
    steps of 8 groups, no eval rounds; DAPO's overlong buffer at the demo's generation limit."""
    config = tmp_path / f"{preset}.toml"
    overlay = (REPO / "configs" / f"{preset}.toml").read_text()
    config.write_text(f"preset = {json.dumps(str(REPO / 'configs/demo.toml'))}\n{overlay}")
    settings = [f"run.root={tmp_path}", f"run.name={preset}", f"model.path={model_dir}", "eval.every=0"]
    settings += ["learner.steps=4", "learner.groups_per_step=8"]
    if preset == "dapo":
        settings.append(f"reward.functions={DAPO_REWARDS}")
    return load_config(config, [*settings, *overrides])


def response(first_line: str, tokens: int, stop: bool = True) -> tuple[str, str]:
    """(text, finish reason) of a response of ``tokens`` tokens (the end-of-sequence token counted when ``stop``)
    whose first line is ``first_line``: the rest pads it after a newline (the task verifier reads the first line)."""
    chars = tokens - int(stop)
    if chars < len(first_line):
        raise ValueError(f"{first_line!r} needs more than {tokens} tokens")
    text = first_line if chars == len(first_line) else first_line + "\n" + "1" * (chars - len(first_line) - 1)
    return text, "stop" if stop else "length"


def answer_prompt(
    issued: PromptGroup, responses: Sequence[tuple[str, str]], version: int, actor: str = "actor-0"
) -> RolloutGroup:
    """What an actor holding policy ``version`` makes of ``issued``: one response per (text, finish reason), its
    ids the text's (and the end-of-sequence token when it stopped); μ is filled in by :func:`with_behaviour`."""
    ids = [encode(text) + ([EOS_ID] if reason == "stop" else []) for text, reason in responses]
    total = sum(map(len, ids))
    return RolloutGroup(
        group_id=issued.group_id,
        task=issued.task,
        prompt=issued.prompt,
        prompt_ids=issued.prompt_ids,
        answer=issued.answer,
        token_ids=np.asarray([t for i in ids for t in i], np.int32),
        logprobs=np.zeros(total, np.float32),
        versions=np.full(total, version, np.int32),
        lengths=np.asarray([len(i) for i in ids], np.int32),
        texts=[text for text, _ in responses],
        finish_reasons=[reason for _, reason in responses],
        actor_id=actor,
        issued_version=issued.issued_version,
        extra=issued.extra,
        purpose=issued.purpose,
    )


def policy_logprobs(update: PolicyUpdate, groups: Sequence[ScoredGroup]) -> list[np.ndarray]:
    """Per group, the log-probs the update's policy gives its response tokens (flat, in the group's order): the μ
    vLLM reports for a policy at the learner's current weights (``rollout.temperature`` applied)."""
    batch = update.collate(list(groups))
    logprobs = update.engine.token_logprobs_no_grad(batch.input_ids, batch.attention_mask, update.temperature)
    rows = [logprobs[row][batch.response_mask[row]].float().cpu() for row in range(batch.rows)]
    by_group: dict[str, list[torch.Tensor]] = {}
    for (group_id, _), values in zip(batch.keys, rows, strict=True):
        by_group.setdefault(group_id, []).append(values)
    return [torch.cat(by_group[g.rollout.group_id]).numpy() for g in groups]


def score(config: RunConfig, rollout: RolloutGroup) -> ScoredGroup:
    """``rollout`` scored as the reward worker scores it: the weighted sum of the run's reward functions (the ``task``
    function's verifier bound from the run's task), with each function's raw score per response in ``details``."""
    rewards, details, turns = combine(rollout, bind_functions(config.reward.functions, task_label(config.task)))
    rewards_array = np.asarray(rewards, np.float32)
    return ScoredGroup(rollout=rollout, rewards=rewards_array, details=details, scorer_id="rw-0", turn_rewards=turns)


def with_behaviour(update: PolicyUpdate, scored: Sequence[ScoredGroup]) -> list[ScoredGroup]:
    """``scored`` with μ set to the policy's log-probs of their tokens under the update's current weights."""
    mus = policy_logprobs(update, scored)
    return [
        dataclasses.replace(g, rollout=dataclasses.replace(g.rollout, logprobs=mu.astype(np.float32)))
        for g, mu in zip(scored, mus, strict=True)
    ]
