"""Where an alert's transitions go besides the log: :class:`Transition` (firing ↔ resolved, the JSON body) and
:class:`Webhook`, which POSTs each from a daemon thread (``health.webhook_url``). The rules and the firing set are
``learner/health/alerts.py``.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from asyncrl.common.observability.logs import get_logger

log = get_logger("health")


@dataclass(frozen=True)
class Transition:
    """An alert that changed state; the webhook's JSON body (:meth:`payload`)."""

    alert: str
    state: Literal["firing", "resolved"]
    step: int
    value: float
    message: str
    severity: str
    run: str = ""
    at: float = field(default_factory=time.time)

    def payload(self) -> dict[str, Any]:
        body = asdict(self)
        body["value"] = self.value if math.isfinite(self.value) else str(self.value)  # JSON has no NaN
        return body


class Webhook:
    """POSTs JSON bodies to one URL from a daemon thread, so a slow or dead receiver never blocks a training step.

    Delivery is best effort: at most ``backlog`` bodies wait (more are dropped and logged); a failed POST (refused,
    timed out, an HTTP error status) is logged and not retried. :meth:`close` waits a bounded time for the backlog.
    """

    def __init__(self, url: str, timeout_s: float = 2.0, backlog: int = 100) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(backlog)
        self._thread = threading.Thread(target=self._run, name="health-webhook", daemon=True)
        self._thread.start()

    def send(self, body: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            action = "the receiver is slow or down; the alert is still in the log and the metrics"
            log.warning("alert webhook backlog full, dropped one", url=self.url, alert=body.get("alert"), action=action)

    def close(self, wait_s: float = 5.0) -> None:
        """Send what is queued (for at most ``wait_s``), then stop the thread."""
        try:
            self._queue.put(None, timeout=wait_s)
        except queue.Full:
            return
        self._thread.join(wait_s)

    def _run(self) -> None:
        while (body := self._queue.get()) is not None:
            self._post(body)

    def _post(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        request = urllib.request.Request(self.url, data, {"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors; ValueError: a malformed URL
            log.warning(
                "alert webhook failed",
                url=self.url,
                alert=body.get("alert"),
                state=body.get("state"),
                error=exc,
                action="check health.webhook_url and the receiver; the alert is still in the log and the metrics",
            )
