"""Offline DPO: train the policy on a file of preference pairs, with a frozen reference. No Redis, no actors.

One step, as a table of contents (:meth:`OfflineDPOTrainer.step`)::

    next ``data.batch_pairs`` pairs (shuffled per epoch)  ->  [2P, T] rows, chosen/rejected adjacent
    ->  log π_ref (frozen reference, no grad)  ->  optimizer step on micro-batches of whole pairs
    ->  metrics.jsonl line + log line

The loss is whatever ``algorithm.loss`` names — the ``dpo`` preset (``configs/dpo.toml``) picks the registered
pairwise ``dpo`` loss (Rafailov et al. 2023) with ``seq_mean_token_sum`` aggregation — built through the same
registries as the online learner, so this module never branches on an algorithm. The loss receives the current
log-probs, the reference's, and the response mask; the fields a pairwise loss does not read (π_old, μ, advantages)
are filled with the current log-probs (detached) and zeros.

Data parallel: every rank draws the same shuffled order (``run.seed``) and takes pairs ``rank::world`` of each
step's batch; counts and metrics are all-reduced, and only rank 0 writes files. The run ends after ``data.epochs``
passes or ``learner.steps`` steps, whichever comes first. Nothing but ``config.json`` and ``metrics.jsonl`` is
written (checkpoints are not handled here).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from asyncrl.common.config import ConfigError, RunConfig, write_resolved
from asyncrl.common.observability.logs import get_logger
from asyncrl.learner import dist
from asyncrl.learner.algorithms import GlobalCounts, LossInput, Need
from asyncrl.learner.algorithms.assembly import assemble
from asyncrl.learner.intake.preferences import (
    EncodedPair,
    PreferenceFileError,
    collate_pairs,
    encode_pairs,
    read_preferences,
)
from asyncrl.learner.update.batch import split_micro_batches
from asyncrl.learner.update.engine import Batch, PolicyEngine, reference_for

log = get_logger("dpo")


class OfflineDPOTrainer:
    """Preference pairs from ``data.path`` → DeepSpeed policy steps against a frozen reference of ``model.path``."""

    def __init__(self, config: RunConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        # Data and algorithm first: a bad file or option fails in seconds, before DeepSpeed starts.
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.pairs = encode_pairs(read_preferences(config.data.path), self.tokenizer, config.model.max_model_len)
        if not self.pairs:
            raise PreferenceFileError(f"{config.data.path}: no pair fits model.max_model_len")
        self.algorithm = assemble(config)  # the same registries and checks as the online learner
        if Need.PAIRS not in self.algorithm.needs:
            raise ConfigError(
                f"data.source = 'preferences' trains on preference pairs, but algorithm.loss = "
                f"{config.algorithm.loss!r} is not a pairwise loss; use the dpo preset (configs/dpo.toml)"
            )
        self.engine = PolicyEngine(config, global_batch=2 * config.data.batch_pairs)
        self.reference = reference_for(self.engine)
        # Micro-batches of whole pairs: an even number of rows, at least one pair.
        self.micro_rows = 2 * max(1, self.engine.micro_batch_size // 2)
        self.rank, self.world = dist.rank(), dist.world_size()
        self.metrics_path = config.run_dir / "metrics.jsonl"
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._loss_metric_names: list[str] = []

    # ------------------------------------------------------------------ the run

    def run(self) -> list[dict[str, float]]:
        """Train until the data or ``learner.steps`` runs out; return every step's metrics (as written)."""
        if self.rank == 0:
            write_resolved(self.config)
            self.metrics_path.write_text("")  # no resume yet: a run's metrics start afresh
        log.info("offline dpo started", run=self.config.run.name, pairs=len(self.pairs), steps=self.planned_steps())
        records = []
        for step, (epoch, pairs) in enumerate(self.schedule(), start=1):
            record = {"step": float(step), "epoch": float(epoch), **self.step(pairs)}
            records.append(record)
            self._write(record)
        log.info("offline dpo finished", run=self.config.run.name, steps=len(records))
        return records

    def planned_steps(self) -> int:
        """Optimizer steps this run will take: all epochs, capped by ``learner.steps``."""
        per_epoch = sum(1 for _ in self._epoch_batches(list(range(len(self.pairs)))))
        return min(self.config.learner.steps, per_epoch * self.config.data.epochs)

    def schedule(self) -> Iterator[tuple[int, list[EncodedPair]]]:
        """``(epoch, this rank's pairs)`` of every step: a fresh seeded shuffle each epoch, ``batch_pairs`` per step."""
        rng = random.Random(self.config.run.seed)
        taken = 0
        for epoch in range(self.config.data.epochs):
            order = list(range(len(self.pairs)))
            rng.shuffle(order)
            for indices in self._epoch_batches(order):
                if taken == self.config.learner.steps:
                    return
                taken += 1
                yield epoch, [self.pairs[i] for i in indices[self.rank :: self.world]]

    def _epoch_batches(self, order: list[int]) -> Iterator[list[int]]:
        """Consecutive ``batch_pairs`` slices of ``order``; a last slice too short to give every rank a pair is
        dropped (a rank with no micro-batch could not join the step)."""
        size = self.config.data.batch_pairs
        for start in range(0, len(order), size):
            if len(order[start : start + size]) >= self.world:
                yield order[start : start + size]

    # ------------------------------------------------------------------ one step

    def step(self, pairs: Sequence[EncodedPair]) -> dict[str, float]:
        """One optimizer step on this rank's ``pairs``; returns the step's metrics (global over ranks)."""
        started = time.perf_counter()
        tensors = collate_pairs(pairs, self.pad_id)
        tensors["ref_logprobs"] = self._reference_logprobs(tensors)
        local = GlobalCounts.of(tensors["response_mask"])
        counts = GlobalCounts(int(dist.all_reduce_sum(local.tokens)), int(dist.all_reduce_sum(local.sequences)))
        sums: dict[str, float] = {}

        def loss_fn(engine: PolicyEngine, micro_batch: Batch) -> Tensor:
            logprobs = engine.token_logprobs(micro_batch["input_ids"], micro_batch["attention_mask"])
            current = logprobs.detach()
            out = self.algorithm.loss(
                LossInput(
                    logprobs=logprobs,
                    old_logprobs=current,
                    behaviour_logprobs=current,
                    advantages=torch.zeros_like(current),
                    response_mask=micro_batch["response_mask"],
                    ref_logprobs=micro_batch["ref_logprobs"],
                )
            )
            rows = len(micro_batch["input_ids"])  # metrics are micro-batch means: weight them by rows
            for name, value in out.metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value) * rows
            return self.algorithm.aggregate(out.per_token_loss, micro_batch["response_mask"], counts)

        stats = self.engine.train_step(split_micro_batches(tensors, self.micro_rows), loss_fn)
        rows = dist.all_reduce_sum(len(tensors["input_ids"]))
        figures = {f"train/{name}": dist.all_reduce_sum(total) / rows for name, total in sorted(sums.items())}
        self._loss_metric_names = list(figures)  # the loss's own metrics, e.g. dpo/reward_margin: in the log line
        figures |= {"train/loss": stats.loss, "train/grad_norm": stats.grad_norm, "train/lr": stats.lr}
        figures |= {"train/seconds": stats.seconds, "train/pairs": rows / 2, "train/tokens": float(counts.tokens)}
        figures["step/seconds"] = time.perf_counter() - started
        return figures

    def _reference_logprobs(self, tensors: Batch) -> Tensor:
        """``[2P, T]`` log π_ref on CPU, computed in micro-batches so no pass is larger than a training one."""
        parts = [
            self.reference.token_logprobs(mb["input_ids"], mb["attention_mask"]).cpu()
            for mb in split_micro_batches(tensors, self.micro_rows)
        ]
        return torch.cat(parts)

    # ------------------------------------------------------------------ output

    def _write(self, record: dict[str, float]) -> None:
        """Append the step's line to metrics.jsonl (rank 0) and log a one-line summary."""
        if self.rank != 0:
            return
        record["time"] = time.time()
        with Path(self.metrics_path).open("a") as f:
            f.write(json.dumps(record) + "\n")
        loss_metrics = {name.removeprefix("train/"): round(record[name], 4) for name in self._loss_metric_names}
        log.info(
            "step",
            step=int(record["step"]),
            epoch=int(record["epoch"]),
            loss=round(record["train/loss"], 4),
            **loss_metrics,
            grad_norm=round(record["train/grad_norm"], 4),
            step_s=round(record["step/seconds"], 2),
        )
