"""The run's secret, kept in its Redis: what every :class:`~asyncrl.common.wire.seal.Seal` of the run is keyed with."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from asyncrl.common.wire.seal import SECRET_BYTES, Seal

if TYPE_CHECKING:
    import redis

    from asyncrl.common.plane.keys import RunKeys


def run_secret(client: redis.Redis, keys: RunKeys) -> bytes:
    """The run's secret from its Redis, made now (``SET NX``: one value whoever asks first) when there is none."""
    client.set(keys.secret, os.urandom(SECRET_BYTES), nx=True)
    secret = client.get(keys.secret)
    if not isinstance(secret, bytes) or len(secret) < 16:  # nil (a client that decodes replies would give str)
        raise RuntimeError(f"{keys.secret} in Redis holds no usable run secret; delete the key and restart the run")
    return bytes(secret)


def run_seal(client: redis.Redis, keys: RunKeys, channel: str) -> Seal:
    """The :class:`Seal` of ``channel`` in the run whose keys are ``keys``."""
    return Seal(run_secret(client, keys), channel)
