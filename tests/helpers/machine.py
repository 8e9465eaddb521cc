"""Tests of what only some machines can do (root, namespaces, mounts): skipped where the machine cannot, failed where
it is expected to. CI sets :data:`REQUIRE_ENV` (``.ci/run``): a fence or a mount that stopped working there must turn
the suite red, not show up as one more "s" in its summary."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE_ENV = "ASYNCRL_TESTS_REQUIRE_ISOLATION"
"""Set to 1 where the machine is root on Linux with namespaces (CI): every :func:`unavailable` fails instead."""


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test because this machine cannot do what it tries (``reason`` says what), or fail it where
    :data:`REQUIRE_ENV` says the machine must."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}; this machine is expected to ({REQUIRE_ENV}=1, as in CI)")
    pytest.skip(reason)
