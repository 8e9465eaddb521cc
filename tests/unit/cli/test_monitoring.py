"""The monitoring files (Grafana dashboard, Prometheus rules and config) and rl-top's rendering, without servers.

Every ``asyncrl_*`` series a dashboard panel or an alert names must be one that ``common/observability/metrics.py``
defines, and every label value it selects one that the code sets: a renamed series or a typo would otherwise leave a
panel empty or an alert silent, with nothing failing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from asyncrl.cli.top import frame_for_terminal, render, targets
from asyncrl.common.observability import metrics
from asyncrl.common.wire.messages import Heartbeat
from asyncrl.learner.record.telemetry import DROPPED, GAUGES

MONITORING = Path(__file__).resolve().parents[3] / "k8s" / "monitoring"
SERIES = re.compile(r"\b(asyncrl_[a-z_]+)(\{[^}]*\})?")
SELECTOR = re.compile(r'(\w+)\s*(=~|=)\s*"([^"]*)"')
QUEUES = ("prompts", "inflight", "replay", "replay_pending", "replay_unread", "dead_letters")
FREE_LABELS = {"run", "process", "le", "job", "instance", "alert", "channel", "field", "function"}


def dashboard() -> dict:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def rules() -> list[dict]:
    """The alert rules (PyYAML comes with transformers, so it is there wherever the project is installed)."""
    import yaml
    groups = yaml.safe_load((MONITORING / "alerts.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alert_exprs() -> list[str]:
    return [rule["expr"] for rule in rules()]


def defined_series() -> set[str]:
    """Every series name the default registry exposes, with the suffixes Prometheus adds."""
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    for family in REGISTRY.collect():
        if family.name.startswith("asyncrl_"):
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def known_label_values() -> set[tuple[str, str]]:
    known = {(k, v) for _, labels in GAUGES.values() for k, v in labels.items()}
    known |= {("reason", r) for r in DROPPED.values()} | {("queue", q) for q in QUEUES}
    return known | {("kind", k) for k in ("actor", "reward", "learner")}


def test_dashboard_is_a_grafana_dashboard_with_a_run_variable() -> None:
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "run"}
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert all(t["refId"] and t["expr"] for t in panel["targets"]), panel["title"]
        assert all('run="$run"' in t["expr"] for t in panel["targets"]), f"{panel['title']} ignores the run"


def test_alert_rules_are_prometheus_rules() -> None:
    found = rules()
    names = [r["alert"] for r in found]
    assert len(names) == len(set(names))
    for rule in found:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
    wanted = {
        "AsyncrlActorLost",
        "AsyncrlReplayStarving",
        "AsyncrlStaleGroupsDropped",
        "AsyncrlRewardFlat",
        "AsyncrlKLHigh",
        "AsyncrlEntropyCollapse",
        "AsyncrlLearnerAlertActive",
    }
    assert wanted <= set(names)


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_series_and_label_value_named_exists(source: str) -> None:
    exprs = dashboard_exprs() if source == "dashboard" else alert_exprs()
    assert exprs
    defined, known = defined_series(), known_label_values()
    for expr in exprs:
        for name, selector in SERIES.findall(expr):
            assert name in defined, f"{name} is not defined in common/observability/metrics.py ({expr})"
            for label, op, value in SELECTOR.findall(selector):
                if label in FREE_LABELS:
                    continue
                values = value.split("|") if op == "=~" else [value]
                unknown = [v for v in values if (label, v) not in known]
                assert not unknown, f"{name}{{{label}={unknown}}} is never set ({expr})"


def test_expressions_parse_as_promql() -> None:
    """With the optional ``promql-parser`` package (not a dependency): every expression is valid PromQL."""
    import promql_parser as promql
    for expr in dashboard_exprs() + alert_exprs():
        promql.parse(expr.replace("$run", "demo"))


def test_set_alert_sets_the_labelled_gauge() -> None:
    metrics.set_alert("test_alert", True)
    assert REGISTRY.get_sample_value("asyncrl_learner_alert_active", {"alert": "test_alert"}) == 1.0
    metrics.set_alert("test_alert", False)
    assert REGISTRY.get_sample_value("asyncrl_learner_alert_active", {"alert": "test_alert"}) == 0.0


# ------------------------------------------------------------------ rl-top rendering (no Redis)

ACTOR = Heartbeat(process_id="actor-0", kind="actor", state="generating", version=4, tokens_per_s=1500.0)
QUEUE_SNAP = {"prompts": 7, "inflight": 12, "replay": 3, "replay_pending": 2, "dead_letters": 0}


def snap(**changes) -> dict:
    base = {
        "run": "exp",
        "config_found": True,
        "version": 4,
        "queues": QUEUE_SNAP,
        "processes": [
            Heartbeat(process_id="actor-0", kind="actor", state="generating", version=4, tokens_per_s=1500.0)
        ],
        "lost": {},
        "summary": None,
        "alerts": [],
        "endpoints": {"actor-0": {"process_id": "actor-0", "kind": "actor", "host": "h1", "port": 9100}},
    }
    return base | changes


def test_render_before_the_learner_published_anything() -> None:
    text = render(snap())
    assert "learner  no step published yet" in text
    assert "alerts   none active" in text
    assert "prompts     7" in text and "in flight    12" in text and "(pending 2)" in text
    assert re.search(r"actor-0\s+actor\s+generating\s+4\s+1500\s+[\d.]+\s+-\s+h1:9100", text)


def test_render_the_learner_summary_and_alerts() -> None:
    summary = {
        "step": 12.0,
        "version": 12.0,
        "time": 1000.0,
        "learner/steps": 30,
        "rollout/reward_mean": 0.5,
        "rollout/reward_std": 0.25,
        "train/loss/kl_ref": 0.0123,
        "rollout/staleness_max": 1.0,
        "rollout/tokens": 800.0,
        "step/seconds": 2.0,
        "sync/seconds": 0.5,
        "actors/wanted": 3,
    }
    alerts = [{"name": "kl_high", "severity": "critical", "message": "KL 0.2 > 0.1", "since": 970.0}]
    text = render(snap(summary=summary, alerts=alerts), now=1010.0)
    assert "learner  step 12/30   version 12   reward 0.500 ± 0.250   kl(ref) 0.0123" in text
    assert "staleness max 1" in text and "sync 0.50s" in text and "trained tokens/s 400" in text
    assert "last step 10.0s ago" in text and "idle 0%   actors wanted 3   trained" in text
    assert "alerts   1 active" in text
    assert re.search(r"CRITICAL\s+kl_high\s+KL 0\.2 > 0\.1 \(for 40s\)", text)


def test_render_says_when_the_run_is_unknown_and_who_was_lost() -> None:
    text = render(snap(config_found=False, processes=[], lost={"actor-9": "actor"}))
    assert "no config published for run 'exp'" in text
    assert "(no actors or reward workers registered)" in text
    assert "lost (heartbeat expired): actor-9 (actor)" in text


def test_terminal_frame_overwrites_in_place_and_targets_are_file_sd() -> None:
    frame = frame_for_terminal("a\nb")
    assert frame == "\x1b[Ha\x1b[K\nb\x1b[K\n\x1b[J"
    endpoints = [{"process_id": "learner", "kind": "learner", "host": "h", "port": 9000, "pid": 1}]
    assert targets(endpoints, "exp") == [
        {"targets": ["h:9000"], "labels": {"run": "exp", "process": "learner", "kind": "learner"}}
    ]
