"""Run health: skip a non-finite step, roll back after repeated ones, and raise alerts on each step's metrics.

Three parts, each usable alone (none needs Redis or DeepSpeed):

- **Non-finite guard** (:func:`step_is_finite`, :func:`gradients_finite`, :func:`non_finite_skip`). A NaN or inf in
  the loss or a gradient must never reach the weights: Adam would spread it into every parameter it touches, and the
  run could not recover without a restore. DeepSpeed's ZeRO 1–3 and bf16/fp16 optimizers already skip a step whose
  gradient norm is not finite (``was_step_applied()`` is then False; measured with DeepSpeed 0.19.8 for ZeRO 1, 2, 3
  in float32 and ZeRO 0, 2 in bf16); the bare torch optimizer of ZeRO 0 in float32 does not, so
  :meth:`learner.engine.PolicyEngine.train_step` skips it itself, on a non-finite loss or norm. (A non-finite loss
  whose gradients are all finite — rare — is still applied by the DeepSpeed optimizers.)
- **Rollback** (:class:`RollbackPolicy`). One skipped step is noise; ``max_skipped_steps`` in a row mean the weights
  themselves now produce them (an earlier step went too far), so the run goes back to the last healthy checkpoint at
  a lower learning rate (through the :class:`Checkpoints` protocol). After ``max_rollbacks`` the run stops.
- **Alerts** (:class:`HealthMonitor`). Rules over a metrics.jsonl row plus facts only the loop knows
  (:class:`ProcessFacts`). An alert is *firing* or *resolved*; only a transition is logged, passed to the metric
  callback (``common.metrics.set_alert``) and POSTed to the webhook, so a long incident is one line, not one a step.

The loop calls :meth:`HealthMonitor.observe` once a step with the step's row, and
:meth:`HealthMonitor.roll_back_if_due` once the row is written; see their docstrings.
"""

from __future__ import annotations

import json
import math
import queue
import statistics
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from common.config import HealthSection, RunConfig
from common.logs import get_logger

if TYPE_CHECKING:
    import torch

log = get_logger("health")

Row = Mapping[str, float]
SetAlert = Callable[[str, bool], None]


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
    """What a rollback needs from the checkpoint side (``learner/checkpoint.py`` wires it)."""

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
    same ratio. The new base lrs are part of the scheduler's state dict, so a checkpoint saved afterwards keeps the
    factor; loading an older checkpoint restores its own (call this after a restore, not before).
    """
    groups = scheduler.optimizer.param_groups
    if len(peak_lrs) != len(groups):
        raise ValueError(f"{len(peak_lrs)} peak lrs for {len(groups)} parameter groups")
    for index, (group, peak) in enumerate(zip(groups, peak_lrs, strict=True)):
        old, new = scheduler.base_lrs[index], peak * factor
        group["lr"] = group["lr"] * new / old if old else new
        scheduler.base_lrs[index] = new
    scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports until the next step


# --------------------------------------------------------------------------- alert rules


@dataclass(frozen=True)
class ProcessFacts:
    """What the metrics row does not say; counts since this learner started (cumulative, never reset)."""

    actors_lost: int = 0
    """Actors that died or were evicted."""
    reward_errors: int = 0
    """Reward-service failures: dead-lettered groups and failed reward calls."""


@dataclass(frozen=True)
class Check:
    """A rule's verdict on one step."""

    firing: bool
    value: float
    message: str
    """What is wrong and what to do (a firing check), or what the value is now (a resolved one)."""


def _value(row: Row, *keys: str) -> float | None:
    """The first of ``keys`` in ``row`` as a finite float; None when absent or non-finite (no data this step)."""
    for key in keys:
        if key in row:
            value = float(row[key])
            return value if math.isfinite(value) else None
    return None


class Rule:
    """One alert: ``check`` returns a verdict, or None when the row has no data for it (the state stays)."""

    name: str
    severity: ClassVar[str] = "warning"

    def check(self, row: Row, facts: ProcessFacts) -> Check | None:
        raise NotImplementedError


@dataclass
class AboveLimit(Rule):
    """Fires while the first present of ``keys`` is above ``limit``."""

    name: str
    keys: tuple[str, ...]
    limit: float
    what: str
    action: str

    def check(self, row: Row, facts: ProcessFacts) -> Check | None:
        value = _value(row, *self.keys)
        if value is None:
            return None
        firing = value > self.limit
        message = f"{self.what} {value:.4g} > {self.limit:g}: {self.action}" if firing else f"{self.what} {value:.4g}"
        return Check(firing, value, message)


@dataclass
class EntropyCollapse(Rule):
    """Fires while the token entropy is below ``floor``, or below 1/``drop_factor`` of its peak over ``window``
    steps (a fast fall from a healthy level is a collapse too, before it reaches any fixed floor)."""

    floor: float
    drop_factor: float
    window: int
    name: str = "entropy_collapse"
    seen: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.seen = deque(maxlen=self.window)

    def check(self, row: Row, facts: ProcessFacts) -> Check | None:
        value = _value(row, "train/loss/entropy")
        if value is None:
            return None
        self.seen.append(value)
        peak = max(self.seen)
        below_floor = value < self.floor
        fell = self.drop_factor > 0 and value < peak / self.drop_factor
        if not (below_floor or fell):
            return Check(False, value, f"token entropy {value:.4g}")
        why = (
            f"below the floor {self.floor:g}" if below_floor else f"fell from {peak:.4g} within {len(self.seen)} steps"
        )
        action = (
            "the policy collapses onto few tokens; add an entropy bonus, raise the loss's clip_high, or lower the lr"
        )
        return Check(True, value, f"token entropy {value:.4g} {why}: {action}")


@dataclass
class RewardFlat(Rule):
    """Fires while the standard deviation of the last ``window`` steps' mean rewards is below ``epsilon``."""

    window: int
    epsilon: float
    name: str = "reward_flat"
    seen: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.seen = deque(maxlen=self.window)

    def check(self, row: Row, facts: ProcessFacts) -> Check | None:
        value = _value(row, "rollout/reward_mean")
        if value is None:
            return None
        self.seen.append(value)
        if len(self.seen) < self.window:
            return None  # not a full window yet: no verdict either way
        spread = statistics.pstdev(self.seen)
        if spread >= self.epsilon:
            return Check(False, spread, f"reward std over {self.window} steps {spread:.3g}")
        return Check(
            True,
            spread,
            f"mean reward stayed at {statistics.fmean(self.seen):.4g} for {self.window} steps (std {spread:.2g} < "
            f"{self.epsilon:g}): learning stalled or the task is saturated; read samples.jsonl, check "
            "groups/zero_variance, train/grad_norm and learner.lr",
        )


@dataclass
class RewardErrors(Rule):
    """Fires while the reward failures since the last step exceed ``rate`` of them plus the step's groups."""

    rate: float
    groups_per_step: int
    name: str = "reward_errors"
    last: int = 0

    def check(self, row: Row, facts: ProcessFacts) -> Check | None:
        new = max(0, facts.reward_errors - self.last)  # a trimmed dead-letter stream can count down
        self.last = facts.reward_errors
        dropped = ("groups/dropped_stale", "groups/duplicates", "groups/zero_variance", "groups/refused")
        consumed = self.groups_per_step + sum(_value(row, key) or 0.0 for key in dropped)
        fraction = new / (new + consumed)
        if fraction <= self.rate:
            return Check(False, fraction, f"reward failures {fraction:.1%} of groups")
        return Check(
            True,
            fraction,
            f"{new} reward failures since the last step ({fraction:.1%} of groups > {self.rate:.1%}): check the reward "
            "workers' logs and the run's dead-letter stream (asyncrl:<run>:dead)",
        )


@dataclass
class StaleDrops(Rule):
    """Fires while the groups dropped as stale exceed ``fraction`` of them plus the groups trained."""

    fraction: float
    groups_per_step: int
    name: str = "stale_drops"

    def check(self, row: Row, facts: ProcessFacts) -> Check | None:
        stale = _value(row, "groups/dropped_stale")
        if stale is None:
            return None
        share = stale / (stale + self.groups_per_step)
        if share <= self.fraction:
            return Check(False, share, f"stale drops {share:.1%} of groups")
        return Check(
            True,
            share,
            f"{stale:g} groups dropped as stale ({share:.1%} > {self.fraction:.1%}): actors run ahead of admission "
            "control; check that weight syncs reach every actor (sync/*), or raise staleness.max_staleness",
        )


@dataclass
class ActorLost(Rule):
    """Fires on a step after which more actors are lost than before; resolves at the next step without a loss."""

    name: str = "actor_lost"
    last: int = 0

    def check(self, row: Row, facts: ProcessFacts) -> Check | None:
        new = facts.actors_lost - self.last
        self.last = max(self.last, facts.actors_lost)
        if new <= 0:
            return Check(False, 0.0, f"no actor lost since the last step ({self.last} in all)")
        return Check(
            True,
            float(new),
            f"{new} actor(s) lost since the last step ({facts.actors_lost} in all): their groups are re-issued; "
            "read the actor's log, and start a replacement (rl-actor --redis URL --run NAME) if it does not come back",
        )


@dataclass
class LearnerStarving(Rule):
    """Fires while the learner's mean idle fraction over the last ``window`` steps is above ``level``."""

    level: float
    window: int
    name: str = "learner_starving"
    seen: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.seen = deque(maxlen=self.window)

    def check(self, row: Row, facts: ProcessFacts) -> Check | None:
        value = _value(row, "step/idle_fraction")
        if value is None:
            return None
        self.seen.append(value)
        if len(self.seen) < self.window:
            return None
        mean = statistics.fmean(self.seen)
        if mean <= self.level:
            return Check(False, mean, f"learner idle {mean:.0%} of its steps")
        return Check(
            True,
            mean,
            f"learner idle {mean:.0%} of its step time over {self.window} steps (> {self.level:.0%}): the replay "
            "queue does not keep up; add actors or reward workers, or lower learner.groups_per_step",
        )


def build_rules(settings: HealthSection, groups_per_step: int) -> list[Rule]:
    """The alert rules of ``[health]``; a rule whose threshold is 0 is off and not built."""
    rules: list[Rule] = []
    if settings.kl_ref_max > 0:
        kl_action = "the policy drifts from the reference; lower learner.lr or raise the KL coefficient"
        keys = ("train/loss/kl_ref", "train/kl_reward/kl")
        rules.append(AboveLimit("kl_ref_high", keys, settings.kl_ref_max, "KL to the reference", kl_action))
    if settings.mismatch_kl_max > 0:
        action = "actors sample far from the learner's policy; lower staleness.max_staleness, check weight syncs"
        key = ("train/offpolicy/mismatch_kl",)
        rules.append(AboveLimit("mismatch_kl_high", key, settings.mismatch_kl_max, "KL(μ ‖ π_old)", action))
    if settings.entropy_floor > 0 or settings.entropy_drop_factor > 0:
        rules.append(EntropyCollapse(settings.entropy_floor, settings.entropy_drop_factor, settings.entropy_window))
    if settings.reward_flat_epsilon > 0:
        rules.append(RewardFlat(settings.reward_flat_window, settings.reward_flat_epsilon))
    if settings.reward_error_rate > 0:
        rules.append(RewardErrors(settings.reward_error_rate, groups_per_step))
    if settings.stale_drop_fraction > 0:
        rules.append(StaleDrops(settings.stale_drop_fraction, groups_per_step))
    rules.append(ActorLost())
    if settings.starving_idle_fraction > 0:
        rules.append(LearnerStarving(settings.starving_idle_fraction, settings.starving_window))
    return rules


# --------------------------------------------------------------------------- transitions, webhook


@dataclass(frozen=True)
class Transition:
    """An alert that changed state; the webhook's JSON body (:meth:`payload`)."""

    alert: str
    state: Literal["firing", "resolved"]
    step: int
    value: float
    message: str
    severity: str
    run: str = ""
    at: float = field(default_factory=time.time)

    def payload(self) -> dict[str, Any]:
        body = asdict(self)
        body["value"] = self.value if math.isfinite(self.value) else str(self.value)  # JSON has no NaN
        return body


class Webhook:
    """POSTs JSON bodies to one URL from a daemon thread, so a slow or dead receiver never blocks a training step.

    Delivery is best effort: at most ``backlog`` bodies wait (more are dropped and logged); a failed POST (refused,
    timed out, an HTTP error status) is logged and not retried. :meth:`close` waits a bounded time for the backlog.
    """

    def __init__(self, url: str, timeout_s: float = 2.0, backlog: int = 100) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(backlog)
        self._thread = threading.Thread(target=self._run, name="health-webhook", daemon=True)
        self._thread.start()

    def send(self, body: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            action = "the receiver is slow or down; the alert is still in the log and the metrics"
            log.warning("alert webhook backlog full, dropped one", url=self.url, alert=body.get("alert"), action=action)

    def close(self, wait_s: float = 5.0) -> None:
        """Send what is queued (for at most ``wait_s``), then stop the thread."""
        try:
            self._queue.put(None, timeout=wait_s)
        except queue.Full:
            return
        self._thread.join(wait_s)

    def _run(self) -> None:
        while (body := self._queue.get()) is not None:
            self._post(body)

    def _post(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        request = urllib.request.Request(self.url, data, {"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors; ValueError: a malformed URL
            log.warning(
                "alert webhook failed",
                url=self.url,
                alert=body.get("alert"),
                state=body.get("state"),
                error=exc,
                action="check health.webhook_url and the receiver; the alert is still in the log and the metrics",
            )


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
    ) -> None:
        self.settings = settings
        self.run = run
        self.fp16 = fp16
        self.rollback = RollbackPolicy(
            settings.max_skipped_steps, settings.rollback_lr_factor, settings.max_rollbacks, checkpoints
        )
        self.rules = build_rules(settings, groups_per_step)
        self._set_alert = set_alert or (lambda name, active: None)
        self.firing: dict[str, Transition] = {}
        self._step = 0  # the step last observed
        self.webhook = Webhook(settings.webhook_url, settings.webhook_timeout_s) if settings.webhook_url else None
        for name in [rule.name for rule in self.rules] + ["non_finite", "rolled_back"]:
            self._set_alert(name, False)

    @classmethod
    def for_run(cls, config: RunConfig, **kwargs: Any) -> HealthMonitor:
        """The monitor of a run's config (``[health]``, its name, groups per step, precision)."""
        fp16 = config.learner.precision == "float16"
        groups = config.learner.groups_per_step
        return cls(config.health, groups_per_step=groups, run=config.run.name, fp16=fp16, **kwargs)

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
                self._update(rule.name, rule.severity, step, verdict)
        return {
            "skipped_in_a_row": float(self.rollback.skipped_in_a_row),
            "rollback_due": float(self.rollback.due),
            "rollbacks": float(self.rollback.rollbacks),
            "lr_factor": self.rollback.lr_scale,
            "alerts_firing": float(len(self.firing)),
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
        self._update("rolled_back", "critical", self._step, Check(True, float(restored), message))
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
            self._update("non_finite", "warning", step, Check(True, float(self.rollback.skipped_in_a_row), message))
        elif applied:
            self._update("non_finite", "warning", step, Check(False, 0.0, "step applied"))
            self._update("rolled_back", "critical", step, Check(False, 0.0, "a step trained after the rollback"))

    def _update(self, name: str, severity: str, step: int, verdict: Check) -> None:
        """Record a verdict; act only when the alert's state changes."""
        if verdict.firing == (name in self.firing):
            return
        state: Literal["firing", "resolved"] = "firing" if verdict.firing else "resolved"
        change = Transition(name, state, step, verdict.value, verdict.message, severity, self.run)
        if verdict.firing:
            self.firing[name] = change
            log.warning("alert firing", alert=name, step=step, value=f"{verdict.value:.4g}", action=verdict.message)
        else:
            since = self.firing.pop(name).step
            log.info("alert resolved", alert=name, step=step, firing_since_step=since, now=verdict.message)
        self._set_alert(name, verdict.firing)
        if self.webhook is not None:
            self.webhook.send(change.payload())

    @property
    def healthy(self) -> bool:
        """No non-finite step pending: a checkpoint saved now may be restored by a rollback."""
        return self.rollback.healthy

    def active_alerts(self) -> list[dict[str, Any]]:
        """The firing alerts as ``ControlPlane.set_alerts`` takes them (name, severity, message, since, step)."""
        return [
            {"name": t.alert, "severity": t.severity, "message": t.message, "since": t.at, "step": t.step}
            for t in self.firing.values()
        ]

    def close(self, wait_s: float = 5.0) -> None:
        """Deliver the queued webhook bodies (bounded wait)."""
        if self.webhook is not None:
            self.webhook.close(wait_s)
