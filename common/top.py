"""``rl-top``: a live terminal view of a run, read from its Redis alone.

Shows the policy version, the prompt queue, groups in flight, the replay stream (length,
pending), dead letters, and every actor and reward worker with its state, version, throughput
and heartbeat age. Refreshes in place on any terminal (ANSI home + clear); ``--once`` prints a
single frame for scripts.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, help="Live view of an asyncrl run.")


def snapshot(plane) -> dict:
    """Everything the view shows, read in a few round trips."""
    client, keys = plane.client, plane.keys
    live, lost = plane.processes()
    pending = 0
    if client.exists(keys.replay):
        groups = client.xinfo_groups(keys.replay)
        pending = sum(int(g["pending"]) for g in groups)
    return {
        "run": keys.run,
        "version": plane.version(),
        "prompt_queue": plane.queue_depth(),
        "in_flight": int(client.hlen(keys.inflight)),
        "replay_length": int(client.xlen(keys.replay)),
        "replay_pending": pending,
        "dead_letters": int(client.xlen(keys.dead)),
        "processes": live,
        "lost": lost,
    }


def render(snap: dict, now: float | None = None) -> str:
    now = now or time.time()
    lines = [
        f"asyncrl run {snap['run']!r}   policy version {snap['version']}   {time.strftime('%H:%M:%S')}",
        f"prompts queued {snap['prompt_queue']:>6}   in flight {snap['in_flight']:>6}   "
        f"replay {snap['replay_length']:>6} (pending {snap['replay_pending']})   dead letters {snap['dead_letters']}",
        "",
        f"{'process':<28} {'kind':<7} {'state':<12} {'version':>7} {'tokens/s':>10} {'age s':>6}",
    ]
    for hb in sorted(snap["processes"], key=lambda h: (h.kind, h.process_id)):
        lines.append(
            f"{hb.process_id[:28]:<28} {hb.kind:<7} {hb.state[:12]:<12} {hb.version:>7} "
            f"{hb.tokens_per_s:>10.0f} {now - hb.sent_at:>6.1f}"
        )
    if not snap["processes"]:
        lines.append("(no actors or reward workers registered)")
    if snap["lost"]:
        lines += ["", f"lost (heartbeat expired): {', '.join(snap['lost'])}"]
    return "\n".join(lines)


@app.command()
def main_command(
    run: Annotated[str, typer.Option(help="Run name.")] = "demo",
    redis: Annotated[str | None, typer.Option(help="Redis URL (default: the run's embedded Redis).")] = None,
    root: Annotated[str, typer.Option(help="Runs folder, to find an embedded Redis.")] = "runs",
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
) -> None:
    """Watch a run live (Ctrl-C to quit)."""
    from common.cliutil import redis_url
    from common.control import ControlPlane, connect

    plane = ControlPlane(connect(redis_url(redis, run, root)), run)
    if once:
        print(render(snapshot(plane)))
        return
    try:
        while True:
            frame = render(snapshot(plane))
            print("\x1b[H\x1b[2J" + frame, flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
