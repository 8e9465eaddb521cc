"""What a test run spends its time on: the start-ups it pays (vLLM engines, torchrun launches, warm starts of the
tiny model, redis-servers), counted by watching ``/proc`` from the pytest process, so every process any test starts
is counted however it was started (by ``rl-launch``, by a fixture, by another process)."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import Counter
from pathlib import Path
from types import ModuleType

KINDS = {
    "vLLM engines": lambda cmd: cmd.startswith("VLLM::EngineCore"),
    "torchrun launches": lambda cmd: any(part.endswith("torchrun") for part in cmd.split(" ", 2)[:2])
    or "torch.distributed.run" in cmd,
    "warm starts": lambda cmd: "init-model" in cmd and "--warm-steps" in cmd,
    "redis-servers": lambda cmd: cmd.startswith("redis-server") or "/redis-server " in cmd,
}


def command_line(pid: int | str) -> str:
    """``pid``'s command line, its arguments joined by spaces (``OSError`` once it has ended)."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


RECHECK_S = 10.0
"""How long a new process that matches no kind is looked at again (vLLM renames its engine core after the fork)."""


class StartupCounter:
    """Counts processes of each kind in :data:`KINDS`, each once, by polling ``/proc`` every ``poll_s`` from a daemon
    thread. An engine or a launcher lives for seconds, so none slips between polls; vLLM renames its engine process
    (``VLLM::EngineCore``) a moment after it starts, so a process that matches no kind is looked at again for
    :data:`RECHECK_S`. A PID looked at is not read again while it stays in ``/proc`` (it cannot be reused before it
    leaves): a poll reads only new processes, where reading every process's files at each poll once cost the pytest
    process ~5% of a core."""

    def __init__(self, poll_s: float = 0.25) -> None:
        self.poll_s = poll_s
        self.counts: Counter[str] = Counter()
        self.in_process: Counter[str] = Counter()  # start-ups paid inside the pytest process (by the fixtures)
        self.seen_at: dict[str, list[float]] = {kind: [] for kind in KINDS}  # wall-clock times, for :meth:`by_test`
        self._settled: set[str] = set()  # PIDs counted, or that matched no kind for RECHECK_S
        self._unsettled: dict[str, float] = {}  # PIDs that matched no kind yet: when first looked at (monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="startup-counter", daemon=True)

    def start(self) -> StartupCounter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def count_calls(self, module: ModuleType, name: str, kind: str) -> None:
        """Count each call of ``module.name`` as a start-up of ``kind`` (set before the tests import it)."""
        original = getattr(module, name)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.in_process[kind] += 1
            return original(*args, **kwargs)

        setattr(module, name, counted)

    def total(self, kind: str) -> int:
        return self.counts[kind] + self.in_process[kind]

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        running = {entry for entry in os.listdir("/proc") if entry.isdigit()}
        self._settled &= running  # a PID that left may come back as another process
        self._unsettled = {pid: first for pid, first in self._unsettled.items() if pid in running}
        now = time.monotonic()
        for pid in running - self._settled:
            try:
                command = command_line(pid)
            except OSError:
                continue  # gone between listing and reading
            kind = next((kind for kind, matches in KINDS.items() if command and matches(command)), None)
            if kind is not None:
                self.counts[kind] += 1
                self.seen_at[kind].append(time.time())
            if kind is not None or now - self._unsettled.setdefault(pid, now) >= RECHECK_S:
                self._settled.add(pid)
                self._unsettled.pop(pid, None)

    def report(self, started: float) -> list[str]:
        minutes = (time.monotonic() - started) / 60
        parts = ", ".join(f"{self.total(kind)} {kind}" for kind in KINDS)
        return [f"start-ups in {minutes:.1f} min: {parts}"]

    def by_module(self, kind: str, spans: list[tuple[str, float, float]]) -> Counter[str]:
        """How many start-ups of ``kind`` each test module paid, given each test phase's ``(nodeid, start, stop)``
        in wall-clock seconds: a start-up belongs to the phase it was seen in (the serial chain runs one such phase
        at a time); one seen between phases to ``(between tests)``."""
        paid: Counter[str] = Counter()
        for seen in self.seen_at[kind]:
            owners = [nodeid for nodeid, start, stop in spans if start <= seen <= stop + self.poll_s]
            paid[owners[0].split("::", 1)[0] if owners else "(between tests)"] += 1
        return paid
