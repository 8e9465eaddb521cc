"""Where other hosts reach this process: the one address every listener advertises."""

from __future__ import annotations

import os
import socket

ADVERTISE_HOST_ENV = "ASYNCRL_ADVERTISE_HOST"
"""Set it to the address peers must use (a pod IP, a host's address on the cluster network); unset = the host name."""


def advertise_host() -> str:
    """``$ASYNCRL_ADVERTISE_HOST``, else this machine's host name: what heartbeats, the reward worker's endpoint and
    ``/metrics`` URLs carry, so nothing assumes that a peer resolves the host name or that everything is local."""
    return os.environ.get(ADVERTISE_HOST_ENV) or socket.gethostname()
