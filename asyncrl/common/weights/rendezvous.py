"""The weight group's rendezvous: a ``torch.distributed`` store kept in the run's Redis.

Why not ``TCPStore``: its server listens on every interface whatever host it is given (measured here: a master made
for ``127.0.0.1`` listens on ``*:port``), and it has no authentication, so anyone who reaches the port may read and
write the keys a formation is built from (a rogue client could write keys into a live run's store). Every process
of a run already holds the run's Redis credentials, so the rendezvous lives there: nothing new listens, and only a
holder of the run's Redis password can join a formation or write into it. Gloo and NCCL read the store only while a
group forms (each rank's address, a few keys), so the extra round trips cost milliseconds once per formation.

Keys live under ``asyncrl:<run>:rendezvous:`` and expire after ``ttl_s`` (a formation uses them for seconds).
``get`` and ``wait`` block, as ``TCPStore``'s do, by polling every :data:`POLL_S` until the keys exist or the
timeout passes; then they raise :class:`TimeoutError`, which the process group turns into a failed formation. A
member's store also stops waiting, the same way, once its formation is marked given up (``abandoned_key``): the
learner marks a formation it gave up on, so a member waiting there for one that died joins the next formation at
once instead of after ``weight_sync.timeout_s``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import redis
from torch.distributed.distributed_c10d import Store

from asyncrl.common.plane import replies

POLL_S = 0.005
"""How often a blocking ``get``/``wait`` looks for its keys."""
ABANDONED_POLL_S = 0.1
"""How often a blocking wait looks whether its formation was given up."""

_COMPARE_SET = """
local current = redis.call('GET', KEYS[1])
if (current == false and ARGV[1] == '') or current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return ARGV[2]
end
if current == false then return ARGV[1] end
return current
"""


def rendezvous_prefix(run: str) -> str:
    """The Redis key prefix of ``run``'s weight-group rendezvous."""
    return f"asyncrl:{run}:rendezvous:"


class RedisStore(Store):
    """A ``torch.distributed.Store`` on Redis, for ``ProcessGroupGloo``/``ProcessGroupNCCL`` rendezvous.

    ``client`` is a connection to the run's Redis (its password is what admits a member); ``timeout_s`` bounds
    every blocking call; keys expire ``ttl_s`` after they are written; once the key ``abandoned_key`` exists, a
    blocking call raises :class:`TimeoutError` at once (looked at every :data:`ABANDONED_POLL_S`).
    """

    def __init__(
        self, client: redis.Redis, run: str, timeout_s: float, ttl_s: float = 3600.0, abandoned_key: str | None = None
    ) -> None:
        super().__init__()
        self.client = client
        self.prefix = rendezvous_prefix(run)
        self.timeout_s = timeout_s
        self.ttl_s = max(int(ttl_s), 1)
        self.abandoned_key = abandoned_key
        self._compare_set = client.register_script(_COMPARE_SET)

    @classmethod
    def connect(cls, url: str, run: str, timeout_s: float, abandoned_key: str | None = None) -> RedisStore:
        """A store with a connection of its own to ``url`` (a weight-group member inside a vLLM worker)."""
        client = redis.Redis.from_url(url, socket_connect_timeout=min(timeout_s, 30.0))
        return cls(client, run, timeout_s, abandoned_key=abandoned_key)

    def close(self) -> None:
        self.client.close()

    def _key(self, key: str) -> str:
        return self.prefix + key

    # -- the Store interface (the names and signatures torch's PythonStore calls)
    def set(self, key: str, value: bytes | str) -> None:
        self.client.set(self._key(key), value, ex=self.ttl_s)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = replies.maybe_blob(self.client.get(self._key(key)))
        if value is None:  # expired between the wait and the read
            raise TimeoutError(f"rendezvous key {key!r} vanished")
        return bytes(value)

    def add(self, key: str, value: int) -> int:
        pipe = self.client.pipeline(transaction=True)
        pipe.incrby(self._key(key), value)
        pipe.expire(self._key(key), self.ttl_s)
        return int(pipe.execute()[0])

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        return bytes(self._compare_set(keys=[self._key(key)], args=[expected_value, desired_value, self.ttl_s]))

    def check(self, keys: Sequence[str]) -> bool:
        return int(self.client.exists(*[self._key(k) for k in keys])) == len(keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = self.timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        look_again = time.monotonic() + ABANDONED_POLL_S
        while not self.check(keys):
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"rendezvous keys {list(keys)} not set within {limit:g}s")
            if self.abandoned_key is not None and now > look_again:
                look_again = now + ABANDONED_POLL_S
                if self.check([self.abandoned_key]):
                    raise TimeoutError("the learner gave up on this formation: not waited for")
            time.sleep(POLL_S)

    def delete_key(self, key: str) -> bool:
        return bool(self.client.delete(self._key(key)))

    def num_keys(self) -> int:
        return sum(1 for _ in self.client.scan_iter(match=self.prefix + "*", count=1000))
