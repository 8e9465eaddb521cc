"""ZeroMQ channels on real sockets: delivery across processes, bad input, back-pressure, CURVE."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.common.observability.metrics import CHANNEL_REFUSED_CLIENTS
from asyncrl.common.tiny_models import synthetic
from asyncrl.common.transport.channel import ChannelBlocked, InsecureBindError, PullChannel, PushChannel, is_loopback
from asyncrl.common.transport.curve import CurveClient, CurveServer, create_keypair, create_run_keys
from asyncrl.common.wire.messages import RolloutGroup, encode
from tests.helpers.waits import wait_for

ROOT = Path(__file__).resolve().parents[4]

SENDER = textwrap.dedent(
    """
    import sys
    from asyncrl.common.tiny_models import synthetic
    from asyncrl.common.transport.channel import PushChannel
    push = PushChannel("rollouts", send_timeout_s=10)
    push.connect(sys.argv[1])
    push.socket.send_multipart([b"\\x93garbage"])          # malformed header
    push.socket.send_multipart([b"\\x01", b"\\x02"])       # not msgpack at all
    for i in range(int(sys.argv[2])):
        push.send(synthetic.rollout_group(4, 64, seed=i))
    push.socket.close(linger=5000)                          # deliver what is queued before exiting
    """
)


@pytest.fixture
def pull():
    channel = PullChannel("rollouts", RolloutGroup, hwm=4)
    yield channel
    channel.close()


def test_messages_from_another_process_arrive_and_bad_ones_are_skipped(pull) -> None:
    endpoint = pull.bind("tcp://127.0.0.1:0")
    sender = subprocess.Popen([sys.executable, "-c", SENDER, endpoint, "5"], cwd=ROOT)
    try:
        received = [pull.recv(timeout_s=30) for _ in range(5)]
        assert sender.wait(30) == 0
    finally:
        sender.kill()
        sender.wait()
    expected = [synthetic.rollout_group(4, 64, seed=i) for i in range(5)]
    assert [r.token_ids.tolist() for r in received] == [e.token_ids.tolist() for e in expected]
    assert pull.malformed == 2
    assert pull.recv(timeout_s=0.1) is None


def test_a_full_queue_blocks_then_raises_instead_of_dropping(pull) -> None:
    endpoint = pull.bind("tcp://127.0.0.1:0")
    push = PushChannel("rollouts", hwm=1, send_timeout_s=0.3)
    push.connect(endpoint)
    frames = encode(synthetic.rollout_group(8, 1024))
    sent = 0
    with pytest.raises(ChannelBlocked, match="peer queue full"):
        for _ in range(1000):  # nobody receives: both high-water marks fill up
            push.send_frames(frames)
            sent += 1
    assert 1 <= sent < 1000
    received = 0
    while pull.recv(timeout_s=0.5) is not None:
        received += 1
    assert received == sent  # everything accepted by send() was delivered
    push.close()


def test_binding_beyond_loopback_without_keys_is_refused(pull) -> None:
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://[::1]:1") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    with pytest.raises(InsecureBindError, match="needs CURVE keys"):
        pull.bind("tcp://0.0.0.0:0")


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    server_pub, server_sec = create_keypair(tmp_path / "server", "server")
    _client_pub, client_sec = create_keypair(tmp_path / "authorized", "client")
    stranger_pub, stranger_sec = create_keypair(tmp_path / "strangers", "stranger")
    return {
        "server_pub": server_pub,
        "server_sec": server_sec,
        "client_sec": client_sec,
        "authorized": tmp_path / "authorized",
        "stranger_pub": stranger_pub,
        "stranger_sec": stranger_sec,
    }


def _send_one(endpoint: str, curve: CurveClient | None, refused: bool = False) -> PushChannel:
    """Connect and send one group. A refused client may also block: its handshake never completes, so the
    PUSH socket has no peer to queue for (ChannelBlocked); either way nothing may arrive."""
    push = PushChannel("rollouts", send_timeout_s=1)
    push.connect(endpoint, curve)
    with contextlib.suppress(ChannelBlocked) if refused else contextlib.nullcontext():
        push.send(synthetic.rollout_group(2, 8))
    return push


def test_curve_lets_only_authorised_clients_with_the_server_key_send(pull, keys) -> None:
    endpoint = pull.bind("tcp://0.0.0.0:0", CurveServer(keys["server_sec"], keys["authorized"]))
    local = endpoint.replace("0.0.0.0", "127.0.0.1")
    senders = [
        _send_one(local, None, refused=True),  # no encryption at all
        _send_one(local, CurveClient(keys["stranger_sec"], keys["server_pub"]), refused=True),  # not authorised
        _send_one(local, CurveClient(keys["client_sec"], keys["stranger_pub"]), refused=True),  # wrong server key
    ]
    try:
        assert pull.recv(timeout_s=1.5) is None
        senders.append(_send_one(local, CurveClient(keys["client_sec"], keys["server_pub"])))
        assert isinstance(pull.recv(timeout_s=10), RolloutGroup)
        assert pull.recv(timeout_s=0.5) is None
    finally:
        for sender in senders:
            sender.close()


def test_refused_clients_are_counted_logged_once_and_a_key_added_later_is_let_in(pull, keys) -> None:
    """An unauthorised client is refused, counted and logged once; dropping its public key into the
    authorised folder lets it in without a restart. The server key may come as bytes (from a heartbeat)."""
    endpoint = pull.bind("tcp://127.0.0.1:0", CurveServer(keys["server_sec"], keys["authorized"]))
    refused = CHANNEL_REFUSED_CLIENTS.labels("rollouts")
    before = refused._value.get()
    server_key = pull.curve_public_key.encode()
    senders = [_send_one(endpoint, CurveClient(keys["stranger_sec"], server_key), refused=True) for _ in range(2)]
    try:
        wait_for(lambda: refused._value.get() >= before + 2, "second refused connection counted", timeout_s=10)
        assert refused._value.get() == before + 2 and len(pull.authorized.refused) == 1  # logged for one key
        assert pull.recv(timeout_s=0.5) is None
        shutil.copy(keys["stranger_pub"], keys["authorized"] / "stranger.key")
        senders.append(_send_one(endpoint, CurveClient(keys["stranger_sec"], server_key)))
        assert isinstance(pull.recv(timeout_s=10), RolloutGroup)
    finally:
        for sender in senders:
            sender.close()


def test_run_keys_are_made_private_and_usable(tmp_path: Path) -> None:
    settings = create_run_keys(tmp_path / "keys")
    assert oct((tmp_path / "keys").stat().st_mode & 0o777) == "0o700"
    for key in ("transport.curve_server_key", "transport.curve_client_key"):
        assert oct(Path(settings[key]).stat().st_mode & 0o777) == "0o600"
    with PullChannel("rollouts", RolloutGroup) as pull:
        secret, authorized = settings["transport.curve_server_key"], settings["transport.curve_client_keys"]
        server = CurveServer(Path(secret), Path(authorized))
        endpoint = pull.bind("tcp://127.0.0.1:0", server)
        client = CurveClient(Path(settings["transport.curve_client_key"]), pull.curve_public_key.encode())
        sender = _send_one(endpoint, client)
        try:
            assert isinstance(pull.recv(timeout_s=10), RolloutGroup)
        finally:
            sender.close()


def test_two_curve_servers_in_one_process(keys) -> None:
    """Each channel has its own ZeroMQ context, so each CURVE server has its own ZAP handler."""
    with (
        PullChannel("rollouts", RolloutGroup) as first,
        PullChannel("rollouts", RolloutGroup) as second,
    ):
        for pull in (first, second):
            endpoint = pull.bind("tcp://127.0.0.1:0", CurveServer(keys["server_sec"], keys["authorized"]))
            sender = _send_one(endpoint, CurveClient(keys["client_sec"], keys["server_pub"]))
            try:
                assert isinstance(pull.recv(timeout_s=10), RolloutGroup)
            finally:
                sender.close()


def test_a_sealed_channel_admits_only_holders_of_the_run_secret_before_reading_a_byte() -> None:
    """A sealed channel on loopback is CURVE with the run's derived keys: a peer without a seal (NULL mechanism) and one
    with another secret fail the handshake, so none of their frames is read or queued; a member's message arrives."""
    from asyncrl.common.wire.seal import Seal

    secret = bytes(range(32))
    group = synthetic.rollout_group(4, 8, seed=1)
    with PullChannel("rollouts", RolloutGroup, seal=Seal(secret, "rollouts")) as pull:
        endpoint = pull.bind("tcp://127.0.0.1:0")
        assert pull.curve_public_key == ""  # derived by every member, never advertised
        other_run = Seal(bytes(32), "rollouts")
        strangers = [PushChannel("rollouts", send_timeout_s=1), PushChannel("rollouts", seal=other_run)]
        member = PushChannel("rollouts", send_timeout_s=10, seal=Seal(secret, "rollouts"))
        try:
            for push in (*strangers, member):
                push.connect(endpoint)
            strangers[0].socket.send_multipart([b"\0" * 16, b"x" * 1024])  # what a peer writes by hand
            strangers[1].send(group)
            wait_for(lambda: pull.count_refused_handshakes() >= 2, "two refusals")
            member.send(group)
            received = pull.recv(timeout_s=10)
            assert received is not None and received.group_id == group.group_id
            assert pull.recv(timeout_s=0.5) is None  # nothing of the strangers' was queued
            assert pull.unsealed == 0 and pull.malformed == 0
        finally:
            for push in (*strangers, member):
                push.close()
