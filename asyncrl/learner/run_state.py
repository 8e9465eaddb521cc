"""The run's position — its policy version — and everything that saves, restores or rolls it back.

:class:`RunState` owns the version (optimizer steps applied; the step being trained is ``version + 1``) and the
checkpoints of it (:mod:`asyncrl.learner.checkpoint.checkpointer` writes the files,
:mod:`asyncrl.learner.checkpoint.format` verifies them):

- :meth:`RunState.save` writes ``step-<N>`` and then acknowledges the replay entries it covers;
- :meth:`RunState.restore` goes back to a checkpoint: the engines' weights, optimizer and KL coefficient, the
  RNGs and the step from it; in Redis the groups trained after it become untrained (:meth:`BatchSource.rewind`);
  metrics.jsonl is cut back to its step; the actors are sent the restored weights under a bumped restore
  generation;
- for health (:class:`asyncrl.learner.health.monitor.Checkpoints`), :meth:`RunState.restore_latest_healthy` is a restore
  from the newest checkpoint before a non-finite streak, and :meth:`RunState.set_lr_factor` lowers the lr through the
  scheduler's public API.

Each checkpoint written, verified (before a restore), restored or rolled back to is an event of the audit trail
(``checkpoint.*``, recorded by rank 0 with the manifest's sha256 as the checkpoint's digest).
"""

from __future__ import annotations

import time
from pathlib import Path

from asyncrl.common.config import RunConfig
from asyncrl.common.observability.logs import get_logger
from asyncrl.common.plane.audit import Audit
from asyncrl.learner import dist, ranks
from asyncrl.learner.checkpoint.checkpointer import Checkpointer
from asyncrl.learner.checkpoint.format import (
    Checkpoint,
    SavedState,
    capture_rng,
    manifest_digest,
    open_checkpoint,
    restore_rng,
)
from asyncrl.learner.checkpoint.history import complete_checkpoints, count_lines, set_aside_after, truncate_metrics
from asyncrl.learner.checkpoint.settings import config_changes, config_hash, flat_config
from asyncrl.learner.health.monitor import scale_lr_schedule
from asyncrl.learner.intake.batch_source import BatchSource
from asyncrl.learner.update.policy import PolicyUpdate
from asyncrl.learner.weights.broadcaster import Broadcaster

log = get_logger("learner")


class RunState:
    """The version of one run and its checkpoints; see the module docstring."""

    def __init__(
        self,
        config: RunConfig,
        version: int,
        update: PolicyUpdate,
        batches: BatchSource,
        broadcaster: Broadcaster,
        metrics_path: Path,
        tokenizer,
        audit: Audit | None = None,
    ) -> None:
        self.config = config
        self.audit = audit
        self.version = version
        self.update = update
        self.batches = batches
        self.broadcaster = broadcaster
        self.metrics_path = metrics_path
        self.checkpointer = Checkpointer(config, update.engine, update.critic, tokenizer)
        self._saved_step: int | None = None  # the step of the last checkpoint saved or resumed from
        self._rewards: list[float] = []  # mean reward of each step since that checkpoint (ranks it for keep_best)
        self._resumed: dict[str, float] = {}  # restore/* figures for the first metrics line after a resume

    def advance(self, reward_mean: float) -> int:
        """One step was applied (its batch's mean reward); returns the new version."""
        self.version += 1
        self._rewards.append(reward_mean)
        self.batches.published(self.version)
        return self.version

    def take_resumed(self) -> dict[str, float]:
        """The ``restore/*`` figures of the last resume, once (for the first metrics line after it)."""
        figures, self._resumed = self._resumed, {}
        return figures

    @property
    def resumed(self) -> bool:
        """A resume happened and its first step is still to come."""
        return bool(self._resumed)

    # ------------------------------------------------------------------ save

    def save(self, reason: str, healthy: bool = True) -> Path | None:
        """Save ``step-<N>``, then acknowledge the replay entries it holds. None when no step was trained since the
        last checkpoint (or since this learner started: a learner that trained nothing has nothing of its own), or
        when non-finite steps are pending (their weights may be the cause)."""
        if not self._rewards or self._saved_step == self.version or not healthy:
            return None
        position = self.batches.position()
        state = SavedState(
            step=self.version,
            version=self.version,
            kl_coef=self.update.kl_control.coef,
            rng=capture_rng(),
            config_hash=config_hash(self.config),
            config=flat_config(self.config),
            dispatch=position["dispatch"],
            replay=position["replay"],
            metrics_lines=count_lines(self.metrics_path),
            reward_mean=sum(self._rewards) / len(self._rewards),
            restore=self.broadcaster.restore,
            reason=reason,
        )
        path = self.checkpointer.save(state)
        self._audit("checkpoint.written", path, step=state.step, reason=reason, config_hash=state.config_hash)
        self.batches.commit(self.version)
        self._saved_step, self._rewards = self.version, []
        return path

    # ------------------------------------------------------------------ restore

    def restore(self, checkpoint: Checkpoint) -> None:
        """Go back to ``checkpoint`` (see the module docstring); the weights are re-sent by :meth:`resume`."""
        started = time.perf_counter()
        self._audit("checkpoint.verified", checkpoint.path, step=checkpoint.state.step)  # by open_checkpoint
        state = self.checkpointer.load(checkpoint)
        if state.config_hash != config_hash(self.config):
            changes = "; ".join(config_changes(state.config, self.config)) or "(fields renamed or added)"
            log.warning("resuming with other training settings than the checkpoint's", changes=changes)
        self.version = state.version
        self.update.restore_kl_coef(state.kl_coef)
        rewind = self.batches.rewind(state.dispatch, state.step)
        kept, moved = truncate_metrics(self.metrics_path, state.step)
        truncate_metrics(self.metrics_path.with_name("samples.jsonl"), state.step)
        set_aside_after(self.checkpointer.root, state.step)
        self.broadcaster.restore += 1  # actors holding weights of the discarded steps load the restored ones
        restore_rng(state.rng)
        self._saved_step, self._rewards = state.step, []
        self._resumed = {
            "from_step": float(state.step),
            "retrained": float(len(rewind.retrain)),
            "lost": float(len(rewind.lost)),
            "seconds": time.perf_counter() - started,
        }
        figures = {"retrained": len(rewind.retrain), "lost": len(rewind.lost), "restore": self.broadcaster.restore}
        self._audit("checkpoint.restored", checkpoint.path, step=state.step, **figures)
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

    def resume(self) -> None:
        """After a restore (or at start): the pending replay entries first, and the restored weights to the actors."""
        self.batches.recover()
        if self._resumed:
            self.broadcaster.resend(self.version, self.update.params)

    # ------------------------------------------------------------------ health's Checkpoints protocol

    def restore_latest_healthy(self, before_step: int) -> int:
        """A rollback: a resume from the newest checkpoint before ``before_step`` (later ones are set aside and the
        actors reload); returns its step."""
        root = self.checkpointer.root
        older = [(step, path) for step, path in complete_checkpoints(root) if step < before_step]
        if not older:
            raise LookupError(f"no checkpoint before step {before_step} in {root}")
        self.broadcaster.finish()  # the transfer in flight carries weights the restore discards
        self.restore(open_checkpoint(older[-1][1]))
        self.resume()
        self._audit("checkpoint.rolled_back", older[-1][1], step=older[-1][0], non_finite_from=before_step)
        return older[-1][0]

    def _audit(self, event: str, folder: Path, **fields) -> None:
        """One ``checkpoint.*`` event about ``folder`` (rank 0), with its files, bytes and manifest sha256."""
        if self.audit is None or dist.rank() != 0:
            return
        try:
            fields |= manifest_digest(folder)
        except (OSError, ValueError, KeyError) as exc:  # recorded without the digest rather than not at all
            fields["digest_error"] = str(exc)
        self.audit.record(event, path=str(folder), **fields)

    def set_lr_factor(self, factor: float) -> None:
        ranks.lead("lr", factor)
        scheduler = self.update.engine.engine.lr_scheduler
        scale_lr_schedule(scheduler, [self.config.learner.lr], factor)
