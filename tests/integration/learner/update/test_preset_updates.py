"""The DAPO, GSPO, PPO and online DPO presets' maths in the learner's real step, without actors: each preset's own
config (``configs/<preset>.toml`` over ``configs/demo.toml``, as a user composes it), the real admission
(``BatchSource`` on a real Redis) and the real ``PolicyUpdate`` on the tiny model, over replayed groups that answer the
dispatcher's own prompts, scored by the run's reward functions, with the policy's own log-probs as μ.

DAPO: dynamic sampling drops the groups whose rewards are all equal (counted ``groups/zero_variance``), and the
overlong penalty is what sets apart an otherwise all-right group, which is trained. GSPO: the sequence ratio is 1 on
policy (nothing clipped), and over one-step-stale groups with π_old = μ a sequence is clipped exactly when its
length-normalised ratio leaves GSPO's narrow band on the side its advantage pushes. PPO: the critic trains in the same
step and GAE gives per-token advantages. Online DPO: groups without a preference pair are dropped, the rest trained
against the frozen reference. The whole loop (actors, reward workers, checkpoints) runs the GRPO demo in tests/e2e.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from asyncrl.common.config import RunConfig
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.replay import ReplayWriter
from asyncrl.common.wire.messages import PromptGroup, ScoredGroup
from asyncrl.learner.algorithms.assembly import assemble
from asyncrl.learner.intake.batch_source import BatchSource, Taken
from asyncrl.learner.update.batch import TrainBatch
from asyncrl.learner.update.policy import PolicyUpdate
from tests.helpers.preset_batches import answer_prompt, policy_logprobs, preset_config, response, score, with_behaviour

pytestmark = pytest.mark.usefixtures("one_rank_world")

Responses = list[tuple[str, str]]
STEPS = 4  # learner.steps of preset_config


@dataclass
class Trainer:
    """The learner's step without its broadcaster and recorder: take a batch, train it, settle it."""

    config: RunConfig
    plane: ControlPlane
    source: BatchSource
    update: PolicyUpdate
    version: int = 0
    answered: set[str] = field(default_factory=set)

    @classmethod
    def start(cls, config: RunConfig, redis_client, tokenizer) -> Trainer:
        plane = ControlPlane(redis_client, config.run.name)
        source = BatchSource(config, plane, tokenizer, newest_version=0)
        return cls(config, plane, source, PolicyUpdate(config, assemble(config), tokenizer.pad_token_id))

    def prompts(self, count: int) -> list[PromptGroup]:
        """``count`` released training prompts not answered yet (admission releases them as the learner would)."""
        self.source.dispatcher.release(self.version)
        fresh = sorted(set(self.plane.prompts.ledger()) - self.answered)[:count]
        assert len(fresh) == count, f"admission released only {len(fresh)} unanswered groups"
        self.answered.update(fresh)
        return [self.plane.prompts.load_group(group_id) for group_id in fresh]

    def sample(self, answers: Sequence[Callable[[str], Responses]], behaviour: bool = True) -> list[ScoredGroup]:
        """One group per ``answers`` entry (responses from the prompt's answer), sampled by the current policy and
        scored by the run's reward functions; μ is the policy's log-probs when ``behaviour`` (a loss without an
        importance weight, as DPO's, never reads it)."""
        prompts = self.prompts(len(answers))
        rollouts = [answer_prompt(p, make(p.answer), self.version) for p, make in zip(prompts, answers, strict=True)]
        scored = [score(self.config, r) for r in rollouts]
        return with_behaviour(self.update, scored) if behaviour else scored

    def step(self, groups: Sequence[ScoredGroup]) -> tuple[Taken, TrainBatch, dict[str, float]]:
        """The reward worker writes ``groups`` to the replay stream; the learner takes, trains and settles a batch."""
        ReplayWriter(self.plane.client, self.plane.keys).add(groups)
        taken = self.source.take(self.version, threading.Event(), on_wait=lambda: None)
        batch = self.update.collate(taken.groups)
        figures = self.update.train(batch)
        self.version += 1
        self.source.settle(self.version, taken)
        self.source.published(self.version)
        return taken, batch, figures


@pytest.fixture
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def wrong(answer: str) -> str:
    return answer + "1"  # a first line that is an integer, and not the answer


def mixed(right: int, samples: int = 8) -> Callable[[str], Responses]:
    """``right`` responses that give the answer, the rest a wrong number; all within the overlong buffer's start."""
    return lambda a: [response(a, len(a) + 1)] * right + [response(wrong(a), len(a) + 2)] * (samples - right)


def all_right(a: str) -> Responses:
    return [response(a, len(a) + 1)] * 8


def all_wrong(a: str) -> Responses:
    return [response(wrong(a), len(a) + 2)] * 8


def right_but_overlong(a: str) -> Responses:
    """All eight answer right; two run into the overlong buffer (max_tokens 6, buffer 2): 5 tokens, and 6 cut off."""
    return [response(a, len(a) + 1)] * 6 + [response(a, 5), response(a, 6, stop=False)]


def assert_trained(figures: dict[str, float]) -> None:
    assert figures["applied"] == 1.0, figures
    for name in ("loss", "grad_norm", "loss/clip_frac"):  # train/loss, train/grad_norm, train/loss/clip_frac
        assert math.isfinite(figures[name]), (name, figures)
    assert figures["grad_norm"] > 0, figures
    # measured every step although no preset has an entropy bonus: between 0 and log |vocabulary|
    assert 0 < figures["loss/entropy"] < math.log(TINY_VOCABULARY), figures


TINY_VOCABULARY = 64  # the tiny character model's vocabulary is smaller than this


# --------------------------------------------------------------------------- DAPO


def test_dapo_drops_zero_variance_groups_and_trains_the_overlong_penalty(
    tmp_path: Path, tiny_model_dir: Path, redis_client, tokenizer
) -> None:
    config = preset_config("dapo", tmp_path, tiny_model_dir)
    assert config.algorithm.dynamic_sampling and config.algorithm.loss_options["clip_high"] == 0.28
    trainer = Trainer.start(config, redis_client, tokenizer)
    for step in range(1, STEPS + 1):
        groups = trainer.sample([all_right, all_wrong, right_but_overlong, *map(mixed, range(1, 8))])
        flat, overlong = groups[:2], groups[2]
        taken, batch, figures = trainer.step(groups)

        assert taken.verdicts == {"duplicate": 0, "refused": 0, "stale": 0, "zero_variance": 2}
        assert taken.figures()["groups/zero_variance"] == 2.0  # metrics.jsonl's groups/zero_variance
        trained = [g.rollout.group_id for g in taken.groups]
        assert trained == [g.rollout.group_id for g in groups[2:]]  # the two flat groups are not trained
        assert trainer.plane.prompts.dispatch_counts()["discarded"] == 2 * step  # admission replaces them
        assert_overlong_shaped(overlong)
        assert_overlong_trained(batch, trainer.update.last_advantages, overlong)
        assert_trained(figures)
        assert all(len(set(g.rewards.tolist())) == 1 for g in flat)


def assert_overlong_shaped(group: ScoredGroup) -> None:
    """DAPO eq. 13 with L_max = 6, L_cache = 2: 5 tokens −(5 − 4)/2 = −0.5, 6 tokens −1; the task reward is 1."""
    assert [d["task"] for d in group.details] == [1.0] * 8
    assert [d["overlong"] for d in group.details] == [0.0] * 6 + [-0.5, -1.0]
    assert group.rewards.tolist() == [1.0] * 6 + [0.5, 0.0]


def assert_overlong_trained(batch: TrainBatch, advantages: torch.Tensor, group: ScoredGroup) -> None:
    """The group's advantages come from the penalty alone: GRPO's (r − mean)/(std + ε), positive for the six short
    responses, negative for the two long ones, the same at each of a response's tokens."""
    rewards = group.rewards.astype(np.float64)
    expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    assert (expected[:6] > 0).all() and (expected[6:] < 0).all()
    rows = [row for row, (group_id, _) in enumerate(batch.keys) if group_id == group.rollout.group_id]
    assert len(rows) == 8
    for row, want, length in zip(rows, expected, group.rollout.lengths, strict=True):
        values = advantages[row][batch.response_mask[row]]
        assert len(values) == length
        torch.testing.assert_close(values, torch.full_like(values, want), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- GSPO


def varied(right: int) -> Callable[[str], Responses]:
    """``right`` of 8 responses give the answer, the rest a wrong number; lengths from 2 to 6 tokens."""

    def make(a: str) -> Responses:
        lines = [a if i < right else wrong(a) for i in range(8)]
        return [response(line, min(6, max(len(line) + 1, 2 + i % 5))) for i, line in enumerate(lines)]

    return make


def test_gspo_trains_on_policy_with_every_sequence_ratio_one(
    tmp_path: Path, tiny_model_dir: Path, redis_client, tokenizer
) -> None:
    config = preset_config("gspo", tmp_path, tiny_model_dir)
    assert (config.algorithm.loss, config.algorithm.aggregation) == ("gspo", "seq_mean_token_mean")
    trainer = Trainer.start(config, redis_client, tokenizer)
    for _ in range(STEPS):
        taken, _, figures = trainer.step(trainer.sample([varied(right) for right in range(1, 9)]))
        assert len(taken.groups) == 8 and sum(taken.verdicts.values()) == 0  # no dynamic sampling: all-right trains
        assert_trained(figures)
        # π_old is the training forward's own log-probs: s_i = exp(mean_t 0) = 1 exactly, inside any band
        assert figures["loss/ratio_mean"] == 1.0 and figures["loss/clip_frac"] == 0.0


def test_gspo_clips_a_stale_sequence_whose_ratio_leaves_the_band(
    tmp_path: Path, tiny_model_dir: Path, redis_client, tokenizer
) -> None:
    """With ``staleness.correction = none`` π_old is μ: a group sampled one version ago is clipped per sequence."""
    config = preset_config("gspo", tmp_path, tiny_model_dir, "staleness.correction=none")
    trainer = Trainer.start(config, redis_client, tokenizer)
    sampled = trainer.sample([varied(right) for right in (*range(1, 9), *range(1, 9))])  # all by version 0
    _, _, figures = trainer.step(sampled[:8])
    assert_trained(figures)
    assert figures["loss/clip_frac"] == 0.0  # μ is π_θ's own: every s_i is 1 to float precision

    stale = sampled[8:]
    ratios, expected = sequence_ratios(trainer.update, stale, config.algorithm.loss_options)
    taken, _, figures = trainer.step(stale)
    assert taken.verdicts["stale"] == 0 and len(taken.groups) == 8  # one version behind: max_staleness = 1
    assert_trained(figures)
    assert 0 < expected < 1, (expected, ratios)  # the step moved some sequences out of the band, not all
    assert figures["loss/clip_frac"] == pytest.approx(expected, abs=1e-9)
    assert figures["loss/ratio_mean"] == pytest.approx(float(np.mean(ratios)), rel=1e-5)


def sequence_ratios(update: PolicyUpdate, groups: Sequence[ScoredGroup], options: dict) -> tuple[list[float], float]:
    """Each sequence's s_i = exp(mean_t log π_θ − log μ) under the update's current weights, and the fraction GSPO
    clips: s_i > 1 + ε_high where A_i > 0, s_i < 1 − ε_low where A_i < 0 (A_i: GRPO's, from the group's rewards)."""
    ratios, clipped = [], []
    for group, current in zip(groups, policy_logprobs(update, groups), strict=True):
        rewards = group.rewards.astype(np.float64)
        advantages = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
        bounds = np.cumsum([0, *group.rollout.lengths])
        for advantage, start, end in zip(advantages, bounds[:-1], bounds[1:], strict=True):
            log_s = np.mean(current[start:end].astype(np.float64) - group.rollout.logprobs[start:end])
            ratio = math.exp(log_s)
            ratios.append(ratio)
            high, low = ratio > 1 + options["clip_high"], ratio < 1 - options["clip_low"]
            clipped.append((advantage > 0 and high) or (advantage < 0 and low))
    return ratios, float(np.mean(clipped))


# --------------------------------------------------------------------------- PPO


def test_ppo_trains_its_critic_beside_the_policy_with_per_token_gae_advantages(
    tmp_path: Path, tiny_model_dir: Path, redis_client, tokenizer
) -> None:
    """The critic is a second engine in the same step: its loss is finite and its gradient non-zero at every step,
    and GAE (γ = 1, λ = 0.95) over the critic's values gives a response's tokens different advantages (GRPO's are
    one per response)."""
    config = preset_config("ppo", tmp_path, tiny_model_dir)
    assert (config.algorithm.advantage, config.algorithm.loss) == ("gae", "ppo_clip")
    trainer = Trainer.start(config, redis_client, tokenizer)
    assert trainer.update.critic is not None
    for _ in range(STEPS):
        _, batch, figures = trainer.step(trainer.sample([varied(right) for right in range(1, 9)]))
        assert_trained(figures)
        assert math.isfinite(figures["critic/loss"]) and figures["critic/grad_norm"] > 0, figures
        advantages = trainer.update.last_advantages
        spreads = [advantages[row][batch.response_mask[row]] for row in range(batch.rows)]
        assert any(len(values) > 1 and values.max() - values.min() > 1e-6 for values in spreads)


# --------------------------------------------------------------------------- online DPO


def test_online_dpo_pairs_each_groups_best_and_worst_and_drops_groups_without_a_pair(
    tmp_path: Path, tiny_model_dir: Path, redis_client, tokenizer
) -> None:
    """Dynamic sampling drops the groups whose rewards are all equal (no preference pair); every other group gives
    one pair to the DPO loss against the frozen reference, whose figures are finite at every step."""
    config = preset_config("online_dpo", tmp_path, tiny_model_dir)
    assert (config.algorithm.loss, config.staleness.correction) == ("dpo", "none")
    trainer = Trainer.start(config, redis_client, tokenizer)
    for _ in range(STEPS):
        groups = trainer.sample([all_right, all_wrong, *map(mixed, range(1, 8)), mixed(4)], behaviour=False)
        taken, _, figures = trainer.step(groups)
        assert taken.verdicts["zero_variance"] == 2
        assert [g.rollout.group_id for g in taken.groups] == [g.rollout.group_id for g in groups[2:]]
        assert figures["applied"] == 1.0 and figures["grad_norm"] > 0, figures
        for name in ("loss", "dpo/reward_margin", "dpo/accuracy"):
            assert math.isfinite(figures[name]), (name, figures)
