"""A real redis-server (Debian's package) on a free loopback port, for the election tests
(omnifabric.tools.redis_local starts it).

Tests that need it skip, saying why, when the binary is absent (bash tools/dev installs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from omnifabric.tools import redis_local
from omnifabric.tools.redis_local import RedisServer, free_port
from tests.conftest import scaled

__all__ = ["RedisServer", "free_port", "redis_server", "start_redis"]


def start_redis(log_dir: Path, port: int | None = None) -> RedisServer:
    """Start redis-server on 127.0.0.1 (`port`, or a free one) and wait until it answers;
    the test skips when it is not installed."""
    try:
        return redis_local.start_redis(log_dir, port, timeout_s=scaled(10))
    except FileNotFoundError as exc:
        pytest.skip(f"{exc}; tools/dev does")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test."""
    server = start_redis(tmp_path)
    try:
        yield server
    finally:
        server.stop(scaled(5))
