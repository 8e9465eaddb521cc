"""Every process serves /metrics where ``monitoring.metrics_host`` says: each call of ``start_metrics_server`` in the
product passes ``addr=`` (without it the server binds loopback, and a pod's probes and Prometheus cannot reach it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def calls_without_addr() -> tuple[list[str], int]:
    """(``file:line`` of each product call of start_metrics_server without ``addr=``, how many calls there are)."""
    missing, total = [], 0
    for path in sorted(p for part in ("actors", "common", "learner") for p in (ROOT / "asyncrl" / part).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "start_metrics_server":
                total += 1
                if not any(k.arg == "addr" for k in node.keywords):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return missing, total


def test_every_metrics_server_binds_the_configured_host() -> None:
    missing, total = calls_without_addr()
    assert total >= 3  # the learner, the rollout actor, the reward worker
    assert missing == [], "pass addr=config.monitoring.metrics_host"
