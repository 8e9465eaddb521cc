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


WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
"""Hosts a socket binds to on every interface: no peer can connect to them as written."""


def advertised_endpoint(endpoint: str) -> str:
    """``endpoint`` as peers should connect to it: a wildcard host (:data:`WILDCARD_HOSTS`) becomes
    :func:`advertise_host`."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    return f"{scheme}://{advertise_host()}:{port}" if host in WILDCARD_HOSTS else endpoint
