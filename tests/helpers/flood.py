"""A memory flood from a peer without the run's credential, watched from the victim's resident memory.

:func:`flood` is the attack as a stranger writes it with pyzmq: from each of ``connections`` processes at once,
one message (PUSH or DEALER) of a 16-byte "seal" and ``frames`` frames of ``frame_mb`` MB each (one buffer, sent
without a copy, so the attacker itself holds ``frame_mb`` MB). libzmq queues a whole multi-frame message before its
first frame can be read and bounds each frame, not their number: a socket that let such a peer finish its handshake
would hold ``frames × frame_mb`` MB per connection. The victim's growth is watched throughout, and the attackers are
killed once it passes the budget, so a regression fails the test instead of exhausting the machine.
"""

from __future__ import annotations

import subprocess
import sys
import time

_ATTACKER = """
import os, sys, time, zmq
endpoint, frames, frame_mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socket = zmq.Context.instance().socket(getattr(zmq, sys.argv[5]))
socket.linger = 0
socket.connect(endpoint)
socket.send_multipart([os.urandom(16)] + [bytes(frame_mb << 20)] * frames, copy=False)
time.sleep(float(sys.argv[4]))  # keep the connection (and its retries) up while the victim is watched
"""


def flood(
    endpoint: str,
    victim: int,
    budget_kib: int,
    connections: int,
    frames: int,
    frame_mb: int,
    hold_s: float = 6.0,
    kind: str = "PUSH",
) -> int:
    """Flood ``endpoint`` from ``connections`` processes at once, each a ``kind`` socket (``PUSH`` for a PULL channel,
    ``DEALER`` for a request server), for ``hold_s``; returns the largest growth of ``victim``'s resident memory seen
    (KiB, sampled every 50 ms), stopping the attackers early once it passes ``budget_kib``."""
    baseline = resident_kib(victim)
    args = [sys.executable, "-c", _ATTACKER, endpoint, str(frames), str(frame_mb), str(hold_s), kind]
    procs = [subprocess.Popen(args) for _ in range(connections)]
    grown = 0
    try:
        deadline = time.monotonic() + hold_s + 60
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline and grown <= budget_kib:
            grown = max(grown, resident_kib(victim) - baseline)
            time.sleep(0.05)
        time.sleep(0.1)
        return max(grown, resident_kib(victim) - baseline)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def resident_kib(pid: int) -> int:
    """The process's resident memory (VmRSS) in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")
