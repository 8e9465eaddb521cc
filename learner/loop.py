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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import RunConfig, write_resolved
from common.control import ControlPlane, connect
from common.logs import get_logger
from common.replay import ReplayEntry, ReplayReader
from common.wire import Limits
from learner.algorithms import (
    AdvantageInput,
    GlobalCounts,
    LossInput,
    build_advantage,
    build_aggregation,
    build_loss,
    loss_settings,
)
from learner.batch import TrainBatch, collate
from learner.broadcaster import Broadcaster
from learner.dispatcher import Dispatcher
from learner.engine import PolicyEngine, ReferenceModel, split_micro_batches

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
        self.advantage = build_advantage(config.algorithm.advantage, config.algorithm.advantage_options)
        self.loss_options = self._loss_options()
        self.loss = build_loss(config.algorithm.loss, self.loss_options)
        self.aggregate = build_aggregation(config.algorithm.aggregation, config.algorithm.aggregation_options)
        self.reference = self._reference()
        limits = Limits(int(config.transport.max_message_mb * 2**20), len(self.tokenizer))
        self.reader = ReplayReader(self.plane.client, self.plane.keys, limits=limits)
        self.dispatcher = Dispatcher(config, self.plane, lambda text: self.tokenizer(text)["input_ids"])
        self.broadcaster = Broadcaster(config, self.plane)
        self.version = self.plane.version()
        self.metrics_path = config.run_dir / "metrics.jsonl"
        self._idle_s = 0.0
        self._carry: list[ReplayEntry] = []  # recovered entries not yet trained, still pending in the stream

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
        if float(self.loss_options.get("kl_coef", 0.0)) <= 0.0:
            return None
        return ReferenceModel(self.config.model.path, self.config.learner.precision, str(self.engine.device))

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        self.plane.set_version(self.version)
        # Entries read by an earlier learner (same consumer name) and never acknowledged come first.
        self._carry = self.reader.recover()
        log.info("learner started", run=self.config.run.name, steps=self.config.learner.steps, version=self.version)
        for _ in range(self.config.learner.steps):
            self.step()
        log.info("learner finished", run=self.config.run.name, version=self.version)

    def step(self) -> StepRecord:
        record = StepRecord()
        started = time.perf_counter()
        self.dispatcher.release(self.version)
        entries, dropped = self.collect_batch(record)
        batch = collate([e.group for e in entries], self.tokenizer.pad_token_id or 0)
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

    def collect_batch(self, record: StepRecord) -> tuple[list[ReplayEntry], list[str]]:
        """``groups_per_step`` fresh groups; stale and duplicate ones are acknowledged and counted."""
        want = self.config.learner.groups_per_step
        floor = self.version - self.config.staleness.max_staleness
        dropped: list[str] = []
        stale = duplicates = 0
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
            candidates = []
        self._idle_s = time.perf_counter() - waited
        record.values.update({"groups/dropped_stale": stale, "groups/duplicates": duplicates})
        return entries, dropped

    def _admit(self, entry: ReplayEntry, floor: int, in_batch: set[str]) -> str:
        """``ok``, ``duplicate`` (trained before, or already in this batch: a re-issued group's two copies), or
        ``stale`` (a token older than the staleness bound; discarded so that admission releases a replacement)."""
        group_id = entry.group.rollout.group_id
        if group_id in in_batch or self.dispatcher.was_completed(group_id):
            self.dispatcher.note_duplicate(group_id)
            return "duplicate"
        if int(entry.group.rollout.versions.min(initial=self.version)) < floor:
            self.dispatcher.discard([group_id])
            return "stale"
        return "ok"

    # ------------------------------------------------------------------ training

    def train(self, batch: TrainBatch) -> dict[str, float]:
        temperature = self.config.rollout.temperature or 1.0
        tensors = batch.tensors()
        tensors["advantages"] = self.advantage(
            AdvantageInput(rewards=batch.rewards, group_ids=batch.group_ids, response_mask=batch.response_mask)
        ).advantages.float()
        tensors["old_logprobs"] = self._old_logprobs(batch, temperature)
        if self.reference is not None:
            tensors["ref_logprobs"] = self.reference.token_logprobs(batch.input_ids, batch.attention_mask, temperature)
        counts = GlobalCounts.of(batch.response_mask)
        metrics: dict[str, list[float]] = {}

        def loss_fn(engine: PolicyEngine, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            logprobs = engine.token_logprobs(mb["input_ids"], mb["attention_mask"], temperature)
            out = self.loss(
                LossInput(
                    logprobs=logprobs,
                    old_logprobs=mb["old_logprobs"],
                    behaviour_logprobs=mb["behaviour_logprobs"],
                    advantages=mb["advantages"],
                    response_mask=mb["response_mask"],
                    ref_logprobs=mb.get("ref_logprobs"),
                )
            )
            for name, value in out.metrics.items():
                metrics.setdefault(name, []).append(float(value))
            return self.aggregate(out.per_token_loss, mb["response_mask"], counts)

        stats = self.engine.train_step(split_micro_batches(tensors, self.engine.micro_batch_size), loss_fn)
        figures = {"loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr, "seconds": stats.seconds}
        figures.update({name: sum(v) / len(v) for name, v in metrics.items()})
        return figures

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
        if (self.version + 1) % self.config.weight_sync.sync_every:
            self.version += 1
            return {"skipped": 1.0}
        params = self.engine.state_dict_for_broadcast()
        figures = self.broadcaster.sync(self.version + 1, params)
        self.version += 1
        self.plane.set_version(self.version)
        return figures

    def _rollout_figures(self, entries: list[ReplayEntry], batch: TrainBatch) -> dict[str, float]:
        staleness = (self.version - 1 - batch.versions[batch.response_mask]).float()
        generate = [e.group.rollout.timings.get("generate", 0.0) for e in entries]
        tokens = int(batch.response_mask.sum())
        return {
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std()) if batch.rows > 1 else 0.0,
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
