"""Run health: the non-finite guard, the rollback policy, each alert rule's firing and resolution, transitions logged
once, and the webhook (a real HTTP server on loopback, and receivers that refuse, fail or hang)."""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from asyncrl.common.config import ConfigError, HealthSection, load_config
from asyncrl.common.plane.redis_server import free_port
from asyncrl.learner.health.monitor import (
    HealthMonitor,
    ProcessFacts,
    RollbackPolicy,
    TrainingDivergedError,
    gradients_finite,
    non_finite_skip,
    scale_lr_schedule,
    step_is_finite,
)
from tests.helpers.waits import wait_for

NAN, INF = math.nan, math.inf
HEALTHY = {"train/loss": 0.5, "train/grad_norm": 1.0, "train/applied": 1.0}
SKIPPED = {"train/loss": NAN, "train/grad_norm": NAN, "train/applied": 0.0}


class Records(logging.Handler):
    """The health logger's records (attached directly: the ``asyncrl`` logger may not propagate to caplog's)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, start: str) -> list[str]:
        return [r.getMessage() for r in self.records if r.getMessage().startswith(start)]


@pytest.fixture
def logs() -> Iterator[Records]:
    logger = logging.getLogger("asyncrl.health")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class Alerts:
    """A ``set_alert`` callback that keeps every call after the initial all-off ones."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.initial: list[tuple[str, bool]] = []
        self.started = False

    def __call__(self, name: str, active: bool) -> None:
        (self.calls if self.started else self.initial).append((name, active))


class FakeCheckpoints:
    def __init__(self, step: int = 10, missing: bool = False) -> None:
        self.step, self.missing = step, missing
        self.restored = 0
        self.before: list[int] = []
        self.factors: list[float] = []

    def restore_latest_healthy(self, before_step: int) -> int:
        if self.missing:
            raise LookupError("no checkpoint saved yet")
        self.restored += 1
        self.before.append(before_step)
        return self.step

    def set_lr_factor(self, factor: float) -> None:
        self.factors.append(factor)


def monitor(alerts: Alerts | None = None, groups_per_step: int = 8, **settings: Any) -> HealthMonitor:
    checkpoints = settings.pop("checkpoints", None)
    built = HealthMonitor(
        HealthSection(**settings), groups_per_step=groups_per_step, checkpoints=checkpoints, set_alert=alerts
    )
    if alerts is not None:
        alerts.started = True
    return built


def feed(health: HealthMonitor, rows: list[dict[str, float]], facts: list[ProcessFacts] | None = None) -> None:
    for step, row in enumerate(rows, start=1):
        health.observe(step, {**HEALTHY, **row}, facts[step - 1] if facts else None)


# --------------------------------------------------------------------------- non-finite guard


@pytest.mark.parametrize(
    ("loss", "norm", "finite"),
    [(1.0, 2.0, True), (1.0, None, True), (NAN, 2.0, False), (INF, 2.0, False), (1.0, NAN, False), (1.0, -INF, False)],
)
def test_step_is_finite(loss: float, norm: float | None, finite: bool) -> None:
    assert step_is_finite(loss, norm) is finite


def test_gradients_finite_checks_every_grad_and_ignores_missing_ones() -> None:
    layer = torch.nn.Linear(3, 2)
    assert gradients_finite(layer)  # no gradients yet
    layer(torch.ones(1, 3)).sum().backward()
    assert gradients_finite(layer) and gradients_finite(layer.parameters())
    layer.bias.grad[1] = INF
    assert not gradients_finite(layer)
    layer.bias.grad = None
    layer.weight.grad[0, 0] = NAN
    assert not gradients_finite([layer.weight, layer.bias])


@pytest.mark.parametrize(
    ("loss", "norm", "applied", "fp16", "counts"),
    [
        (1.0, 2.0, True, False, False),  # a normal step
        (NAN, NAN, True, False, False),  # applied (nothing skipped it): not a skip, whatever the values
        (NAN, NAN, False, False, True),  # the guard skipped it
        (1.0, INF, False, False, True),  # finite loss, overflowing gradient
        (1.0, INF, False, True, False),  # fp16 loss-scale overflow: DeepSpeed lowers the scale, normal
        (NAN, INF, False, True, True),  # fp16 with a non-finite loss: counts
        (1.0, 2.0, False, False, False),  # not applied for another reason: not a non-finite skip
    ],
)
def test_non_finite_skip(loss: float, norm: float, applied: bool, fp16: bool, counts: bool) -> None:
    assert non_finite_skip(loss, norm, applied, fp16=fp16) is counts


# --------------------------------------------------------------------------- rollback


def test_rollback_after_n_consecutive_skips_and_a_healthy_step_resets_the_count() -> None:
    checkpoints = FakeCheckpoints(step=7)
    policy = RollbackPolicy(max_skipped=3, lr_factor=0.5, max_rollbacks=2, checkpoints=checkpoints)
    # steps 11..15: skip, skip, healthy (resets), skip, skip: never 3 in a row
    outcomes = [policy.observe(skipped, step) for step, skipped in enumerate((True, True, False, True, True), 11)]
    assert outcomes == [False] * 5 and not policy.due
    assert checkpoints.restored == 0 and not policy.healthy
    assert policy.observe(True, 16) and policy.due  # the third in a row
    assert checkpoints.restored == 0  # observing changes nothing
    assert policy.roll_back() == 7
    # the streak began at step 14, trained from version 13's weights: only a checkpoint older than 13 is healthy
    assert (checkpoints.restored, checkpoints.before, checkpoints.factors) == (1, [13], [0.5])
    assert policy.healthy and policy.skipped_in_a_row == 0
    assert [policy.observe(True, step) for step in (8, 9, 10)] == [False, False, True]  # retraining after it
    assert policy.roll_back() == 7
    assert checkpoints.before == [13, 7] and checkpoints.factors == [0.5, 0.25]  # absolute: the factors' product
    assert policy.lr_scale == 0.25 and policy.rollbacks == 2
    for step in (8, 9, 10):
        policy.observe(True, step)
    with pytest.raises(TrainingDivergedError, match="after 2 rollbacks"):
        policy.roll_back()
    assert checkpoints.restored == 2


@pytest.mark.parametrize("checkpoints", [None, FakeCheckpoints(missing=True)])
def test_rollback_without_a_checkpoint_stops_the_run(checkpoints: FakeCheckpoints | None) -> None:
    policy = RollbackPolicy(max_skipped=2, lr_factor=0.5, max_rollbacks=3, checkpoints=checkpoints)
    assert not policy.observe(True, 1)
    assert policy.observe(True, 2)
    with pytest.raises(TrainingDivergedError, match=r"lower learner\.lr"):
        policy.roll_back()


def test_scale_lr_schedule_follows_the_schedule_at_the_factor() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 4))  # 0.1, 0.2, 0.3, 0.4
    optimizer.step()
    warmup.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    scale_lr_schedule(warmup, [0.4], 0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # the next optimizer step uses it
    lrs = []
    for _ in range(3):
        optimizer.step()
        warmup.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.15, 0.2, 0.2])  # 0.5 × (0.3, 0.4, 0.4)
    assert warmup.get_last_lr() == pytest.approx([0.2])
    scale_lr_schedule(warmup, [0.4], 0.25)  # absolute, not relative to the last call
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    restored = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([param], lr=0.4), lambda k: 1.0)
    restored.load_state_dict(warmup.state_dict())
    assert restored.base_lrs == pytest.approx([0.1])  # a checkpoint saved now keeps the factor


# --------------------------------------------------------------------------- alert rules


def transitions(alerts: Alerts, name: str) -> list[bool]:
    return [active for alert, active in alerts.calls if alert == name]


RULE_CASES = {
    # name: (settings, rows, facts or None, expected states per step (None = no transition))
    "kl_ref_high": (
        {"kl_ref_max": 0.5},
        [{"train/loss/kl_ref": v} for v in (0.1, 0.7, 0.9, 0.2, 0.3)],
        None,
        [None, True, None, False, None],
    ),
    "kl_ref_high/in_reward": (
        {"kl_ref_max": 0.5},
        [{"train/kl_reward/kl": v} for v in (0.6, 0.1)],
        None,
        [True, False],
    ),
    "mismatch_kl_high": (
        {"mismatch_kl_max": 0.1},
        [{"train/offpolicy/mismatch_kl": v} for v in (0.01, 0.3, 0.05)],
        None,
        [None, True, False],
    ),
    "entropy_collapse/floor": (
        {"entropy_floor": 0.05, "entropy_drop_factor": 0.0},
        [{"train/loss/entropy": v} for v in (0.8, 0.01, 0.02, 0.6)],
        None,
        [None, True, None, False],
    ),
    "entropy_collapse/drop": (
        {"entropy_floor": 0.0, "entropy_drop_factor": 10.0, "entropy_window": 3},
        # windows of 3: (2, 1.5, 0.15): 0.15 < 2/10 fires; (1.5, 0.15, 0.12): 0.12 < 1.5/10 still firing;
        # (0.15, 0.12, 0.1): 0.1 > 0.15/10 resolved (a collapse that stays low is the floor's to catch)
        [{"train/loss/entropy": v} for v in (2.0, 1.5, 0.15, 0.12, 0.1)],
        None,
        [None, None, True, None, False],
    ),
    "reward_flat": (
        {"reward_flat_window": 3, "reward_flat_epsilon": 1e-3},
        [{"rollout/reward_mean": v} for v in (0.1, 0.2, 0.3, 0.5, 0.5, 0.5, 0.5, 0.9)],
        None,
        [None, None, None, None, None, True, None, False],
    ),
    "reward_errors": (
        {"reward_error_rate": 0.05},
        [{}, {}, {}, {}],
        [ProcessFacts(reward_errors=n) for n in (0, 5, 5, 5)],  # 5 new of 5 + 8 groups = 38 % > 5 %
        [None, True, False, None],
    ),
    "stale_drops": (
        {"stale_drop_fraction": 0.1},
        [{"groups/dropped_stale": v} for v in (0, 4, 4, 0)],  # 4 / (4 + 8) = 33 % > 10 %
        None,
        [None, True, None, False],
    ),
    "actor_lost": (
        {},
        [{}, {}, {}, {}],
        [ProcessFacts(actors_lost=n) for n in (0, 1, 1, 3)],
        [None, True, False, True],
    ),
    "learner_starving": (
        {"starving_idle_fraction": 0.5, "starving_window": 3},
        # means over full windows: 0.9, 0.63, 0.37
        [{"step/idle_fraction": v} for v in (0.9, 0.9, 0.9, 0.1, 0.1)],
        None,
        [None, None, True, None, False],
    ),
}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_each_rule_fires_and_resolves(case: str, logs: Records) -> None:
    settings, rows, facts, expected = RULE_CASES[case]
    name = case.split("/")[0]
    alerts = Alerts()
    health = monitor(alerts, **settings)
    assert (name, False) in alerts.initial  # the gauge exists from the start
    states: list[bool | None] = []
    for step, row in enumerate(rows, start=1):
        before = len(transitions(alerts, name))
        health.observe(step, {**HEALTHY, **row}, facts[step - 1] if facts else None)
        after = transitions(alerts, name)
        states.append(after[-1] if len(after) > before else None)
    assert states == expected
    firing = [m for m in logs.messages("alert firing") if f"alert={name} " in m]
    assert len(firing) == expected.count(True)
    assert "action=" in firing[0]  # says what to do
    assert len([m for m in logs.messages("alert resolved") if f"alert={name} " in m]) == expected.count(False)


def test_a_synchronous_run_never_alerts_that_the_learner_waits() -> None:
    """With max_staleness 0 the learner waits for each step's generation by design: an always-firing alert would
    teach operators to ignore alerts."""
    config = load_config(None, ["staleness.max_staleness=0"])
    alerts = Alerts()
    health = HealthMonitor.for_run(config, set_alert=alerts)
    assert "learner_starving" not in {rule.name for rule in health.rules}
    feed(health, [{"step/idle_fraction": 0.9}] * 30)
    assert health.active_alerts() == [] and not transitions(alerts, "learner_starving")
    asynchronous = HealthMonitor.for_run(load_config(None, ["staleness.max_staleness=1"]))
    assert "learner_starving" in {rule.name for rule in asynchronous.rules}


def test_a_threshold_of_zero_turns_a_rule_off() -> None:
    health = monitor(kl_ref_max=0.0, mismatch_kl_max=0.0, entropy_floor=0.0, entropy_drop_factor=0.0)
    assert {"kl_ref_high", "mismatch_kl_high", "entropy_collapse"}.isdisjoint(r.name for r in health.rules)
    feed(health, [{"train/loss/kl_ref": 9.0, "train/offpolicy/mismatch_kl": 9.0, "train/loss/entropy": 0.0}])
    assert health.active_alerts() == []


def test_a_long_incident_is_one_transition_each_way(logs: Records) -> None:
    alerts = Alerts()
    health = monitor(alerts, kl_ref_max=0.5)
    feed(health, [{"train/loss/kl_ref": 0.9}] * 20 + [{"train/loss/kl_ref": 0.1}] * 5 + [{"train/loss/kl_ref": 0.8}])
    assert transitions(alerts, "kl_ref_high") == [True, False, True]
    assert len(logs.messages("alert firing")) == 2 and len(logs.messages("alert resolved")) == 1
    (active,) = health.active_alerts()
    assert active["name"] == "kl_ref_high" and active["step"] == 26 and "lower learner.lr" in active["message"]


def test_rows_without_a_rules_data_keep_its_state() -> None:
    alerts = Alerts()
    health = monitor(alerts, kl_ref_max=0.5)
    feed(health, [{"train/loss/kl_ref": 0.9}, {}, {"train/loss/kl_ref": NAN}, {"train/loss/kl_ref": 0.1}])
    assert transitions(alerts, "kl_ref_high") == [True, False]
    assert [t for t in alerts.calls if t[0] == "kl_ref_high"] == [("kl_ref_high", True), ("kl_ref_high", False)]


def test_non_finite_steps_alert_then_roll_back_then_resolve(logs: Records) -> None:
    alerts, checkpoints = Alerts(), FakeCheckpoints(step=3)
    health = monitor(alerts, max_skipped_steps=2, rollback_lr_factor=0.5, checkpoints=checkpoints)
    figures = health.observe(5, SKIPPED)
    assert figures["skipped_in_a_row"] == 1 and not health.healthy
    assert transitions(alerts, "non_finite") == [True]
    assert health.roll_back_if_due() is None
    figures = health.observe(6, SKIPPED)
    assert figures == {
        "skipped_in_a_row": 2.0,
        "rollback_due": 1.0,
        "rollbacks": 0.0,
        "lr_factor": 1.0,
        "alerts_firing": 1.0,
    }
    assert checkpoints.restored == 0  # observe only judges; the loop writes the row, then rolls back
    assert health.roll_back_if_due() == 3
    assert (checkpoints.restored, checkpoints.before, checkpoints.factors) == (1, [4], [0.5])
    assert health.roll_back_if_due() is None
    assert transitions(alerts, "rolled_back") == [True]
    assert "rolled back to the checkpoint of step 3" in logs.messages("alert firing")[-1]
    health.observe(7, HEALTHY)
    assert transitions(alerts, "non_finite") == [True, False] and transitions(alerts, "rolled_back") == [True, False]
    assert health.active_alerts() == [] and health.healthy


def test_a_row_without_applied_counts_a_non_finite_step_as_skipped() -> None:
    health = monitor()
    assert health.observe(1, {"train/loss": NAN, "train/grad_norm": 1.0})["skipped_in_a_row"] == 1
    assert health.observe(2, {"train/loss": 1.0, "train/grad_norm": 1.0})["skipped_in_a_row"] == 0


def test_fp16_loss_scale_overflows_do_not_count() -> None:
    health = HealthMonitor(HealthSection(max_skipped_steps=1), groups_per_step=8, fp16=True)
    for step in range(1, 6):  # would make a rollback due if they counted
        health.observe(step, {"train/loss": 0.5, "train/grad_norm": INF, "train/applied": 0.0})
        assert health.roll_back_if_due() is None
    health.observe(6, SKIPPED)
    with pytest.raises(TrainingDivergedError, match="no checkpoints"):
        health.roll_back_if_due()


# --------------------------------------------------------------------------- webhook


class Receiver(ThreadingHTTPServer):
    """A loopback HTTP server that keeps every JSON body POSTed to it and answers ``status``; with ``hang``, it
    answers nothing until :attr:`release` is set (on leaving the ``with`` block at the latest)."""

    def __init__(self, status: int = 200, hang: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.status = status
        self.got = threading.Event()  # a POST arrived
        self.release = threading.Event()
        if not hang:
            self.release.set()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                server: Receiver = self.server  # type: ignore[assignment]
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.headers["Content-Type"] == "application/json"
                server.got.set()
                server.release.wait(120)
                server.bodies.append(body)
                self.send_response(server.status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, args=(0.02,), daemon=True)  # quick to shut down

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hooks/asyncrl"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


def test_webhook_receives_each_transition_as_json() -> None:
    with Receiver() as receiver:
        health = HealthMonitor(HealthSection(kl_ref_max=0.5, webhook_url=receiver.url), groups_per_step=8, run="exp-1")
        feed(health, [{"train/loss/kl_ref": 0.9}, {"train/loss/kl_ref": 0.9}, {"train/loss/kl_ref": 0.1}])
        health.close()
    assert [(b["alert"], b["state"], b["step"]) for b in receiver.bodies] == [
        ("kl_ref_high", "firing", 1),
        ("kl_ref_high", "resolved", 3),
    ]
    firing = receiver.bodies[0]
    assert firing["run"] == "exp-1" and firing["severity"] == "warning" and firing["value"] == pytest.approx(0.9)
    assert "KL to the reference 0.9 > 0.5" in firing["message"] and firing["at"] > 0


def test_webhook_with_a_non_finite_value_still_sends_json() -> None:
    with Receiver() as receiver:
        health = HealthMonitor(HealthSection(webhook_url=receiver.url), groups_per_step=8)
        health.observe(1, {"train/loss": NAN, "train/grad_norm": INF, "train/applied": 0.0})
        health.close()
    (body,) = receiver.bodies
    assert body["alert"] == "non_finite" and body["value"] == 1.0 and "loss nan" in body["message"]


def test_a_failing_webhook_is_logged_and_never_raised(logs: Records) -> None:
    refused = f"http://127.0.0.1:{free_port()}/nobody-listens"
    with Receiver(status=500) as erring:
        for url in (refused, erring.url):
            health = HealthMonitor(HealthSection(kl_ref_max=0.5, webhook_url=url), groups_per_step=8)
            feed(health, [{"train/loss/kl_ref": 0.9}])
            health.close()
    failures = logs.messages("alert webhook failed")
    assert len(failures) == 2 and all("action=" in f for f in failures)
    assert "500" in failures[1]


def test_a_hanging_webhook_does_not_block_the_step(logs: Records) -> None:
    """The receiver answers nothing until the test lets it: a step or a close that waited for a POST would find one
    answered or timed out (logged) when it returns; neither has happened. A POST to it times out, and is logged."""
    with Receiver(hang=True) as hung:
        settings = HealthSection(kl_ref_max=0.5, webhook_url=hung.url, webhook_timeout_s=30)  # the longest allowed
        health = HealthMonitor(settings, groups_per_step=8)
        feed(health, [{"train/loss/kl_ref": v} for v in (0.9, 0.1, 0.9, 0.1)])  # four transitions queued
        assert hung.bodies == [] and not logs.messages("alert webhook failed")  # none waited for
        assert hung.got.wait(30)  # the first one is on its way, from the sender's thread
        health.close(wait_s=0.1)  # bounded, even with the receiver still busy
        assert hung.bodies == [] and not logs.messages("alert webhook failed")  # returned with the POST in flight
        settings = HealthSection(kl_ref_max=0.5, webhook_url=hung.url, webhook_timeout_s=0.2)
        timing_out = HealthMonitor(settings, groups_per_step=8)
        feed(timing_out, [{"train/loss/kl_ref": 0.9}])
        wait_for(lambda: logs.messages("alert webhook failed"), "the timed-out POST logged")
        timing_out.close(wait_s=0.1)
        assert hung.bodies == []  # the receiver never answered: that failure was the timeout
    health.close(wait_s=30)  # the receiver gone, its sender fails the rest at once: it ends within the test


# --------------------------------------------------------------------------- config


def test_health_config_defaults_and_validation() -> None:
    config = load_config()
    assert config.health.max_skipped_steps == 3 and config.health.webhook_url == ""
    assert load_config(None, ["health.webhook_url=https://hooks.example/x"]).health.webhook_url.startswith("https")
    with pytest.raises(ConfigError, match=r"health\.webhook_url"):
        load_config(None, ["health.webhook_url=ftp://x"])
    with pytest.raises(ConfigError, match="entropy_drop_factor must be 0"):
        load_config(None, ["health.entropy_drop_factor=0.5"])
    with pytest.raises(ConfigError, match=r"health\.rollback_lr_factor"):
        load_config(None, ["health.rollback_lr_factor=1.5"])
