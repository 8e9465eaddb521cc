"""Observability of a live run started as a user starts it (`rl-launch run`): every process's /metrics endpoint is
found in Redis, scraped over HTTP and parsed as Prometheus text; `rl-top` runs in a real terminal (tmux) and its
screen shows the processes, the learner's step and the queues. And the Redis password is nowhere it should not be:
in no command line of the run's processes (vLLM's included), on no /metrics page, in no file of the run folder but
the two that hold it (0600).

Set ``RL_TOP_SCREEN_OUT=path`` to keep the captured rl-top screen (docs/rl-top.txt was made that way).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.control import ControlPlane
from common.keys import connect
from tests.e2e.test_system import finish
from tests.helpers.runs import step_rows
from tests.helpers.secrets import files_exposing, pages_showing, processes_showing

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RUN = "obs"
T = TypeVar("T")

# Series every process of a kind must expose (a labelled learner series: one of its label sets must be there).
COMMON = ["asyncrl_process_info", "asyncrl_process_resident_memory_bytes"]
EXPECTED = {
    "actor": [
        "asyncrl_actor_generated_tokens_total",
        "asyncrl_actor_generated_groups_total",
        "asyncrl_actor_generation_seconds_count",
        "asyncrl_actor_policy_version",
        "asyncrl_actor_running_groups",
        "asyncrl_channel_sent_messages_total",
    ],
    "reward": [
        "asyncrl_reward_scored_groups_total",
        "asyncrl_reward_scoring_seconds_count",
        "asyncrl_replay_entries_added_total",
    ],
    "learner": [
        "asyncrl_learner_steps_total",
        "asyncrl_learner_trained_tokens_total",
        "asyncrl_learner_step_seconds_count",
        "asyncrl_learner_weight_sync_seconds_count",
        "asyncrl_learner_policy_version",
        "asyncrl_learner_idle_ratio",
        "asyncrl_learner_reward",
        "asyncrl_learner_kl_nats",
        "asyncrl_learner_clipped_tokens_ratio",
        "asyncrl_learner_grad_norm",
        "asyncrl_learner_staleness_versions",
        "asyncrl_learner_queue_depth_groups",
        "asyncrl_learner_live_processes",
        "asyncrl_learner_dropped_groups_total",
        "asyncrl_dispatcher_released_groups_total",
    ],
}


def scrape(url: str) -> dict[str, float]:
    """``{sample name{labels}: value}`` and ``{sample name: sum}`` of one /metrics page, parsed as Prometheus text."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
            samples[s.name] = samples.get(s.name, 0.0) + s.value
    return samples


def wait_for(what: str, probe: Callable[[], T | None], proc: subprocess.Popen, timeout_s: float = 600) -> T:
    """``probe()``'s first truthy result while the run is alive (a missing file counts as not yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = probe()
        except FileNotFoundError:
            result = None
        if result:
            return result
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def steps_done(run_dir: Path) -> int:
    return len(step_rows(run_dir))  # the demo config's eval rounds have rows of their own


def test_every_process_serves_metrics_and_rl_top_shows_the_run(tmp_path: Path, model_dir: Path) -> None:
    run_dir = tmp_path / RUN
    args = [BIN / "rl-launch", "run", ROOT / "configs/demo.toml", "--actors", "2", "--rewards", "1"]
    settings = [f"run.root={tmp_path}", f"run.name={RUN}", f"model.path={model_dir}", "learner.steps=30"]
    settings.append("eval.every=0")  # eval rounds: tests/e2e/test_eval.py's
    for override in settings:
        args += ["--set", override]
    proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    try:
        wait_for("step 3", lambda: steps_done(run_dir) >= 3, proc)
        url = (run_dir / "redis" / "url").read_text().strip()
        plane = ControlPlane(connect(url), RUN)
        endpoints = check_metrics_endpoints(plane, proc)
        password = urlsplit(url).password
        assert not processes_showing(password, proc.pid), "the Redis password is in a command line of the run"
        assert not pages_showing(password, endpoints)
        screen = rl_top_screen(url, proc)
        assert finish(proc, 900) == 0
    finally:
        finish(proc, 1)
    assert not files_exposing(password, run_dir)
    (tmp_path / "rl-top.txt").write_text(screen)
    if out := os.environ.get("RL_TOP_SCREEN_OUT"):
        Path(out).write_text(screen)


def check_metrics_endpoints(plane: ControlPlane, proc: subprocess.Popen) -> list[str]:
    """Every process, the learner included, heartbeats its /metrics URL; it answers with the series of its kind.
    Returns the URLs."""
    wanted = {"learner", "actor-0", "actor-1", "reward-0"}

    def endpoints() -> dict[str, dict] | None:
        found = {e["process_id"]: e for e in plane.registry.metrics_endpoints()}
        return found if wanted <= set(found) else None

    found = wait_for("every process registered its /metrics", endpoints, proc, timeout_s=60)
    heartbeats = {h.process_id: h for h in plane.registry.processes()[0]}
    totals: dict[str, float] = {}
    for process_id in sorted(wanted):
        endpoint = found[process_id]
        assert endpoint["url"] == f"http://{endpoint['host']}:{endpoint['port']}/metrics"
        samples = scrape(endpoint["url"])
        kind = endpoint["kind"]
        missing = [s for s in COMMON + EXPECTED[kind] if s not in samples]
        assert not missing, f"{process_id} ({kind}) lacks {missing}"
        info = f'asyncrl_process_info{{kind="{kind}",process="{process_id}",run="{RUN}"}}'
        assert samples.get(info) == 1.0, f"{process_id}: no {info}"
        assert heartbeats[process_id].metrics_url == endpoint["url"]  # the heartbeat is the one advertisement
        for name in EXPECTED[kind]:
            totals[name] = totals.get(name, 0.0) + samples[name]
    assert totals["asyncrl_actor_generated_tokens_total"] > 0
    assert totals["asyncrl_reward_scored_groups_total"] > 0
    assert totals["asyncrl_learner_steps_total"] >= 3
    return [found[p]["url"] for p in sorted(wanted)]


def rl_top_screen(url: str, proc: subprocess.Popen) -> str:
    """rl-top in a 160x50 tmux pane (its own tmux server): the screen once it shows the learner's step."""
    server = f"asyncrl-test-{os.getpid()}"
    tmux = ["tmux", "-L", server]
    command = shlex.join([str(BIN / "rl-top"), "--redis", url, "--run", RUN, "--interval", "0.5"])
    subprocess.run([*tmux, "new-session", "-d", "-s", "rltop", "-x", "160", "-y", "50", command], check=True)
    try:

        def screen() -> str | None:
            text = subprocess.run([*tmux, "capture-pane", "-p", "-t", "rltop"], capture_output=True, text=True).stdout
            return text if "learner  step" in text and "actor-1" in text else None

        text = wait_for("rl-top to show the learner's step and the actors", screen, proc, timeout_s=60)
    finally:
        subprocess.run([*tmux, "kill-session", "-t", "rltop"], capture_output=True)
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    lines = text.rstrip().splitlines()
    assert lines[0].startswith(f"asyncrl run '{RUN}'   policy version")
    assert any(line.startswith("queues   prompts") and "replay" in line and "pending" in line for line in lines)
    assert any(line.startswith("learner  step ") and "/30" in line and "reward" in line for line in lines)
    assert any("staleness max" in line for line in lines)
    for process_id, kind in (("actor-0", "actor"), ("actor-1", "actor"), ("reward-0", "reward")):
        assert any(line.split()[:2] == [process_id, kind] for line in lines), f"{process_id} not on screen"
    return "\n".join(lines) + "\n"
