"""Run health: skip a non-finite step, roll back after repeated ones, and raise alerts on each step's metrics.

Three parts, each usable alone (none needs Redis or DeepSpeed):

- **Non-finite guard** (:func:`step_is_finite`, :func:`gradients_finite`, :func:`non_finite_skip`). A NaN or inf in the
  loss or a gradient must never reach the weights: Adam would spread it into every parameter it touches, and the run
  could not recover without a restore. DeepSpeed's ZeRO 1–3 and bf16/fp16 optimizers already skip a step whose gradient
  norm is not finite (``was_step_applied()`` is then False; measured with DeepSpeed 0.19.8 for ZeRO 1, 2, 3 in float32
  and ZeRO 0, 2 in bf16); the bare torch optimizer of ZeRO 0 in float32 does not, so
  :meth:`asyncrl.learner.update.engine.PolicyEngine.train_step` skips it itself, on a non-finite loss or norm. (A
  non-finite loss whose gradients are all finite — rare — is still applied by the DeepSpeed optimizers.)
- **Rollback** (:class:`RollbackPolicy`). One skipped step is noise; ``max_skipped_steps`` in a row mean the weights
  themselves now produce them (an earlier step went too far), so the run goes back to the last healthy checkpoint at
  a lower learning rate (through the :class:`Checkpoints` protocol). After ``max_rollbacks`` the run stops.
- **Alerts** (:mod:`asyncrl.learner.health.alerts`): rules over a metrics.jsonl row plus facts only the loop knows, and
  their transitions; :class:`HealthMonitor` feeds them each step and raises ``non_finite`` and ``rolled_back`` itself.

The loop calls :meth:`HealthMonitor.observe` once a step with the step's row, and
:meth:`HealthMonitor.roll_back_if_due` once the row is written; see their docstrings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.common.config import HealthSection, RunConfig
from asyncrl.common.observability.logs import get_logger
from asyncrl.learner.health.alerts import Alerts, Check, ProcessFacts, Row, SetAlert, build_rules

if TYPE_CHECKING:
    import torch

log = get_logger("health")


# --------------------------------------------------------------------------- non-finite guard


def step_is_finite(loss: float, grad_norm: float | None = None) -> bool:
    """True when the step's loss and (if known) its global gradient norm are finite numbers.

    The norm is a sufficient check of every gradient: a NaN or inf anywhere makes the L2 norm NaN or inf (and a
    finite gradient whose norm overflows is no safer to apply). Both values must be the same on every rank — the
    all-reduced loss and the global norm are — so every rank takes the same decision.
    """
    return math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))


def gradients_finite(parameters: torch.nn.Module | Iterable[torch.Tensor]) -> bool:
    """True when every ``.grad`` of ``parameters`` (a module's, or an iterable of tensors) is finite; None grads
    count as finite. Local: under ZeRO 1–3 a rank holds only some gradients, so all-reduce the answer (or use the
    global norm with :func:`step_is_finite`) before acting on it. One device sync, whatever the parameter count."""
    import torch  # here, not at the top: the rest of this module is light enough for a CLI or a monitor to import

    params = parameters.parameters() if isinstance(parameters, torch.nn.Module) else parameters
    flags = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    return bool(torch.stack(flags).all()) if flags else True


def non_finite_skip(loss: float, grad_norm: float, applied: bool, *, fp16: bool = False) -> bool:
    """True when a step was skipped because of a non-finite loss or gradient: the kind that counts to a rollback.

    A step that was applied never counts. Under float16, DeepSpeed's dynamic loss scaler also skips steps whose
    *scaled* gradients overflow (it halves the scale and goes on; several in a row are normal at the start), so
    there only a non-finite loss counts.
    """
    if applied:
        return False
    if not math.isfinite(loss):
        return True
    return not fp16 and not math.isfinite(grad_norm)


# --------------------------------------------------------------------------- rollback


class Checkpoints(Protocol):
    """What a rollback needs from the checkpoint side (``learner/run_state.py: RunState`` provides it)."""

    def restore_latest_healthy(self, before_step: int) -> int:
        """Load the newest checkpoint whose step is below ``before_step`` (weights, optimizer, scheduler) into the
        engines and return its step; raise :class:`LookupError` when there is none.

        ``before_step`` is the version whose weights produced the first non-finite step of the streak. A skipped step
        leaves the weights as they were, so every checkpoint from that version on holds those suspect weights; the
        one before was trained from successfully. (Step 0 may stand for the initial model.)"""
        ...

    def set_lr_factor(self, factor: float) -> None:
        """From now on train at ``factor`` × the configured schedule's lr. ``factor`` is absolute (the product of
        every rollback's factor so far), not relative to the previous call; :func:`scale_lr_schedule` does it."""
        ...


class TrainingDivergedError(RuntimeError):
    """The run keeps producing non-finite steps and rollbacks did not help; the message says what to try."""


@dataclass
class RollbackPolicy:
    """Counts consecutive non-finite skipped steps; at ``max_skipped`` a rollback with ``lr_factor`` more is due.

    The learning rate after ``r`` rollbacks is ``lr_factor ** r`` × the schedule. A healthy (applied) step resets the
    count. More than ``max_rollbacks`` rollbacks, or none possible (no checkpoints), raise
    :class:`TrainingDivergedError`: carrying on would only skip every step. Steps are numbered as in metrics.jsonl:
    step ``k`` trains the weights of version ``k − 1``.
    """

    max_skipped: int
    lr_factor: float
    max_rollbacks: int
    checkpoints: Checkpoints | None = None
    skipped_in_a_row: int = 0
    rollbacks: int = 0
    lr_scale: float = 1.0
    """Product of the factors of the rollbacks so far (what the lr is multiplied by)."""
    first_skipped: int = 0
    """Step of the current streak's first skipped step (0: no streak)."""

    @property
    def healthy(self) -> bool:
        """False while skipped steps are pending: a checkpoint saved now would not be a healthy one."""
        return self.skipped_in_a_row == 0

    @property
    def due(self) -> bool:
        """``max_skipped`` steps in a row were skipped: :meth:`roll_back` now."""
        return self.skipped_in_a_row >= self.max_skipped

    def observe(self, skipped: bool, step: int) -> bool:
        """Record step ``step``; whether a rollback is now due."""
        if not skipped:
            self.skipped_in_a_row, self.first_skipped = 0, 0
            return False
        self.skipped_in_a_row += 1
        self.first_skipped = self.first_skipped or step
        return self.due

    def roll_back(self) -> int:
        """Restore the last healthy checkpoint and lower the lr; its step. Raises :class:`TrainingDivergedError` when
        the rollbacks are used up or there is nothing to restore."""
        advice = "lower learner.lr, raise learner.warmup_steps, check the loss options and samples.jsonl"
        if self.rollbacks >= self.max_rollbacks:
            raise TrainingDivergedError(
                f"{self.skipped_in_a_row} non-finite steps in a row after {self.rollbacks} rollbacks "
                f"(health.max_rollbacks = {self.max_rollbacks}): the run diverges; {advice}"
            )
        if self.checkpoints is None:
            raise TrainingDivergedError(
                f"{self.skipped_in_a_row} non-finite steps in a row and no checkpoints to roll back to; {advice}"
            )
        try:
            step = self.checkpoints.restore_latest_healthy(self.first_skipped - 1)
        except LookupError as exc:
            raise TrainingDivergedError(
                f"{self.skipped_in_a_row} non-finite steps in a row and no healthy checkpoint ({exc}); "
                f"set checkpoint.every so there is one to go back to, and {advice}"
            ) from exc
        self.rollbacks += 1
        self.lr_scale *= self.lr_factor
        self.checkpoints.set_lr_factor(self.lr_scale)  # after the restore, which loads the saved scheduler
        self.skipped_in_a_row, self.first_skipped = 0, 0
        return step


def scale_lr_schedule(scheduler: Any, peak_lrs: Sequence[float], factor: float) -> None:
    """Make a torch LR scheduler follow ``factor`` × its schedule from ``peak_lrs`` (the configured lr per param
    group), starting with the current step: a tool for :meth:`Checkpoints.set_lr_factor`.

    Rescales ``scheduler.base_lrs`` (which LambdaLR-style schedules multiply) and the optimizer's current lr by the
    same ratio — public attributes only, so ``get_last_lr()`` reports the new lr from the next ``scheduler.step()``
    on. The new base lrs are part of the scheduler's state dict, so a checkpoint saved afterwards keeps the factor;
    loading an older checkpoint restores its own (call this after a restore, not before).
    """
    groups = scheduler.optimizer.param_groups
    if len(peak_lrs) != len(groups):
        raise ValueError(f"{len(peak_lrs)} peak lrs for {len(groups)} parameter groups")
    for index, (group, peak) in enumerate(zip(groups, peak_lrs, strict=True)):
        old, new = scheduler.base_lrs[index], peak * factor
        group["lr"] = group["lr"] * new / old if old else new
        scheduler.base_lrs[index] = new


# --------------------------------------------------------------------------- the monitor


class HealthMonitor:
    """Everything above for one learner: :meth:`observe` each step, then :meth:`roll_back_if_due` once its row is
    written; :meth:`close` at the end.

    ``set_alert(name, active)`` is called for every rule at start (False, so the gauge exists) and on every
    transition; ``checkpoints`` makes rollbacks possible (without it, ``max_skipped_steps`` non-finite steps in a row
    stop the run). ``fp16``: the run trains in float16 (see :func:`non_finite_skip`).
    """

    def __init__(
        self,
        settings: HealthSection,
        *,
        groups_per_step: int,
        run: str = "",
        fp16: bool = False,
        checkpoints: Checkpoints | None = None,
        set_alert: SetAlert | None = None,
        synchronous: bool = False,
    ) -> None:
        self.settings = settings
        self.run = run
        self.fp16 = fp16
        self.rollback = RollbackPolicy(
            settings.max_skipped_steps, settings.rollback_lr_factor, settings.max_rollbacks, checkpoints
        )
        self.rules = build_rules(settings, groups_per_step, synchronous)
        names = [rule.name for rule in self.rules] + ["non_finite", "rolled_back"]
        self.alerts = Alerts(names, run, set_alert, settings.webhook_url, settings.webhook_timeout_s)
        self._step = 0  # the step last observed

    @classmethod
    def for_run(cls, config: RunConfig, **kwargs: Any) -> HealthMonitor:
        """The monitor of a run's config (``[health]``, its name, groups per step, precision, whether it is
        synchronous)."""
        fp16 = config.learner.precision == "float16"
        groups, synchronous = config.learner.groups_per_step, config.staleness.max_staleness == 0
        return cls(
            config.health, groups_per_step=groups, run=config.run.name, fp16=fp16, synchronous=synchronous, **kwargs
        )

    def observe(self, step: int, row: Row, facts: ProcessFacts | None = None) -> dict[str, float]:
        """Judge step ``step`` (1-based, metrics.jsonl's ``step``: the version its update makes) by its metrics row;
        return the ``health/*`` figures to add to the row. Changes nothing but alerts: a rollback that became due
        happens in :meth:`roll_back_if_due`, which the loop calls once the row is written.

        The row should hold ``train/applied`` (1.0 or 0.0, ``StepStats.applied``), ``train/loss`` and
        ``train/grad_norm``; without ``train/applied`` a step counts as skipped when its loss or norm is non-finite.
        """
        facts = facts or ProcessFacts()
        self._judge_step(step, row)
        for rule in self.rules:
            verdict = rule.check(row, facts)
            if verdict is not None:
                self.alerts.update(rule.name, rule.severity, step, verdict)
        return {
            "skipped_in_a_row": float(self.rollback.skipped_in_a_row),
            "rollback_due": float(self.rollback.due),
            "rollbacks": float(self.rollback.rollbacks),
            "lr_factor": self.rollback.lr_scale,
            "alerts_firing": float(len(self.alerts.firing)),
        }

    def roll_back_if_due(self) -> int | None:
        """After ``max_skipped_steps`` non-finite steps in a row: restore the last healthy checkpoint through
        ``checkpoints`` at a lower lr and return its step; else None. Raises :class:`TrainingDivergedError` when the
        rollbacks are used up or there is nothing to restore: the run should stop."""
        if not self.rollback.due:
            return None
        limit = self.settings.max_skipped_steps
        restored = self.rollback.roll_back()
        message = (
            f"rolled back to the checkpoint of step {restored} after {limit} non-finite steps; lr now "
            f"{self.rollback.lr_scale:g} × the schedule (rollback {self.rollback.rollbacks} of at most "
            f"{self.settings.max_rollbacks}); if it recurs, lower learner.lr"
        )
        self.alerts.update("rolled_back", "critical", self._step, Check(True, float(restored), message))
        return restored

    def _judge_step(self, step: int, row: Row) -> None:
        self._step = step
        loss, norm = float(row.get("train/loss", math.nan)), float(row.get("train/grad_norm", math.nan))
        applied = bool(row["train/applied"]) if "train/applied" in row else step_is_finite(loss, norm)
        skipped = non_finite_skip(loss, norm, applied, fp16=self.fp16)
        self.rollback.observe(skipped, step)
        if skipped:
            message = (
                f"step skipped, weights unchanged: loss {loss:.4g}, gradient norm {norm:.4g} "
                f"({self.rollback.skipped_in_a_row}/{self.settings.max_skipped_steps} in a row); at the limit the "
                "run rolls back to the last healthy checkpoint at a lower lr"
            )
            in_a_row = float(self.rollback.skipped_in_a_row)
            self.alerts.update("non_finite", "warning", step, Check(True, in_a_row, message))
        elif applied:
            self.alerts.update("non_finite", "warning", step, Check(False, 0.0, "step applied"))
            self.alerts.update("rolled_back", "critical", step, Check(False, 0.0, "a step trained after the rollback"))

    @property
    def healthy(self) -> bool:
        """No non-finite step pending: a checkpoint saved now may be restored by a rollback."""
        return self.rollback.healthy

    def active_alerts(self) -> list[dict[str, Any]]:
        """The firing alerts as ``ControlPlane.set_alerts`` takes them (name, severity, message, since, step)."""
        return self.alerts.active()

    def close(self, wait_s: float = 5.0) -> None:
        """Deliver the queued webhook bodies (bounded wait)."""
        self.alerts.close(wait_s)
