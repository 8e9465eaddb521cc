"""Reading a process's Prometheus ``/metrics`` in tests (processes bind every interface; tests read on loopback)."""

from __future__ import annotations

import urllib.request

from common.wire import Heartbeat


def metric(heartbeat: Heartbeat, name: str) -> float:
    """The sum of the samples of ``name`` (all label sets) on the process's ``/metrics``; 0 when it has none."""
    port = heartbeat.metrics_url.rsplit(":", 1)[1].split("/")[0]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = [line for line in text.splitlines() if line.startswith((f"{name} ", f"{name}{{"))]
    return sum(float(line.rsplit(" ", 1)[1]) for line in samples)
