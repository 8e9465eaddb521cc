"""/metrics served over HTTP, found through heartbeats in a real Redis, and parsed back as Prometheus text format."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.common.config import load_config
from asyncrl.common.observability.metrics import start_metrics_server
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.redis_server import free_port
from asyncrl.common.plane.replay import ReplayReader, ReplayWriter
from asyncrl.common.wire.messages import Heartbeat, PromptGroup, ScoredGroup
from asyncrl.learner.record.telemetry import StepTelemetry
from tests.helpers.rollouts import make_group
from tests.helpers.waits import wait_for


def scrape(port: int) -> dict[str, list]:
    """{family name: samples} of the /metrics page on ``port`` (loopback: the server binds every interface)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(families: dict[str, list], sample: str, **labels: str) -> float | None:
    family = families.get(sample.removesuffix("_total").removesuffix("_bucket").removesuffix("_count"))
    for s in family or []:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def test_a_served_registry_parses_as_prometheus_text_and_is_found_through_the_heartbeat(redis_client) -> None:
    registry = CollectorRegistry()
    tokens = Counter("asyncrl_test_tokens_total", "Tokens.", registry=registry)
    depth = Gauge("asyncrl_test_depth_groups", "Depth.", ["queue"], registry=registry)
    seconds = Histogram("asyncrl_test_step_seconds", "Steps.", buckets=(0.5, 1.0), registry=registry)
    tokens.inc(42)
    depth.labels(queue="prompts").set(3)
    seconds.observe(0.7)
    plane = ControlPlane(redis_client, "exp")
    server = start_metrics_server("exp", "actor-7", "actor", 0, registry=registry)
    beat = Heartbeat(process_id="actor-7", kind="actor", state="ready", pid=7, metrics_url=server.url)
    try:
        plane.registry.beat(beat, ttl_s=5)
        [endpoint] = plane.registry.metrics_endpoints()
        assert endpoint["process_id"] == "actor-7" and endpoint["kind"] == "actor" and endpoint["pid"] == 7
        assert endpoint["port"] == server.port and server.url == f"http://{endpoint['host']}:{server.port}/metrics"
        assert endpoint["url"] == server.url and endpoint["address"] == f"{endpoint['host']}:{server.port}"
        families = scrape(server.port)
        assert value(families, "asyncrl_test_tokens_total") == 42
        assert value(families, "asyncrl_test_depth_groups", queue="prompts") == 3
        assert value(families, "asyncrl_test_step_seconds_bucket", le="0.5") == 0
        assert value(families, "asyncrl_test_step_seconds_bucket", le="1.0") == 1
        assert value(families, "asyncrl_test_step_seconds_count") == 1
    finally:
        server.close()
        plane.registry.leave("actor-7")
    assert plane.registry.metrics_endpoints() == []  # a clean exit leaves discovery at once
    with pytest.raises(urllib.error.URLError):
        scrape(server.port)


def test_discovery_follows_heartbeats_and_forgets_an_expired_one(redis_client) -> None:
    """One mechanism advertises a process: a process killed with -9 stops beating, and drops out by itself."""
    plane = ControlPlane(redis_client, "ttl")
    gone = Heartbeat(process_id="gone", kind="reward", state="ready", metrics_url="http://h:1/metrics")
    # TTLs long and far apart, so that even on a loaded machine "gone" is read live first and "quiet" outlives it
    plane.registry.beat(gone, 2)
    plane.registry.beat(Heartbeat(process_id="quiet", kind="actor", state="starting"), 60)  # not serving yet
    assert [e["process_id"] for e in plane.registry.metrics_endpoints()] == ["gone"]
    wait_for(lambda: not plane.registry.metrics_endpoints(), "expiry of gone's heartbeat", timeout_s=10)
    assert plane.registry.metrics_endpoints() == []
    assert plane.registry.processes()[1] == {"gone": "reward"}


def test_a_taken_fixed_port_falls_back_to_a_free_one() -> None:
    port = free_port()
    first = start_metrics_server("ports", "reward-0", "reward", port, registry=CollectorRegistry())
    second = start_metrics_server("ports", "reward-1", "reward", port, registry=CollectorRegistry())
    try:
        assert first.port == port and second.port not in (0, port)
        assert second.url.endswith(f":{second.port}/metrics")  # what its heartbeat advertises
    finally:
        first.close()
        second.close()


def row(step: int) -> dict[str, float]:
    """A metrics.jsonl row as the learner writes it (GRPO without a KL term: no kl_ref, no entropy)."""
    return {
        "groups/dropped_stale": 1.0,
        "groups/duplicates": 0.0,
        "groups/zero_variance": 0.0,
        "train/loss": 0.05,
        "train/grad_norm": 0.8,
        "train/loss/clip_frac": 0.03,
        "train/offpolicy/mismatch_kl": 2e-5,
        "sync/seconds": 0.4,
        "rollout/groups_from/actor-0": 3.0,
        "rollout/groups_from/actor-1": 1.0,
        "rollout/reward_mean": 0.375,
        "rollout/reward_std": 0.5,
        "rollout/staleness_max": 1.0,
        "rollout/staleness_mean": 0.25,
        "rollout/tokens": 96.0,
        "step/seconds": 2.0,
        "step/idle_fraction": 0.2,
        "step": float(step),
        "version": float(step),
        "time": time.time(),
    }


def test_learner_telemetry_updates_series_queues_and_the_summary(redis_client) -> None:
    config = load_config(None, ["run.name=tele", "learner.steps=30", "transport.heartbeat_ttl_s=5"])
    plane = ControlPlane(redis_client, "tele")
    plane.prompts.push_prompts(
        [PromptGroup(group_id=f"g{i}", task="t", prompt="1+1=", prompt_ids=np.zeros(4, np.int32)) for i in range(2)]
    )
    ReplayReader(redis_client, plane.keys)  # creates the consumer group, as the learner does
    ReplayWriter(redis_client, plane.keys).add(
        [ScoredGroup(rollout=make_group(["2"]), rewards=np.ones(1, np.float32), scorer_id="r") for _ in range(3)]
    )
    plane.registry.beat(Heartbeat(process_id="actor-0", kind="actor", state="generating"), ttl_s=5)
    plane.registry.beat(Heartbeat(process_id="reward-0", kind="reward", state="ready"), ttl_s=5)
    telemetry = StepTelemetry(plane, config)
    try:
        [endpoint] = [e for e in plane.registry.metrics_endpoints() if e["kind"] == "learner"]
        assert endpoint["process_id"] == "learner" and endpoint["port"] == telemetry.server.port
        before = scrape(telemetry.server.port)
        steps0 = value(before, "asyncrl_learner_steps_total") or 0.0
        tokens0 = value(before, "asyncrl_learner_trained_tokens_total") or 0.0
        telemetry.publish(row(7))
        after = scrape(telemetry.server.port)
    finally:
        telemetry.close()
    assert value(after, "asyncrl_learner_steps_total") == steps0 + 1
    assert value(after, "asyncrl_learner_trained_tokens_total") == tokens0 + 96
    assert value(after, "asyncrl_learner_reward", statistic="mean") == 0.375
    assert value(after, "asyncrl_learner_kl_nats", kl="mismatch") == 2e-5
    assert value(after, "asyncrl_learner_clipped_tokens_ratio", clip="ppo") == 0.03
    assert value(after, "asyncrl_learner_grad_norm", model="policy") == 0.8
    assert value(after, "asyncrl_learner_staleness_versions", statistic="max") == 1
    assert value(after, "asyncrl_learner_policy_version") == 7
    assert value(after, "asyncrl_learner_loss", model="critic") is None  # not computed: absent, not 0
    assert value(after, "asyncrl_learner_queue_depth_groups", queue="prompts") == 2
    assert value(after, "asyncrl_learner_queue_depth_groups", queue="replay") == 3
    assert value(after, "asyncrl_learner_live_processes", kind="actor") == 1
    assert value(after, "asyncrl_learner_weight_sync_seconds_count") >= 1
    assert value(after, "asyncrl_process_info", run="tele", process="learner", kind="learner") == 1
    assert value(after, "asyncrl_process_resident_memory_bytes") > 10 * 2**20
    summary = plane.run.summary()
    assert summary["step"] == 7 and summary["learner/steps"] == 30 and summary["rollout/reward_mean"] == 0.375
    assert summary["queue/prompts"] == 2 and summary["queue/replay"] == 3 and summary["queue/replay_pending"] == 0
    assert "rollout/groups_from/actor-0" not in summary  # compact: the main figures only
    learner = [h for h in plane.registry.processes()[0] if h.kind == "learner"]
    assert learner == []  # closed: it left the registry


def test_alerts_round_trip_and_need_a_name(redis_client) -> None:
    plane = ControlPlane(redis_client, "alerts")
    assert plane.run.alerts() == [] and plane.run.summary() is None
    plane.run.set_alerts([{"name": "kl_high", "severity": "critical", "message": "KL 0.2", "since": 1.0}])
    assert plane.run.alerts() == [{"name": "kl_high", "severity": "critical", "message": "KL 0.2", "since": 1.0}]
    with pytest.raises(ValueError, match="name"):
        plane.run.set_alerts([{"severity": "warning"}])
    plane.run.set_alerts([])
    assert plane.run.alerts() == []
