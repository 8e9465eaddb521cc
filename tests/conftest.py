"""Shared fixtures: a real embedded Redis per test, free ports, and the slow-tier switch."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.keys import connect
from common.redis_server import EmbeddedRedis

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run the slow e2e tier (CI does)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow e2e tier: run with --slow (CI runs it)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A real redis-server with AOF in a temporary folder, stopped after the test."""
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis):
    client = connect(redis_server.url)
    yield client
    client.close()
