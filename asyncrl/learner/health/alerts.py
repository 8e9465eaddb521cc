"""Alerts on a run's health: rules over each step's metrics row, and their transitions, logged and POSTed.

Each :class:`Rule` judges one metrics.jsonl row plus facts only the loop knows (:class:`ProcessFacts`) and returns a
:class:`Check`. :class:`Alerts` keeps which alerts are *firing*; only a transition (firing ↔ resolved) is logged,
passed to the metric callback (``common.observability.metrics.set_alert``) and POSTed to the webhook
(``learner/health/webhook.py``, from a daemon thread), so a long incident is one line, not one a step.
``learner/health/monitor.py: HealthMonitor`` feeds it.

Rules (thresholds in ``[health]``): ``kl_high``, ``grad_norm_high``, ``entropy_collapse``, ``reward_flat``,
``reward_errors``, ``stale_drops``, ``actor_lost``, ``learner_starving``; and the two the monitor raises itself,
``non_finite`` and ``rolled_back``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from asyncrl.common.config import HealthSection
from asyncrl.common.observability.logs import get_logger
from asyncrl.learner.health.webhook import Transition, Webhook

log = get_logger("health")

Row = Mapping[str, float]
SetAlert = Callable[[str, bool], None]


# --------------------------------------------------------------------------- alert rules


@dataclass(frozen=True)
class ProcessFacts:
    """What the metrics row does not say; counts since this learner started (cumulative, never reset)."""

    actors_lost: int = 0
    """Actors that died or were evicted."""
    lost: tuple[str, ...] = ()
    """Every process lost so far, as ``id (kind)``: what the lost-process alert names."""
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
            f"{stale:g} groups dropped as stale ({share:.1%} > {self.fraction:.1%}): they came back more than "
            "staleness.max_staleness steps after their release (the learner's log names each with its versions); "
            "fewer groups in flight per actor (rollout.max_groups_in_flight) or a larger max_staleness keeps them in "
            "the window, and a token older than its group's release means a weight sync missed its actor (sync/*)",
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
        named = f"; lost so far: {', '.join(facts.lost)}" if facts.lost else ""
        return Check(
            True,
            float(new),
            f"{new} actor(s) lost since the last step ({facts.actors_lost} in all{named}): their groups are "
            "re-issued; read the actor's log, and start a replacement (rl-actor --redis URL --run NAME) if it does "
            "not come back",
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


def build_rules(settings: HealthSection, groups_per_step: int, synchronous: bool = False) -> list[Rule]:
    """The alert rules of ``[health]``; a rule whose threshold is 0 is off and not built. A ``synchronous`` run
    (``staleness.max_staleness = 0``) waits for each step's generation by design: it has no ``learner_starving``."""
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
    if settings.starving_idle_fraction > 0 and not synchronous:
        rules.append(LearnerStarving(settings.starving_idle_fraction, settings.starving_window))
    return rules


# --------------------------------------------------------------------------- firing and resolved


class Alerts:
    """Which alerts are firing; :meth:`update` records a verdict and acts only when an alert changes state.

    ``set_alert(name, active)`` is called for every name in ``names`` at start (False, so the gauge exists) and on
    every transition; with ``webhook_url`` each transition is POSTed.
    """

    def __init__(
        self,
        names: list[str],
        run: str = "",
        set_alert: SetAlert | None = None,
        webhook_url: str = "",
        webhook_timeout_s: float = 2.0,
    ) -> None:
        self.run = run
        self._set_alert = set_alert or (lambda name, active: None)
        self.firing: dict[str, Transition] = {}
        self.webhook = Webhook(webhook_url, webhook_timeout_s) if webhook_url else None
        for name in names:
            self._set_alert(name, False)

    def update(self, name: str, severity: str, step: int, verdict: Check) -> None:
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

    def active(self) -> list[dict[str, Any]]:
        """The firing alerts as ``ControlPlane.set_alerts`` takes them (name, severity, message, since, step)."""
        return [
            {"name": t.alert, "severity": t.severity, "message": t.message, "since": t.at, "step": t.step}
            for t in self.firing.values()
        ]

    def close(self, wait_s: float = 5.0) -> None:
        """Deliver the queued webhook bodies (bounded wait)."""
        if self.webhook is not None:
            self.webhook.close(wait_s)
