"""The previous server's port: kept when it frees up within the wait (a killed server's last thread closes its
socket a moment after the process shows as a zombie), given up when another process holds it."""

from __future__ import annotations

import socket
import threading

from asyncrl.common.plane.redis_server import _free_or_zero, free_port


def listen_on(port: int) -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen()
    return listener


def test_a_port_released_within_the_wait_is_kept() -> None:
    port = free_port()
    listener = listen_on(port)
    threading.Timer(0.3, listener.close).start()
    assert _free_or_zero(port, wait_s=5.0) == port


def test_a_port_held_past_the_wait_is_given_up() -> None:
    port = free_port()
    with listen_on(port):
        assert _free_or_zero(port, wait_s=0.2) == 0


def test_no_previous_port_means_none_to_keep() -> None:
    assert _free_or_zero(0) == 0
