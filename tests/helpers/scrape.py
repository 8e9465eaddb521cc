"""Reading a process's Prometheus ``/metrics`` in tests (processes bind every interface; tests read on loopback)."""

from __future__ import annotations

import urllib.request

from asyncrl.common.wire.messages import Heartbeat


def metric(heartbeat: Heartbeat, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of the samples of ``name`` on the process's ``/metrics`` (those with ``labels`` among theirs, or all
    label sets); 0 when it has none."""
    port = heartbeat.metrics_url.rsplit(":", 1)[1].split("/")[0]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = [line for line in text.splitlines() if line.startswith((f"{name} ", f"{name}{{"))]
    wanted = [f'{key}="{value}"' for key, value in (labels or {}).items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in samples if all(pair in line for pair in wanted))
