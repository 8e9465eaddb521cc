"""The learner: admit prompts, take whole scored groups from the replay stream, train, broadcast.

One step, as a table of contents (:meth:`Learner.step`)::

    release prompt groups (admission control)  ->  collect a batch of fresh groups (drop stale ones)
    ->  advantages (whole batch)  ->  π_old (unless correction = none)  ->  optimizer step (micro-batches)
    ->  acknowledge the groups  ->  broadcast the new weights, bump the version  ->  metrics.jsonl

Staleness (DESIGN.md): a group whose oldest token is older than ``v − max_staleness`` is dropped and
counted; admission control makes that rare. Replay entries are acknowledged only after the step that
used them has been applied, so a learner crash re-reads them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.config import RunConfig, write_resolved
from common.control import ControlPlane, connect
from common.logs import get_logger
from common.replay import ReplayEntry, ReplayReader
from common.wire import Limits, ScoredGroup
from learner.algorithms import (
    AdvantageInput,
    GlobalCounts,
    LossInput,
    advantage_settings,
    build_advantage,
    build_aggregation,
    build_loss,
    loss_settings,
)
from learner.algorithms.kl import KLController, KLRewardSettings
from learner.batch import TrainBatch, collate, preference_rows
from learner.broadcaster import Broadcaster
from learner.dispatcher import Dispatcher
from learner.engine import PolicyEngine, ReferenceModel, split_micro_batches

if TYPE_CHECKING:
    from learner.critic import ValueEngine

log = get_logger("learner")


@dataclass
class StepRecord:
    """What one step did; one line of metrics.jsonl."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, prefix: str, figures: dict[str, float]) -> None:
        self.values.update({f"{prefix}/{k}": float(v) for k, v in figures.items()})


class Learner:
    def __init__(self, config: RunConfig, redis_url: str) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.plane = ControlPlane(connect(redis_url), config.run.name)
        write_resolved(config)
        self.plane.publish_config(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.engine = PolicyEngine(config)
        algorithm = config.algorithm
        self.advantage = build_advantage(algorithm.advantage, algorithm.advantage_options)
        self.loss_options = self._loss_options()
        self.loss = build_loss(algorithm.loss, self.loss_options)
        self.aggregate = build_aggregation(algorithm.aggregation, algorithm.aggregation_options)
        self.kl_control = KLController(KLRewardSettings(**algorithm.kl_reward))
        # What the configured variants need computed (Settings.requires); nothing else is built.
        self.needs = advantage_settings(algorithm.advantage, algorithm.advantage_options).requires()
        self.needs |= loss_settings(algorithm.loss, self.loss_options).requires()
        if self.kl_control.settings.mode != "off":
            self.needs |= {"token_kl"}
        self.reference = self._reference()
        self.critic = self._critic()
        limits = Limits(int(config.transport.max_message_mb * 2**20), len(self.tokenizer))
        self.reader = ReplayReader(self.plane.client, self.plane.keys, limits=limits)
        self.dispatcher = Dispatcher(config, self.plane, lambda text: self.tokenizer(text)["input_ids"])
        self.broadcaster = Broadcaster(config, self.plane)
        self.version = self.plane.version()
        self.metrics_path = config.run_dir / "metrics.jsonl"
        self._idle_s = 0.0
        self._carry: list[ReplayEntry] = []  # recovered entries not yet trained, still pending in the stream
        self._sync: tuple[int, Future[dict[str, float]]] | None = None  # the weight transfer in flight
        self._early_sync: dict[str, float] = {}  # figures of a transfer finished before its step's broadcast
        self._overlap = config.weight_sync.overlap and config.staleness.max_staleness >= 1

    def _loss_options(self) -> dict:
        """The loss's own options, plus the run's off-policy correction where the loss takes one."""
        options = dict(self.config.algorithm.loss_options)
        staleness = self.config.staleness
        correction = {"correction": staleness.correction, "level": staleness.level, "cap": staleness.cap}
        settings = loss_settings(self.config.algorithm.loss, options)
        if "off_policy" in type(settings).model_fields and "off_policy" not in options:
            options["off_policy"] = correction
        return options

    def _reference(self) -> ReferenceModel | None:
        if not self.needs & {"ref_logprobs", "token_kl"}:
            return None
        return ReferenceModel(self.config.model.path, self.config.learner.precision, str(self.engine.device))

    def _critic(self) -> ValueEngine | None:
        if "values" not in self.needs:
            return None
        from learner.critic import ValueEngine

        return ValueEngine(self.config)

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        self.plane.set_version(self.version)
        # Entries read by an earlier learner (same consumer name) and never acknowledged come first.
        self._carry = self.reader.recover()
        log.info("learner started", run=self.config.run.name, steps=self.config.learner.steps, version=self.version)
        try:
            for _ in range(self.config.learner.steps):
                self.step()
            self.finish_sync()
        finally:
            self.broadcaster.close()
        log.info("learner finished", run=self.config.run.name, version=self.version)

    def step(self) -> StepRecord:
        record = StepRecord()
        started = time.perf_counter()
        self.dispatcher.release(self.version)
        entries, dropped = self.collect_batch(record)
        batch = self._collate([e.group for e in entries])
        record.add("train", self.train(batch))
        self.reader.ack([e.entry_id for e in entries] + dropped)
        self.dispatcher.complete([e.group.rollout.group_id for e in entries])
        record.add("sync", self.broadcast())
        record.add("rollout", self._rollout_figures(entries, batch))
        record.values["step/seconds"] = time.perf_counter() - started
        record.values["step/idle_fraction"] = self._idle_s / max(record.values["step/seconds"], 1e-9)
        self._write(record)
        return record

    # ------------------------------------------------------------------ batch

    def _collate(self, groups: list[ScoredGroup]) -> TrainBatch:
        """Every response of every group, or — for a pairwise loss — each group's best and worst as a pair."""
        rows = preference_rows(groups) if "pairs" in self.needs else None
        if rows is not None and not rows:
            raise RuntimeError(
                "no group in this batch has two different rewards, so a pairwise loss has no pair to train on; "
                "set algorithm.dynamic_sampling = true to drop such groups"
            )
        return collate(groups, self.tokenizer.pad_token_id or 0, rows)

    def collect_batch(self, record: StepRecord) -> tuple[list[ReplayEntry], list[str]]:
        """``groups_per_step`` fresh groups; stale and duplicate ones are acknowledged and counted."""
        want = self.config.learner.groups_per_step
        floor = self.version - self.config.staleness.max_staleness
        dropped: list[str] = []
        stale = duplicates = zero_variance = 0
        waited = time.perf_counter()
        entries: list[ReplayEntry] = []
        candidates, self._carry = self._carry, []
        while len(entries) < want:
            if not candidates:
                if time.perf_counter() - waited > self.config.learner.wait_for_batch_s:
                    raise TimeoutError(
                        f"no full batch within {self.config.learner.wait_for_batch_s}s: "
                        f"{len(entries)}/{want} groups; are actors and reward workers running?"
                    )
                self.dispatcher.release(self.version)
                self.dispatcher.reissue_overdue(self.config.learner.group_deadline_s)
                self._welcome_new_actors()
                candidates = self.reader.read(want - len(entries), block_ms=500)
            for entry in candidates:
                if len(entries) == want:
                    self._carry.append(entry)  # recovered beyond one batch: next step's
                    continue
                verdict = self._admit(entry, floor, {e.group.rollout.group_id for e in entries})
                if verdict == "ok":
                    entries.append(entry)
                    continue
                dropped.append(entry.entry_id)
                stale += verdict == "stale"
                duplicates += verdict == "duplicate"
                zero_variance += verdict == "zero_variance"
            candidates = []
        self._idle_s = time.perf_counter() - waited
        record.values.update(
            {"groups/dropped_stale": stale, "groups/duplicates": duplicates, "groups/zero_variance": zero_variance}
        )
        return entries, dropped

    def _admit(self, entry: ReplayEntry, floor: int, in_batch: set[str]) -> str:
        """``ok``, ``duplicate`` (trained before, or already in this batch: a re-issued group's two copies), ``stale``
        (a token older than the staleness bound), or ``zero_variance`` (equal rewards, with dynamic sampling on).
        Stale and zero-variance groups are discarded, so that admission releases replacements."""
        group_id = entry.group.rollout.group_id
        if group_id in in_batch or self.dispatcher.was_completed(group_id):
            self.dispatcher.note_duplicate(group_id)
            return "duplicate"
        if int(entry.group.rollout.versions.min(initial=self.version)) < floor:
            self.dispatcher.discard([group_id])
            return "stale"
        if self.config.algorithm.dynamic_sampling and len(set(entry.group.rewards.tolist())) == 1:
            self.dispatcher.discard([group_id])  # DAPO's dynamic sampling: no signal; admission releases another
            return "zero_variance"
        return "ok"

    # ------------------------------------------------------------------ training

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One step: π_old, advantages over the whole batch, the policy update, then (with a critic) the critic's."""
        temperature = self.config.rollout.temperature or 1.0
        tensors = batch.tensors()
        tensors["old_logprobs"] = self._old_logprobs(batch, temperature)
        if self.reference is not None:
            tensors["ref_logprobs"] = self.reference.token_logprobs(batch.input_ids, batch.attention_mask, temperature)
        figures: dict[str, float] = {}
        if self.critic is not None:
            tensors["old_values"] = self._values(batch)
        advantage = self.advantage(self._advantage_input(batch, tensors, figures))
        tensors["advantages"] = advantage.advantages.float()
        counts = GlobalCounts.of(batch.response_mask)
        metrics: dict[str, list[float]] = {}
        stats = self.engine.train_step(self._micro_batches(tensors), self._loss_fn(counts, metrics, temperature))
        figures |= {"loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr, "seconds": stats.seconds}
        if self.critic is not None and advantage.returns is not None:
            tensors["returns"] = advantage.returns.float()
            figures |= self._train_critic(tensors, counts, metrics)
        figures.update({name: sum(v) / len(v) for name, v in metrics.items()})
        return figures

    def _advantage_input(self, batch: TrainBatch, tensors: dict[str, torch.Tensor], figures: dict[str, float]):
        """The estimator's input; with a KL penalty in the reward, k1 = log π_old − log π_ref per token."""
        token_kl = kl_coef = None
        if "token_kl" in self.needs:
            token_kl = (tensors["old_logprobs"] - tensors["ref_logprobs"]) * batch.response_mask
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
            values=tensors.get("old_values"),
            kl_coef=kl_coef,
        )

    def _micro_batches(self, tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        size = self.engine.micro_batch_size
        if "pairs" in self.needs:
            size = max(2, size - size % 2)  # a pair is never split across micro-batches
        return split_micro_batches(tensors, size)

    def _loss_fn(self, counts: GlobalCounts, metrics: dict[str, list[float]], temperature: float):
        """The policy's loss of one micro-batch: its share of the batch loss (engine convention, global counts)."""
        with_entropy = "entropy" in self.needs

        def loss_fn(engine: PolicyEngine, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            entropy = None
            if with_entropy:
                logprobs, entropy = engine.token_logprobs_and_entropy(
                    mb["input_ids"], mb["attention_mask"], temperature
                )
            else:
                logprobs = engine.token_logprobs(mb["input_ids"], mb["attention_mask"], temperature)
            out = self.loss(
                LossInput(
                    logprobs=logprobs,
                    old_logprobs=mb["old_logprobs"],
                    behaviour_logprobs=mb["behaviour_logprobs"],
                    advantages=mb["advantages"],
                    response_mask=mb["response_mask"],
                    ref_logprobs=mb.get("ref_logprobs"),
                    entropy=entropy,
                )
            )
            for name, value in out.metrics.items():
                metrics.setdefault(name, []).append(float(value))
            return self.aggregate(out.per_token_loss, mb["response_mask"], counts)

        return loss_fn

    def _values(self, batch: TrainBatch) -> torch.Tensor:
        """V_old [B, T] of the critic at the start of the step (GAE's bootstrap, the value clip's centre)."""
        parts = [
            self.critic.values_no_grad(mb["input_ids"], mb["attention_mask"]).cpu()
            for mb in split_micro_batches(batch.tensors(), self.critic.micro_batch_size)
        ]
        return torch.cat(parts) * batch.response_mask

    def _train_critic(
        self, tensors: dict[str, torch.Tensor], counts: GlobalCounts, metrics: dict[str, list[float]]
    ) -> dict[str, float]:
        from learner.critic import value_loss_fn

        keys = ("input_ids", "attention_mask", "response_mask", "old_values", "returns")
        micro = split_micro_batches({k: tensors[k] for k in keys}, self.critic.micro_batch_size)
        stats = self.critic.train_step(micro, value_loss_fn(self.config.critic.value_clip, counts, metrics))
        return {"critic/loss": stats.loss, "critic/grad_norm": stats.grad_norm, "critic/seconds": stats.seconds}

    def _old_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        """π_old: recomputed by the current weights at the start of the step, or μ when correction = none."""
        if self.config.staleness.correction == "none":
            return batch.behaviour_logprobs
        parts = [
            self.engine.token_logprobs_no_grad(mb["input_ids"], mb["attention_mask"], temperature).cpu()
            for mb in split_micro_batches(batch.tensors(), self.engine.micro_batch_size)
        ]
        return torch.cat(parts) * batch.response_mask

    # ------------------------------------------------------------------ weights and metrics

    def broadcast(self) -> dict[str, float]:
        """Bump the version and send the new weights; figures of the transfer that finished during this call.

        With overlap (``weight_sync.overlap`` and ``max_staleness`` ≥ 1) the transfer of version v + 1 runs while
        step v + 2 computes and is finished at the start of the next broadcast, so the figures returned are of
        the previous version's transfer (``sync/version`` says which); ``sync/wait_s`` is the time the learner
        waited for it — the part of the broadcast that overlap did not hide.
        """
        figures = self._early_sync | self.finish_sync()
        self._early_sync = {}
        self.version += 1
        if self.version % self.config.weight_sync.sync_every:
            return figures | {"skipped": 1.0}
        params = self.engine.state_dict_for_broadcast()
        self._sync = (self.version, self.broadcaster.start(self.version, params))
        if not self._overlap:
            figures = self.finish_sync()
        return figures

    def _welcome_new_actors(self) -> None:
        """An actor that joins while the learner waits for a batch gets the current weights now rather than after
        the next step: it generates nothing until it holds weights within the staleness bound, and the next step
        may be waiting for exactly its groups."""
        if self.version == 0 or (self._sync is not None and not self._sync[1].done()):
            return  # version 0 is the checkpoint every actor starts from
        if not self.broadcaster.has_newcomers():
            return
        self._early_sync = self.finish_sync()
        log.info("re-sending the current weights to actors that joined", version=self.version)
        self._sync = (self.version, self.broadcaster.start(self.version, self.engine.state_dict_for_broadcast()))

    def finish_sync(self) -> dict[str, float]:
        """Wait for the transfer in flight, if any, then publish its version as the actors' current one."""
        if self._sync is None:
            return {}
        version, pending = self._sync
        waited = time.perf_counter()
        figures = pending.result()
        self._sync = None
        self.plane.set_version(version)
        return figures | {"version": float(version), "wait_s": time.perf_counter() - waited}

    def _rollout_figures(self, entries: list[ReplayEntry], batch: TrainBatch) -> dict[str, float]:
        staleness = (self.version - 1 - batch.versions[batch.response_mask]).float()
        generate = [e.group.rollout.timings.get("generate", 0.0) for e in entries]
        tokens = int(batch.response_mask.sum())
        rewards = np.concatenate([e.group.rewards for e in entries]).astype(np.float64)
        by_actor = Counter(e.group.rollout.actor_id or "unknown" for e in entries)
        return {
            **{f"groups_from/{actor}": float(n) for actor, n in sorted(by_actor.items())},
            "reward_mean": float(rewards.mean()),  # over every response sampled, also when only pairs are trained
            "reward_std": float(rewards.std(ddof=1)) if rewards.size > 1 else 0.0,
            "staleness_max": float(staleness.max()) if tokens else 0.0,
            "staleness_mean": float(staleness.mean()) if tokens else 0.0,
            "tokens": float(tokens),
            "generate_s_mean": sum(generate) / len(generate),
        }

    def _write(self, record: StepRecord) -> None:
        record.values.update({"step": float(self.version), "version": float(self.version), "time": time.time()})
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with Path(self.metrics_path).open("a") as f:
            f.write(json.dumps(record.values) + "\n")
        v = record.values
        log.info(
            "step",
            step=self.version,
            reward=round(v["rollout/reward_mean"], 3),
            loss=round(v["train/loss"], 4),
            staleness=v["rollout/staleness_max"],
            sync_s=round(v.get("sync/seconds", 0.0), 3),
            step_s=round(v["step/seconds"], 2),
        )
