"""The learner: admit prompts, take whole scored groups from the replay stream, train, broadcast.

One step, as a table of contents (:meth:`Learner.step`)::

    release prompt groups (admission control)  ->  collect a batch of fresh groups (drop stale ones)
    ->  advantages (whole batch)  ->  π_old (unless correction = none)  ->  optimizer step (micro-batches)
    ->  record the groups trained  ->  broadcast the new weights, bump the version  ->  metrics.jsonl
    (every ``checkpoint.every`` steps, at the end and on SIGTERM: a checkpoint, :mod:`learner.checkpoint`)

Staleness (DESIGN.md): a group whose oldest token is older than ``v − max_staleness`` is dropped and
counted; admission control makes that rare. Replay entries are acknowledged only after the step that
used them has been applied — with periodic checkpoints, only once a checkpoint holds that step
(:mod:`learner.trained`) — so a learner crash re-reads them, and a resume trains them again.

Resume (``--resume``): the checkpoint's weights, optimizer, KL coefficient and RNGs come back, the groups
trained after it are trained again, metrics.jsonl is cut back to its step (later lines move to
``metrics.discarded.jsonl``) and continues from step N + 1, and the restored weights are sent to the actors
under a bumped restore generation, so that actors holding weights of the discarded steps load them too.
A group sampled by such weights stays a valid off-policy sample: its behaviour log-probs μ travel with
it and π_old/μ corrects it like any stale one; ``rollout/tokens_ahead`` counts its tokens stamped with a
version above the one that trains them.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.config import RunConfig, write_resolved
from common.control import ControlPlane, connect, dead_letter
from common.logs import get_logger, worth_logging
from common.metrics import set_alert
from common.provenance import issue_mismatch
from common.replay import ReplayEntry, ReplayReader
from common.wire import Limits, ScoredGroup, encode_blob
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
from learner.checkpoint import (
    Checkpoint,
    Checkpointer,
    RunState,
    capture_rng,
    complete_checkpoints,
    config_changes,
    config_hash,
    count_lines,
    flat_config,
    open_checkpoint,
    restore_rng,
    set_aside_after,
    truncate_metrics,
)
from learner.dispatcher import Dispatcher
from learner.engine import PolicyEngine, ReferenceModel, reference_precision, split_micro_batches
from learner.health import HealthMonitor, ProcessFacts, scale_lr_schedule
from learner.telemetry import StepTelemetry
from learner.trained import TrainedLog, replay_position

if TYPE_CHECKING:
    from learner.critic import ValueEngine

log = get_logger("learner")
RECOVER_MAX = 100_000
"""Most pending replay entries taken back at start (trained since the last checkpoint, or read and not trained)."""


class StepInterrupted(Exception):
    """SIGTERM arrived while the learner waited for a batch: the entries read so far stay pending for the next run."""


@dataclass
class StepRecord:
    """What one step did; one line of metrics.jsonl."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, prefix: str, figures: dict[str, float]) -> None:
        self.values.update({f"{prefix}/{k}": float(v) for k, v in figures.items()})


class Learner:
    def __init__(self, config: RunConfig, redis_url: str, resume: Checkpoint | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.plane = ControlPlane(connect(redis_url), config.run.name)
        write_resolved(config)
        self.plane.publish_config(config)
        self.telemetry = StepTelemetry(self.plane, config)  # /metrics is up while DeepSpeed starts
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
        # The newest version any actor can hold (a resume goes back, actors may still hold the discarded ones):
        # a token stamped above it was not sampled by this run's weights (common/provenance.py).
        self._newest_version = max(self.version, self.broadcaster.newest_version)
        self.metrics_path = config.run_dir / "metrics.jsonl"
        self._idle_s = 0.0
        self._carry: list[ReplayEntry] = []  # recovered entries not yet trained, still pending in the stream
        self._sync: tuple[int, Future[dict[str, float]]] | None = None  # the weight transfer in flight
        self._early_sync: dict[str, float] = {}  # figures of a transfer finished before its step's broadcast
        self._overlap = config.weight_sync.overlap and config.staleness.max_staleness >= 1
        self.checkpointer = Checkpointer(config, self.engine, self.critic, self.tokenizer)
        self.trained = TrainedLog(self.plane, self.reader, defer_acks=config.checkpoint.every > 0)
        self._stop = threading.Event()  # set by SIGTERM: finish the step, save a checkpoint, exit
        self._saved_step: int | None = None  # the step of the last checkpoint saved or resumed from
        self._rewards: list[float] = []  # mean reward of each step since that checkpoint (ranks it for keep_best)
        self._resumed: dict[str, float] = {}  # restore/* figures for the first metrics line after a resume
        self._retrain: dict[str, str] = {}  # group -> entry of groups a resume trains again
        self.health = HealthMonitor.for_run(config, checkpoints=_Rollback(self), set_alert=set_alert)
        self._refused = 0  # groups refused by provenance since this learner started
        self._lost: set[str] = set()  # processes whose heartbeat expired, ever (ProcessFacts counts are cumulative)
        self._dead_at_start = self.plane.queue_depths()["dead_letters"]
        if resume is not None:
            self._restore(resume)
        elif complete_checkpoints(self.checkpointer.root):
            log.warning(
                "the run has checkpoints, but this learner starts from model.path",
                checkpoints=self.checkpointer.root,
                action="stop it and pass --resume latest to continue from the last checkpoint",
            )

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
        return ReferenceModel(self.config.model.path, reference_precision(self.config), str(self.engine.device))

    def _critic(self) -> ValueEngine | None:
        if "values" not in self.needs:
            return None
        from learner.critic import ValueEngine

        return ValueEngine(self.config)

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        """Train until step ``learner.steps`` (or SIGTERM), saving checkpoints on the way and at the end."""
        self.plane.set_version(self.version)
        self._recover_pending()
        if self._resumed:
            self._resend_weights()
        log.info("learner started", run=self.config.run.name, steps=self.config.learner.steps, version=self.version)
        previous = self._stop_on_sigterm()
        try:
            every = self.config.checkpoint.every
            while self.version < self.config.learner.steps and not self._stop.is_set():
                try:
                    self.step()
                except StepInterrupted:
                    break
                if every and self.version % every == 0:
                    self.save_checkpoint("every")
            self.finish_sync()
            self.save_checkpoint("sigterm" if self._stop.is_set() else "end")
        finally:
            self.broadcaster.close()
            self.health.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        log.info("learner finished", run=self.config.run.name, version=self.version, stopped=self._stop.is_set())

    def _stop_on_sigterm(self) -> signal.Handlers | None:
        """SIGTERM sets :attr:`_stop`: the step in progress finishes (a wait for a batch ends at once), a checkpoint
        is saved and :meth:`run` returns. Returns the handler it replaced (None off the main thread: no handler)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum: int, frame: object) -> None:
            log.info(
                "SIGTERM: stopping after the step in progress (a wait for a batch ends now), then saving a checkpoint",
                step=self.version + 1,
            )
            self._stop.set()

        return signal.signal(signal.SIGTERM, handler)

    def step(self) -> StepRecord:
        record = StepRecord()
        started = time.perf_counter()
        self.dispatcher.release(self.version)
        entries, dropped = self.collect_batch(record)
        batch = self._collate([e.group for e in entries])
        record.add("train", self.train(batch))
        self.trained.record(self.version + 1, entries, dropped)  # acknowledged now, or once a checkpoint holds it
        self.dispatcher.complete([e.group.rollout.group_id for e in entries])
        record.add("sync", self.broadcast())
        record.add("rollout", self._rollout_figures(entries, batch))
        record.values["step/seconds"] = time.perf_counter() - started
        record.values["step/idle_fraction"] = self._idle_s / max(record.values["step/seconds"], 1e-9)
        if self._resumed:
            record.add("restore", self._resumed)
            self._resumed = {}
        self._rewards.append(record.values["rollout/reward_mean"])
        queues, processes = self.plane.queue_depths(), self.plane.processes()  # once a step, for health and metrics
        record.add("health", self.health.observe(self.version, record.values, self._process_facts(queues, processes)))
        self._write(record)
        self.telemetry.publish(record.values, queues, processes)
        self.plane.set_alerts(self.health.active_alerts())
        self.health.roll_back_if_due()  # after the row: a rollback cuts metrics.jsonl back to its checkpoint
        return record

    def _process_facts(self, queues: dict[str, int], processes: tuple) -> ProcessFacts:
        _, lost = processes
        self._lost.update(lost)
        dead = queues["dead_letters"] - self._dead_at_start
        return ProcessFacts(actors_lost=len(self._lost), reward_errors=max(0, dead))

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
        stale = duplicates = zero_variance = refused = 0
        waited = time.perf_counter()
        entries: list[ReplayEntry] = []
        candidates, self._carry = self._carry, []
        while len(entries) < want:
            if not candidates:
                if self._stop.is_set():
                    self.reader.ack(dropped)  # decided (discarded or duplicate); the admitted stay pending
                    raise StepInterrupted
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
                refused += verdict == "refused"
                zero_variance += verdict == "zero_variance"
            candidates = []
        self._idle_s = time.perf_counter() - waited
        record.values.update(
            {
                "groups/dropped_stale": stale,
                "groups/duplicates": duplicates,
                "groups/zero_variance": zero_variance,
                "groups/refused": refused,
            }
        )
        return entries, dropped

    def _admit(self, entry: ReplayEntry, floor: int, in_batch: set[str]) -> str:
        """``ok``, ``duplicate`` (trained before, or already in this batch: a re-issued group's two copies),
        ``refused`` (it does not match what was issued under its id: dead-lettered, the id stays in flight),
        ``stale`` (a token older than the staleness bound), or ``zero_variance`` (equal rewards, with dynamic
        sampling on). Stale and zero-variance groups are discarded, so that admission releases replacements."""
        group_id = entry.group.rollout.group_id
        if group_id in in_batch or self.dispatcher.was_completed(group_id):
            self.dispatcher.note_duplicate(group_id)
            return "duplicate"
        if group_id not in self._retrain:  # a group trained again after a resume was checked when first trained
            reason = issue_mismatch(
                self.dispatcher.issued(group_id),
                entry.group.rollout,
                self.config.rollout.max_new_tokens,
                self._newest_version,
            )
            if reason is not None:
                self._refuse(entry, reason)
                return "refused"
        if int(entry.group.rollout.versions.min(initial=self.version)) < floor:
            self.dispatcher.discard([group_id])
            return "stale"
        if self.config.algorithm.dynamic_sampling and len(set(entry.group.rewards.tolist())) == 1:
            self.dispatcher.discard([group_id])  # DAPO's dynamic sampling: no signal; admission releases another
            return "zero_variance"
        return "ok"

    def _refuse(self, entry: ReplayEntry, reason: str) -> None:
        """Dead-letter a group that does not answer what was issued under its id; log the 1st, 10th, 100th, …"""
        rollout = entry.group.rollout
        dead_letter(self.plane.client, self.plane.keys, "learner:refused", reason, encode_blob(entry.group))
        self._refused += 1
        if worth_logging(self._refused):
            log.warning(
                "refused a scored group that does not match its issue record",
                group=rollout.group_id[:80],
                actor=rollout.actor_id[:80],
                scorer=entry.group.scorer_id[:80],
                reason=reason,
                refused=self._refused,
                action=f"a peer that is not one of this run's actors may be sending to the reward workers; "
                f"inspect with XRANGE {self.plane.keys.dead} - +; bind beyond loopback only with CURVE keys",
            )

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
        figures["applied"] = float(stats.applied)  # False: a non-finite step was skipped (learner/health.py)
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
        self._newest_version = max(self._newest_version, self.version)
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

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, reason: str) -> Path | None:
        """Save ``step-<N>``, then acknowledge the replay entries it holds. None when no step was trained since the
        last checkpoint (or since this learner started: a learner that trained nothing has nothing of its own)."""
        if not self._rewards or self._saved_step == self.version or not self.health.healthy:
            return None  # nothing new, or non-finite steps pending (their weights may be the cause)
        state = RunState(
            step=self.version,
            version=self.version,
            kl_coef=self.kl_control.coef,
            rng=capture_rng(),
            config_hash=config_hash(self.config),
            config=flat_config(self.config),
            dispatch=self.plane.dispatch_counts(),
            replay=replay_position(self.reader),
            metrics_lines=count_lines(self.metrics_path),
            reward_mean=sum(self._rewards) / len(self._rewards) if self._rewards else None,
            restore=self.broadcaster.restore,
            reason=reason,
        )
        path = self.checkpointer.save(state)
        self.trained.commit(self.version)
        self._saved_step, self._rewards = self.version, []
        return path

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Go back to ``checkpoint``: engines, KL coefficient, RNGs and step from it; in Redis, the groups trained
        after it become untrained (:meth:`TrainedLog.rewind`); metrics.jsonl is cut back to its step."""
        started = time.perf_counter()
        state = self.checkpointer.load(checkpoint)
        if state.config_hash != config_hash(self.config):
            changes = "; ".join(config_changes(state.config, self.config)) or "(fields renamed or added)"
            log.warning("resuming with other training settings than the checkpoint's", changes=changes)
        self.version = state.version
        self.kl_control = KLController(self.kl_control.settings, state.kl_coef)
        self.dispatcher.adopt(state.dispatch, state.step)
        rewind = self.trained.rewind(state.step)
        kept, moved = truncate_metrics(self.metrics_path, state.step)
        set_aside_after(self.checkpointer.root, state.step)
        self.broadcaster.restore += 1  # actors holding weights of the discarded steps load the restored ones
        restore_rng(state.rng)
        self._saved_step, self._retrain = state.step, rewind.retrain
        self._resumed = {
            "from_step": float(state.step),
            "retrained": float(len(rewind.retrain)),
            "lost": float(len(rewind.lost)),
            "seconds": time.perf_counter() - started,
        }
        log.info(
            "resumed from checkpoint",
            path=checkpoint.path,
            step=state.step,
            bytes=checkpoint.bytes,
            retrain=len(rewind.retrain),
            lost=len(rewind.lost),
            acknowledged=rewind.committed,
            metrics_kept=kept,
            metrics_discarded=moved,
            seconds=round(self._resumed["seconds"], 3),
        )

    def _recover_pending(self) -> None:
        """Entries this consumer read and never acknowledged come first: an earlier learner's (same consumer name),
        or, after a restore, the groups it trains again (XREADGROUP ``>`` would never return them)."""
        self._carry = self.reader.recover(count=RECOVER_MAX)
        if self._retrain:
            recovered = {e.group.rollout.group_id for e in self._carry}
            self.trained.forget_missing(g for g in self._retrain if g not in recovered)

    def _resend_weights(self) -> None:
        """After a resume, actors hold weights of the discarded steps (or none): send them the restored ones now."""
        self._sync = (self.version, self.broadcaster.start(self.version, self.engine.state_dict_for_broadcast()))

    def _rollout_figures(self, entries: list[ReplayEntry], batch: TrainBatch) -> dict[str, float]:
        staleness = (self.version - 1 - batch.versions[batch.response_mask]).float()
        generate = [e.group.rollout.timings.get("generate", 0.0) for e in entries]
        tokens = int(batch.response_mask.sum())
        rewards = np.concatenate([e.group.rewards for e in entries]).astype(np.float64)
        by_actor = Counter(e.group.rollout.actor_id or "unknown" for e in entries)
        return {
            **{f"groups_from/{actor}": float(n) for actor, n in sorted(by_actor.items())},
            "tokens_ahead": float((staleness[staleness < 0]).numel()),  # sampled by weights a resume discarded
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


class _Rollback:
    """:class:`learner.health.Checkpoints` over a :class:`Learner`: a rollback is a resume from an older checkpoint
    (the same :meth:`Learner._restore`, so later checkpoints are set aside and the actors reload), then a lower lr."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner

    def restore_latest_healthy(self, before_step: int) -> int:
        root = self.learner.checkpointer.root
        older = [(step, path) for step, path in complete_checkpoints(root) if step < before_step]
        if not older:
            raise LookupError(f"no checkpoint before step {before_step} in {root}")
        self.learner.finish_sync()  # the transfer in flight carries weights the restore discards
        self.learner._restore(open_checkpoint(older[-1][1]))
        self.learner._recover_pending()
        self.learner._resend_weights()
        return older[-1][0]

    def set_lr_factor(self, factor: float) -> None:
        scheduler = self.learner.engine.engine.lr_scheduler
        scale_lr_schedule(scheduler, [self.learner.config.learner.lr], factor)
