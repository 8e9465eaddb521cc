"""/metrics binds where ``monitoring.metrics_host`` says: loopback by default, so a run on a shared machine does not
serve its metrics to the network; ``0.0.0.0`` (what the Kubernetes manifests set) serves every interface."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client import CollectorRegistry

from asyncrl.common.config import load_config
from asyncrl.common.net import advertise_host
from asyncrl.common.observability.metrics import start_metrics_server


def outward_address() -> str | None:
    """An address of this machine other than loopback (the one its default route leaves by), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))  # no packet is sent: this only picks the route
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def reaches(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_the_default_binds_loopback_only_and_advertises_it() -> None:
    host = load_config(None, []).monitoring.metrics_host
    assert host == "127.0.0.1"
    server = start_metrics_server("lo", "actor-0", "actor", 0, addr=host, registry=CollectorRegistry())
    try:
        assert server._server.server_address[0] == "127.0.0.1"
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"  # what rl-top --targets hands Prometheus
        assert urllib.request.urlopen(server.url, timeout=10).status == 200
        outward = outward_address()
        if outward is not None:
            assert not reaches(outward, server.port), f"/metrics answered on {outward}"
    finally:
        server.close()
    plain = start_metrics_server("lo", "actor-1", "actor", 0, registry=CollectorRegistry())  # no addr: loopback too
    try:
        assert plain._server.server_address[0] == "127.0.0.1"
    finally:
        plain.close()


def test_every_interface_when_the_config_says_so() -> None:
    host = load_config(None, ["monitoring.metrics_host=0.0.0.0"]).monitoring.metrics_host
    server = start_metrics_server("all", "reward-0", "reward", 0, addr=host, registry=CollectorRegistry())
    try:
        assert server._server.server_address[0] == "0.0.0.0"
        assert server.url == f"http://{advertise_host()}:{server.port}/metrics"
        outward = outward_address()
        assert reaches(outward or "127.0.0.1", server.port)
    finally:
        server.close()
