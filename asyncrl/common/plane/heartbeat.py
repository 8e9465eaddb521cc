"""A background thread that keeps a process registered in its run with a heartbeat key (TTL)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from asyncrl.common.observability.logs import get_logger
from asyncrl.common.plane.control import ControlPlane
from asyncrl.common.wire.messages import Heartbeat

log = get_logger("heartbeat")


class HeartbeatThread:
    """Calls ``make()`` every ``period_s`` and stores the result with a TTL of ``ttl_s``.

    A missed beat (Redis unreachable) is logged and retried at the next period; the process
    counts as dead only when beats stop for longer than the TTL. ``stop()`` removes the
    registration at once (a clean goodbye), so the learner need not wait for the TTL.
    """

    def __init__(self, plane: ControlPlane, make: Callable[[], Heartbeat], period_s: float, ttl_s: float) -> None:
        self.plane = plane
        self.make = make
        self.period_s = period_s
        self.ttl_s = ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._process_id = ""

    def start(self) -> HeartbeatThread:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        """Send one heartbeat now (e.g. right after a state change)."""
        heartbeat = self.make()
        self._process_id = heartbeat.process_id
        self.plane.registry.beat(heartbeat, self.ttl_s)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.beat()
            except Exception as exc:  # keep beating through a Redis blip; the TTL decides liveness
                log.warning("heartbeat failed; retrying", process=self._process_id, error=exc)

    def stop(self, leave: bool = True) -> None:
        """Stop beating and (``leave``) remove the registration at once; a second call does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.period_s + 5)
        if leave and self._process_id:
            try:
                self.plane.registry.leave(self._process_id)
            except Exception as exc:
                log.warning("could not leave the registry; the heartbeat will expire", error=exc)
