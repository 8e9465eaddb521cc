"""CURVE for the data plane's ZeroMQ sockets, from two sources of keys:

- **the run's own** (:class:`MemberCurve`): every process of a run derives the same key pairs per channel from the run
  secret (so from the run's Redis, which needs its password), and a server accepts only the derived client key
  (:class:`MemberKey`). Used wherever a sealed channel has no operator keys, loopback included: a peer without the run's
  credential fails the handshake, before libzmq queues anything it sends.
- **the operator's** key files: the binding side's pair and a folder of authorised client public keys
  (:class:`CurveServer`, checked per handshake by :class:`AuthorizedKeys`), the connecting side's pair and the server's
  public key (:class:`CurveClient`), made by :func:`create_run_keys`. Required beyond loopback.

Why and when each applies: ``common/transport/channel.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.common.observability.logs import get_logger, worth_logging
from asyncrl.common.observability.metrics import CHANNEL_REFUSED_CLIENTS

if TYPE_CHECKING:
    from asyncrl.common.wire.seal import Seal

log = get_logger("channel")


MAX_LOGGED_KEYS = 1000
"""Refused CURVE client keys remembered (and each logged once); beyond them a refusal is logged at the 1st, 10th, …"""


@dataclass(frozen=True)
class CurveServer:
    """CURVE for the binding side: its key pair and the folder of authorised client public keys; ``on_refused`` is
    called with the Z85 public key of each refused handshake (on the ZAP thread: it must be quick and not raise)."""

    secret_key_file: Path
    authorized_clients: Path
    on_refused: Callable[[str], None] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class CurveClient:
    """CURVE for the connecting side: its own key pair, and the server's public key (a certificate file, or
    the Z85 key itself, e.g. from the server's heartbeat)."""

    secret_key_file: Path
    server_public_key: Path | bytes

    def server_key(self) -> bytes:
        import zmq.auth

        if isinstance(self.server_public_key, bytes):
            return self.server_public_key
        public, _ = zmq.auth.load_certificate(str(self.server_public_key))
        return public


@dataclass(frozen=True)
class MemberCurve:
    """The CURVE key pairs (Z85) every process of a run derives for one channel from the run secret::

        server secret = BLAKE2b(key = BLAKE2b(channel, key = secret, person = "asyncrl-curve-v1"), "server")
        client secret = the same with "client";   public = X25519 base-point multiple of the secret (zmq.curve_public)

    Whoever can compute them holds the run secret: a server that accepts only ``client_public`` admits members only.
    The server's public key is never advertised (a client derives it), so a stranger cannot even start a handshake."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def of(cls, seal: Seal) -> MemberCurve:
        import zmq
        from zmq.utils import z85

        server_secret, client_secret = (z85.encode(seal.key_seed(role)) for role in ("curve-server", "curve-client"))
        return cls(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)

    def __repr__(self) -> str:  # never the secret keys
        return f"MemberCurve(server_public={self.server_public.decode()!r})"


class MemberKey:
    """The ZAP callback of a server with :class:`MemberCurve` keys: only the run's derived client key passes."""

    def __init__(self, channel: str, client_public: bytes) -> None:
        self.channel = channel
        self.client_public = client_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self.client_public:
            return True
        CHANNEL_REFUSED_CLIENTS.labels(self.channel).inc()
        return False


class AuthorizedKeys:
    """The ZAP callback of a CURVE server: is a client's public key in the authorised folder? Counts refusals."""

    def __init__(self, channel: str, folder: Path, on_refused: Callable[[str], None] | None = None) -> None:
        self.channel = channel
        self.folder = folder
        self.on_refused = on_refused
        self.keys = self._load()
        self.refused: set[bytes] = set()  # keys logged so far (at most MAX_LOGGED_KEYS)
        self.refusals = 0

    def _load(self) -> set[bytes]:
        import zmq.auth

        if not self.folder.is_dir():
            raise ValueError(f"authorised CURVE client keys: {self.folder} is not a folder")
        return set(zmq.auth.load_certificates(str(self.folder)))

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key in self.keys:
            return True
        self.keys = self._load()  # a key added since the start is accepted without a restart
        if client_key in self.keys:
            return True
        CHANNEL_REFUSED_CLIENTS.labels(self.channel).inc()
        if self.on_refused is not None:
            self.on_refused(client_key.decode())
        self.refusals += 1
        # Each key once, up to MAX_LOGGED_KEYS of them; past that (a fresh key per handshake) the 1st, 10th, 100th, …
        if len(self.refused) < MAX_LOGGED_KEYS and client_key not in self.refused:
            self.refused.add(client_key)
        elif client_key in self.refused or not worth_logging(self.refusals):
            return False
        log.warning(
            "refused a CURVE client whose public key is not authorised",
            channel=self.channel,
            client_key=client_key.decode(),
            refused=self.refusals,
            action=f"if it is one of the run's processes, put its public key file into {self.folder}",
        )
        return False


def create_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` into ``directory``; returns both paths."""
    import zmq.auth

    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    return Path(public), Path(secret)


def create_run_keys(directory: str | Path) -> dict[str, str]:
    """CURVE keys for one run in ``directory``: the reward workers' server pair, one client pair for the actors,
    and ``authorized/`` holding that client's public key. Secret files are 0600, the folder 0700. Returns the
    ``transport.*`` settings that use them (``--set`` them, or put them in the config)."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    _server_public, server_secret = create_keypair(folder, "server")
    client_public, client_secret = create_keypair(folder, "client")
    authorized = folder / "authorized"
    authorized.mkdir(exist_ok=True)
    (authorized / client_public.name).write_bytes(client_public.read_bytes())
    for secret in (server_secret, client_secret):
        secret.chmod(0o600)
    return {
        "transport.curve_server_key": str(server_secret),
        "transport.curve_client_keys": str(authorized),
        "transport.curve_client_key": str(client_secret),
    }
