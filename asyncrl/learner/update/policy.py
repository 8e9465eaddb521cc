"""The policy update: the configured algorithm, assembled from the registries, and the optimizer step it drives.

Built in two stages, so that a typo costs a second, not a DeepSpeed start-up:

- ``assemble`` (:mod:`asyncrl.learner.algorithms.assembly`) resolves and validates every name and option of
  ``[algorithm]`` (and the off-policy correction of ``[staleness]``) against the registries — no model needed.
  Every ``rl-learner`` command runs it on the config it loads; a bad option exits 2 naming it and the allowed names.
- :class:`PolicyUpdate` then starts the engines the algorithm needs (policy, and only when its variants require
  them: a frozen reference, a critic) and runs one step::

      π_old (only where the advantages need it)  ->  advantages over the whole batch  ->  optimizer step on
      micro-batches  ->  (with a critic) the critic's step

π_old is the policy at the start of the step. Every batch makes exactly one optimizer step (the micro-batches
accumulate into it) and the policy runs without dropout, so the training forward of each micro-batch *is* π_old's:
its log-probs, detached, are π_old exactly, and a separate no-grad pass over the batch would recompute the same
numbers (verl's ``on_policy`` shortcut in ``dp_actor.py``: ``old_log_prob = log_prob.detach()``). That pass runs only
when something needs π_old before the update: a KL penalty in the reward (k1 = log π_old − log π_ref).

Offline DPO (:mod:`asyncrl.learner.update.dpo`) assembles its loss and aggregation through the same ``assemble``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from asyncrl.common.config import RunConfig
from asyncrl.common.wire.messages import ScoredGroup
from asyncrl.learner import dist, ranks
from asyncrl.learner.algorithms import AdvantageInput, GlobalCounts, LossInput, Need
from asyncrl.learner.algorithms.kl import KLController
from asyncrl.learner.algorithms.losses import log_ratios, mismatch_kl
from asyncrl.learner.algorithms.masked import masked_mean
from asyncrl.learner.algorithms.types import per_turn_refusal
from asyncrl.learner.update.batch import (
    PolicyRows,
    TrainBatch,
    collate,
    preference_rows,
    rank_micro_batches,
    training_passes,
)
from asyncrl.learner.update.engine import PolicyEngine, ReferenceModel, reference_for
from asyncrl.learner.update.step_metrics import MicroBatchMetrics

if TYPE_CHECKING:
    from asyncrl.learner.algorithms.assembly import Algorithm
    from asyncrl.learner.update.critic import ValueEngine
    from asyncrl.learner.update.lora import AdapterOffReference


class PolicyUpdate:
    """The engines an :class:`Algorithm` needs and its optimizer step on one :class:`TrainBatch`."""

    def __init__(self, config: RunConfig, algorithm: Algorithm, pad_token_id: int) -> None:
        self.config = config
        self.algorithm = algorithm
        self.needs = algorithm.needs
        self.pad_token_id = pad_token_id
        self.kl_control = KLController(algorithm.kl_reward)
        self.engine = PolicyEngine(config)
        self.reference = self._reference()
        self.critic = self._critic()
        self.temperature = config.rollout.temperature or 1.0
        self.last_advantages: torch.Tensor | None = None  # [B, T] of the last step (samples.jsonl)

    def _reference(self) -> ReferenceModel | AdapterOffReference | None:
        if not self.needs & {Need.REF_LOGPROBS, Need.TOKEN_KL}:
            return None
        return reference_for(self.engine)

    def _critic(self) -> ValueEngine | None:
        if Need.VALUES not in self.needs:
            return None
        from asyncrl.learner.update.critic import ValueEngine

        return ValueEngine(self.config)

    def restore_kl_coef(self, coef: float) -> None:
        """The KL-in-reward coefficient a checkpoint saved (the adaptive controller's state)."""
        self.kl_control = KLController(self.kl_control.settings, coef)

    def params(self) -> dict[str, torch.Tensor]:
        """The policy's weights as the actors load them (what the broadcaster sends); ``{}`` on ranks but 0. Under
        ZeRO-3 every rank takes part in the gather (:mod:`asyncrl.learner.ranks`)."""
        if self.config.learner.zero_stage == 3:
            ranks.lead("params")
        return self.engine.state_dict_for_broadcast()

    # ------------------------------------------------------------------ one step

    def collate(self, groups: list[ScoredGroup]) -> TrainBatch:
        """Every response of every group, or — for a pairwise loss — each group's best and worst as a pair."""
        rows = preference_rows(groups) if Need.PAIRS in self.needs else None
        if rows is not None and not rows:
            raise RuntimeError(
                "no group in this batch has two different rewards, so a pairwise loss has no pair to train on; "
                "set algorithm.dynamic_sampling = true to drop such groups"
            )
        return collate(groups, self.pad_token_id, rows)

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One step: π_old, advantages over the whole batch, the policy update, then (with a critic) the critic's.

        With several learner ranks every rank gets the whole batch (:mod:`asyncrl.learner.ranks`), computes π_old and
        the advantages over all of it, and runs backward on its shard
        (:func:`asyncrl.learner.update.batch.rank_micro_batches`)."""
        ranks.lead("train", batch)
        self._check_rows(batch)
        model = batch.model_tensors()
        old = self._old_logprobs(batch) if Need.TOKEN_KL in self.needs else None  # its one consumer: module docstring
        ref = None
        if self.reference is not None:
            ref = self.reference.token_logprobs(model["input_ids"], model["attention_mask"], self.temperature)
        old_values = self._values(self.critic, batch) if self.critic is not None else None
        figures: dict[str, float] = {}
        advantage = self.algorithm.advantage(self._advantage_input(batch, old, ref, old_values, figures))
        self.last_advantages = advantages = advantage.advantages.float()  # [B, T]; samples.jsonl reads it
        step = PolicyRows(**model, advantages=batch.on_model_rows(advantages), old_logprobs=old, ref_logprobs=ref)
        counts = GlobalCounts.of(step.response_mask)
        metrics = MicroBatchMetrics()
        stats = self.engine.train_step(self._micro_batches(step), self._loss_fn(counts, metrics))
        figures |= {"loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr, "seconds": stats.seconds}
        figures["applied"] = float(stats.applied)  # False: a non-finite step was skipped (learner/health/monitor.py)
        if self.critic is not None and old_values is not None and advantage.returns is not None:
            inputs = {k: model[k] for k in ("input_ids", "attention_mask", "response_mask")}  # μ is the policy's alone
            rows = {**inputs, "old_values": old_values, "returns": advantage.returns.float()}
            figures |= self._train_critic(self.critic, rows, counts, metrics)
        figures.update(metrics.figures())
        return figures

    def _check_rows(self, batch: TrainBatch) -> None:
        """Episodes kept per turn are trained only by what needs no whole-episode pass (the config check refuses the
        rest first: ``cli/preflight.py``)."""
        if batch.served is not None and (refusal := per_turn_refusal(self.needs)):
            raise RuntimeError(refusal)

    def _advantage_input(
        self,
        batch: TrainBatch,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        values: torch.Tensor | None,
        figures: dict[str, float],
    ) -> AdvantageInput:
        """The estimator's input: ``values`` V_old with a critic; with a KL penalty in the reward, k1 = log π_old
        (``old``) − log π_ref (``ref``) per token."""
        token_kl = kl_coef = None
        if old is not None and ref is not None:  # the pass before the update runs only for a KL penalty in the reward
            token_kl = (old - ref) * batch.response_mask
            observed = float(token_kl.sum() / batch.response_mask.sum().clamp(min=1))
            if self.kl_control.settings.mode != "off":
                kl_coef = self.kl_control.coef
                figures |= {"kl_reward/coef": kl_coef, "kl_reward/kl": observed}
                self.kl_control.update(observed, batch.rows)
        return AdvantageInput(
            rewards=batch.rewards,
            group_ids=batch.group_ids,
            response_mask=batch.response_mask,
            token_kl=token_kl,
            values=values,
            kl_coef=kl_coef,
            turn_rewards=batch.turn_rewards,
        )

    def _micro_batches(self, step: PolicyRows) -> list[PolicyRows]:
        """This rank's shard of the step in micro-batches (a pair is never split across micro-batches or ranks)."""
        size, unit = self._micro_batch_shape()
        return step.micro_batches(size, dist.rank(), dist.world_size(), unit)

    def _micro_batch_shape(self) -> tuple[int, int]:
        """``(rows, unit)`` of the policy's micro-batches: a pairwise loss takes whole pairs."""
        size = self.engine.micro_batch_size
        return (max(2, size - size % 2), 2) if Need.PAIRS in self.needs else (size, 1)

    def _loss_fn(self, counts: GlobalCounts, metrics: MicroBatchMetrics):
        """The policy's loss of one micro-batch: its share of the batch loss (engine convention, global counts)."""
        with_entropy, temperature = Need.ENTROPY in self.needs, self.temperature
        off_policy = self.config.staleness.correction != "none"

        def loss_fn(engine: PolicyEngine, mb: PolicyRows) -> torch.Tensor:
            # The entropy is measured every step (the entropy-collapse alert watches it), with a graph only when the
            # loss has an entropy bonus.
            logprobs, entropy = engine.token_logprobs_and_entropy(
                mb.input_ids, mb.attention_mask, temperature, entropy_grad=with_entropy
            )
            mask = mb.response_mask
            if not with_entropy:
                metrics.add({"loss/entropy": masked_mean(entropy, mask.to(entropy.device))}, mask)
                entropy = None
            out = self.algorithm.loss(
                LossInput(
                    logprobs=logprobs,
                    old_logprobs=_proximal(mb, logprobs, off_policy),
                    behaviour_logprobs=mb.behaviour_logprobs,
                    advantages=mb.advantages,
                    response_mask=mask,
                    ref_logprobs=mb.ref_logprobs,
                    entropy=entropy,
                )
            )
            if not off_policy:  # μ stood in for π_old, so the loss saw no mismatch: measure it on this forward
                log_w = log_ratios(logprobs, mb.behaviour_logprobs, mask)
                out.metrics["offpolicy/mismatch_kl"] = mismatch_kl(log_w, mask)
            metrics.add(out.metrics, mask, out.sequence_metrics)
            return self.algorithm.aggregate(out.per_token_loss, mask, counts)

        return loss_fn

    def _values(self, critic: ValueEngine, batch: TrainBatch) -> torch.Tensor:
        """V_old [B, T] of the critic at the start of the step (GAE's bootstrap, the value clip's centre)."""
        values = torch.zeros(batch.response_mask.shape)
        for rows, mb in training_passes(batch.tensors(), critic.micro_batch_size, dist.world_size()):
            part = critic.values_no_grad(mb["input_ids"], mb["attention_mask"]).cpu()
            values[rows, : part.shape[1]] = part.to(values.dtype)
        return values * batch.response_mask

    def _train_critic(
        self, critic: ValueEngine, rows: dict[str, torch.Tensor], counts: GlobalCounts, metrics: MicroBatchMetrics
    ) -> dict[str, float]:
        """The critic's step on ``rows``: the model's inputs, V_old (``old_values``) and the returns."""
        from asyncrl.learner.update.critic import value_loss_fn

        micro = rank_micro_batches(rows, critic.micro_batch_size, dist.rank(), dist.world_size())
        stats = critic.train_step(micro, value_loss_fn(self.config.critic.value_clip, counts, metrics))
        return {"critic/loss": stats.loss, "critic/grad_norm": stats.grad_norm, "critic/seconds": stats.seconds}

    def _old_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """π_old [B, T] before the update: a no-grad pass of the current weights over the whole batch, or μ when the
        correction is ``none``."""
        if self.config.staleness.correction == "none":
            return batch.behaviour_logprobs
        size, unit = self._micro_batch_shape()
        logprobs = torch.zeros(batch.response_mask.shape)
        for rows, mb in training_passes(batch.tensors(), size, dist.world_size(), unit):
            part = self.engine.token_logprobs_no_grad(mb["input_ids"], mb["attention_mask"], self.temperature).cpu()
            logprobs[rows, : part.shape[1]] = part.to(logprobs.dtype)
        return logprobs * batch.response_mask


def _proximal(mb: PolicyRows, logprobs: torch.Tensor, off_policy: bool) -> torch.Tensor:
    """log π_old of one micro-batch: the pass before the update when there was one, else the training forward's own
    log-probs detached (the same weights: one optimizer step per batch); μ when the correction is ``none``."""
    if mb.old_logprobs is not None:
        return mb.old_logprobs
    return logprobs.detach() if off_policy else mb.behaviour_logprobs
