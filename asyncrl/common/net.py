"""Where other hosts reach this process: the one address every listener advertises, and whether an endpoint stays on
this machine. The standard library only: the config (``common/config``) imports it to check an endpoint."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

ADVERTISE_HOST_ENV = "ASYNCRL_ADVERTISE_HOST"
"""Set it to the address peers must use (a pod IP, a host's address on the cluster network); unset = the host name."""


def advertise_host() -> str:
    """``$ASYNCRL_ADVERTISE_HOST``, else this machine's host name: what heartbeats, the reward worker's endpoint and
    ``/metrics`` URLs carry, so nothing assumes that a peer resolves the host name or that everything is local."""
    return os.environ.get(ADVERTISE_HOST_ENV) or socket.gethostname()


WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
"""Hosts a socket binds to on every interface: no peer can connect to them as written."""


def is_loopback(endpoint: str) -> bool:
    """True for ``inproc``/``ipc`` and for ``tcp`` on a loopback address or ``localhost``."""
    parts = urlsplit(endpoint)
    if parts.scheme in ("inproc", "ipc"):
        return True
    host = (parts.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: assume it reaches beyond this machine


def advertised_endpoint(endpoint: str) -> str:
    """``endpoint`` as peers should connect to it: a wildcard host (:data:`WILDCARD_HOSTS`) becomes
    :func:`advertise_host`."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    return f"{scheme}://{advertise_host()}:{port}" if host in WILDCARD_HOSTS else endpoint
