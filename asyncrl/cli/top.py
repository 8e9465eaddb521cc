"""``rl-top``: a live terminal view of a run, read from its Redis alone.

Shows the policy version, the queues (prompts, groups in flight, the replay stream's length and pending
entries, dead letters), the learner's last step (reward, KL, staleness, timings — from the summary it writes
each step), the alerts its health check holds active, and every actor and reward worker with its state,
version, throughput, heartbeat age and ``/metrics`` endpoint — and flags an actor whose weights' digest is not
the one the learner sent as its version. Refreshes in place on any terminal (ANSI:
cursor home, rewrite each line, clear the rest); ``--once`` prints one frame for scripts; ``--targets`` prints
the run's ``/metrics`` endpoints as Prometheus file_sd JSON.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer

from asyncrl.cli.util import RedisFileOpt, RedisOpt

app = typer.Typer(add_completion=False, help="Live view of an asyncrl run.")

_HOME, _CLEAR_LINE, _CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
_HIDE_CURSOR, _SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def snapshot(plane) -> dict[str, Any]:
    """Everything the view shows, read in a few round trips."""
    from asyncrl.common.plane.process_registry import metrics_endpoint

    live, lost = plane.registry.processes()
    return {
        "run": plane.keys.run,
        "config_found": bool(plane.client.exists(plane.keys.config)),
        "version": plane.run.version(),
        "queues": plane.queue_depths(),
        "processes": live,
        "lost": lost,
        "summary": plane.run.summary(),
        "alerts": plane.run.alerts(),
        "digests": plane.run.digests(),
        "samples": plane.run.samples(),
        "eval": _eval_rounds(plane),
        "endpoints": {beat.process_id: e for beat in live if (e := metrics_endpoint(beat)) is not None},
        "episodes_per_group": _episodes_per_group(plane),
    }


def _episodes_per_group(plane) -> int:
    """K in a multi-turn run (each group in flight is K episodes), 0 otherwise or before a config is published."""
    try:
        config = plane.run.read_config()
    except Exception:  # no config yet, or one this version cannot read: the frame shows groups only
        return 0
    return config.rollout.num_samples if config.rollout.workflow == "multi_turn" else 0


def render(snap: dict[str, Any], now: float | None = None) -> str:
    """One frame as plain text (no escape codes)."""
    now = now or time.time()
    q = snap["queues"]
    unread = f", unread {q['replay_unread']}" if "replay_unread" in q else ""
    k = snap.get("episodes_per_group", 0)
    episodes = f" ({q['inflight'] * k} episodes)" if k else ""
    lines = [
        f"asyncrl run {snap['run']!r}   policy version {snap['version']}   {time.strftime('%H:%M:%S')}",
        f"queues   prompts {q['prompts']:>5}   in flight {q['inflight']:>5}{episodes}   replay {q['replay']:>5} "
        f"(pending {q['replay_pending']}{unread})   dead letters {q['dead_letters']}",
    ]
    if not snap.get("config_found", True):
        lines.append(f"(no config published for run {snap['run']!r} in this Redis: check --run and --redis)")
    lines += ["", *_learner_lines(snap.get("summary"), snap.get("endpoints", {}), now)]
    lines += _sample_lines(snap.get("samples", []))
    lines += _eval_lines(snap.get("eval", []))
    lines += ["", *_alert_lines(snap.get("alerts", []), now)]
    lines += ["", *_process_lines(snap, now)]
    return "\n".join(lines)


def _learner_lines(s: dict[str, Any] | None, endpoints: dict[str, dict], now: float) -> list[str]:
    metrics = endpoints.get("learner")
    where = f"   metrics {metrics['host']}:{metrics['port']}" if metrics else ""
    if not s:
        return [f"learner  no step published yet{where}"]

    def v(key: str) -> float:
        return float(s.get(key, 0.0))

    def optional(label: str, key: str, fmt: str) -> str:
        return f"   {label} {s[key]:{fmt}}" if key in s else ""

    kl = optional("kl(ref)", "train/loss/kl_ref", ".4f") or optional("kl(reward)", "train/kl_reward/kl", ".4f")
    tokens_s = v("rollout/tokens") / v("step/seconds") if v("step/seconds") > 0 else 0.0
    sync = f"   sync {v('sync/seconds'):.2f}s" if "sync/seconds" in s else ""
    age = now - v("time") if "time" in s else 0.0
    return [
        f"learner  step {int(v('step'))}/{s.get('learner/steps', '?')}   version {int(v('version'))}   "
        f"reward {v('rollout/reward_mean'):.3f} ± {v('rollout/reward_std'):.3f}{kl}   "
        f"mismatch {v('train/offpolicy/mismatch_kl'):.2e}{optional('entropy', 'train/loss/entropy', '.3f')}",
        f"         staleness max {v('rollout/staleness_max'):.0f} mean {v('rollout/staleness_mean'):.2f}   "
        f"dropped stale {int(v('groups/dropped_stale'))}   grad norm {v('train/grad_norm'):.3f}   "
        f"clip {v('train/loss/clip_frac'):.3f}",
        f"         step {v('step/seconds'):.2f}s{sync}   idle {100 * v('step/idle_fraction'):.0f}%"
        f"{optional('actors wanted', 'actors/wanted', '.0f')}   "
        f"trained tokens/s {tokens_s:,.0f}   last step {age:.1f}s ago{where}",
        *_length_lines(s),
        *_latency_lines(s),
        *_episode_lines(s),
    ]


def _length_lines(s: dict[str, Any]) -> list[str]:
    """Response lengths of the last step (``rollout/response_tokens_*``), when it published them."""
    if "rollout/response_tokens_mean" not in s:
        return []
    return [
        f"         responses: tokens mean {s['rollout/response_tokens_mean']:.1f}   "
        f"p95 {s['rollout/response_tokens_p95']:.0f}   max {s['rollout/response_tokens_max']:.0f}   "
        f"truncated {100 * s['rollout/truncated_frac']:.0f}%"
    ]


def _latency_lines(s: dict[str, Any]) -> list[str]:
    """Where the last step's groups spent their time (``latency/*``), when it published it."""
    if "latency/total_s" not in s:
        return []
    stages = "   ".join(f"{name} {s[f'latency/{name}_s']:.2f}s" for name in ("queued", "generate", "scoring", "replay"))
    return [f"         group time: {stages}   total {s['latency/total_s']:.2f}s (max {s['latency/total_s_max']:.2f}s)"]


def _episode_lines(s: dict[str, Any]) -> list[str]:
    """Multi-turn episodes of the last step (``rollout/episode_*``), when it trained any."""
    if "rollout/episode_turns_mean" not in s:
        return []
    return [
        f"         episodes: turns {s['rollout/episode_turns_mean']:.1f} (max {s['rollout/episode_turns_max']:.0f})   "
        f"tokens {s['rollout/episode_tokens_mean']:.0f} (max {s['rollout/episode_tokens_max']:.0f})   "
        f"sampled by the model {100 * s['rollout/episode_sampled_frac']:.0f}%"
        + (
            f"   tool calls {s['rollout/episode_tool_calls_mean']:.2f} per episode "
            f"({s['rollout/episode_malformed_calls_mean']:.2f} malformed)"
            if "rollout/episode_tool_calls_mean" in s
            else ""
        ),
        *_ending_lines(s),
    ]


def _ending_lines(s: dict[str, Any]) -> list[str]:
    """How the last step's episodes ended where the model did not choose to (a limit cut them), and the episodes
    environment faults ended (generated again, untrained)."""
    if "rollout/episode_endings/stop" not in s:
        return []
    cut = {name: s.get(f"rollout/episode_endings/{name}", 0.0) for name in ("length", "max_turns", "deadline")}
    return [
        f"         ended by a limit {100 * (1 - s['rollout/episode_endings/stop']):.0f}% "
        f"(tokens {100 * cut['length']:.0f}%, turns {100 * cut['max_turns']:.0f}%, "
        f"time {100 * cut['deadline']:.0f}%)   environment faults {s['rollout/faulted_episodes']:.0f} episodes "
        f"({100 * s['rollout/env_error_frac']:.1f}%, generated again)"
    ]


def _sample_lines(rows: list[dict[str, Any]], width: int = 60) -> list[str]:
    """The newest samples.jsonl rows' worst and best response, one line each (``repr``: newlines stay visible)."""
    shown = [r for r in rows if r.get("pick") in ("worst", "best")]
    lines = [f"samples  step {shown[0]['step']} (samples.jsonl)"] if shown else []
    for r in shown:
        advantage = f"{r['advantage']:+.2f}" if isinstance(r.get("advantage"), int | float) else "-"
        lines.append(
            f"  {r['pick']:<5} reward {r['reward']:.2f} adv {advantage} {r['finish_reason']:<6} "
            f"{r['prompt'][-width // 2 :]!r} -> {r['response'][:width]!r}"
        )
    return lines


def _eval_rounds(plane) -> list[dict[str, Any]]:
    """The newest eval rounds' rows (``learner/intake/evaluation.py``), oldest first."""
    raw = plane.client.get(plane.keys.eval)
    return json.loads(raw) if raw is not None else []


def _eval_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line: the first and the newest eval rounds (``eval/*`` of metrics.jsonl)."""
    if not rows:
        return []

    def one(r: dict[str, Any]) -> str:
        k = int(r.get("eval/k", 1))
        return (
            f"step {int(r['eval/step'])} pass@{k} {r.get('eval/pass@k', 0.0):.3f} "
            f"mean@{k} {r.get('eval/mean@k', 0.0):.3f} ({int(r['eval/groups'])} prompts)"
        )

    shown = [rows[0], rows[-1]] if len(rows) > 1 else rows
    return ["eval     " + "   ->   ".join(one(r) for r in shown)]


def _alert_lines(alerts: list[dict[str, Any]], now: float) -> list[str]:
    if not alerts:
        return ["alerts   none active"]
    lines = [f"alerts   {len(alerts)} active"]
    for a in alerts:
        since = f" (for {now - float(a['since']):.0f}s)" if isinstance(a.get("since"), int | float) else ""
        severity = str(a.get("severity", "warning")).upper()
        lines.append(f"  {severity:<9} {a['name']:<24} {a.get('message', '')}{since}")
    return lines


def _process_lines(snap: dict[str, Any], now: float) -> list[str]:
    lines = [
        f"{'process':<28} {'kind':<7} {'state':<15} {'version':>7} {'tokens/s':>10} {'age s':>6} {'pid':>8}  metrics"
    ]
    endpoints = snap.get("endpoints", {})
    for hb in sorted(snap["processes"], key=lambda h: (h.kind, h.process_id)):
        e = endpoints.get(hb.process_id)
        address = f"{e['host']}:{e['port']}" if e else "-"
        lines.append(
            f"{hb.process_id[:28]:<28} {hb.kind:<7} {hb.state[:15]:<15} {hb.version:>7} "
            f"{hb.tokens_per_s:>10.0f} {now - hb.sent_at:>6.1f} {hb.pid or '-':>8}  {address}"
        )
    if not snap["processes"]:
        lines.append("(no actors or reward workers registered)")
    if wrong := unexpected_weights(snap["processes"], snap.get("digests", {})):
        lines += ["", "UNEXPECTED WEIGHTS (digest is not the one the learner sent for the version):"]
        lines += [f"  {line}" for line in wrong]
    if snap["lost"]:
        lost = ", ".join(f"{pid} ({kind})" for pid, kind in snap["lost"].items())
        lines += ["", f"lost (heartbeat expired): {lost}"]
    return lines


def unexpected_weights(processes, digests: dict[int, str]) -> list[str]:
    """One line per actor serving a digest other than the one the learner last sent as its version.

    An actor on the model folder's weights (version 0, no digest yet) or on a version whose digest is unknown (sent
    by a learner before digests existed) is not flagged: there is nothing to compare with.
    """
    return [
        f"{hb.process_id}: version {hb.version} digest {hb.weights_digest}, expected {digests[hb.version]}"
        for hb in processes
        if hb.kind == "actor" and hb.weights_digest and digests.get(hb.version, hb.weights_digest) != hb.weights_digest
    ]


def targets(endpoints: list[dict[str, Any]], run: str) -> list[dict[str, Any]]:
    """Prometheus ``file_sd_configs`` entries: one target group per process, labelled with run, process, kind."""
    return [
        {"targets": [f"{e['host']}:{e['port']}"], "labels": {"run": run, "process": e["process_id"], "kind": e["kind"]}}
        for e in endpoints
    ]


def frame_for_terminal(text: str) -> str:
    """``text`` drawn over the previous frame: home, each line then clear-to-end-of-line, then clear below."""
    return _HOME + "".join(f"{line}{_CLEAR_LINE}\n" for line in text.splitlines()) + _CLEAR_BELOW


@app.command()
def main_command(
    run: Annotated[str, typer.Option(help="Run name.")] = "demo",
    redis: RedisOpt = None,
    redis_file: RedisFileOpt = None,
    root: Annotated[str, typer.Option(help="Runs folder, to find an embedded Redis.")] = "runs",
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    as_targets: Annotated[
        bool, typer.Option("--targets", help="Print the /metrics endpoints as Prometheus file_sd JSON and exit.")
    ] = False,
) -> None:
    """Watch a run live (Ctrl-C to quit)."""
    from asyncrl.cli.util import redis_url
    from asyncrl.common.plane.control import ControlPlane
    from asyncrl.common.plane.keys import connect

    url = redis_url(redis, run, root, url_file=redis_file)
    # A monitor shows an outage within seconds (and the run again when Redis is back) instead of waiting it out.
    plane = ControlPlane(connect(url, outage_s=2.0), run)
    if as_targets or once:
        _print_once(plane, url, root, as_targets)
        return
    _watch(plane, interval)


def _print_once(plane, url: str, root: str, as_targets: bool) -> None:
    """One frame (or the targets); a Redis that does not answer, in one line saying why that is usual (asked once,
    with no retry: the run's processes wait out an outage, a look at a run need not)."""
    import redis
    import redis.exceptions

    from asyncrl.cli.util import fail

    run = plane.keys.run
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
        if as_targets:
            text = json.dumps(targets(plane.registry.metrics_endpoints(), run), indent=2)
        else:
            text = render(snapshot(plane))
    except redis.exceptions.RedisError as exc:
        fail(
            f"run {run!r}: its Redis does not answer ({exc}); a run's Redis stops when the run ends — its figures "
            f"stay in {root}/{run}/metrics.jsonl, and `rl-launch redis CONFIG` serves the finished run again",
            code=1,
        )
    print(text)


def _watch(plane, interval: float) -> None:
    """Redraw every ``interval`` seconds until Ctrl-C; a Redis outage is shown, not fatal."""
    import signal

    import redis.exceptions

    # Ctrl-C is the way out even when a shell started us with SIGINT ignored (a non-interactive `cmd &` does)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(_HIDE_CURSOR + "\x1b[2J", end="", flush=True)
    try:
        while True:
            try:
                text = render(snapshot(plane))
            except redis.exceptions.RedisError as exc:
                text = f"asyncrl run {plane.keys.run!r}   {time.strftime('%H:%M:%S')}\nredis unreachable: {exc}"
            print(frame_for_terminal(text), end="", flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        print(_SHOW_CURSOR, end="", flush=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
