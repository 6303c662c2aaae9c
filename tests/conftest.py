"""Shared fixtures: the machine's Redis and PostgreSQL, and private servers for fault tests.

On CI (``CI=true``) a missing server is a failure, never a skip.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import pytest

REDIS_URL = os.environ.get("TOOLGUARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("TOOLGUARD_TEST_DATABASE_URL",
                              "postgresql://postgres@127.0.0.1:5432/test")
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_server(name: str, reachable: bool, detail: str) -> None:
    """Skip locally, fail on CI: a server test that did not run is not a pass."""
    if reachable:
        return
    message = f"{name} is not reachable ({detail})"
    if ON_CI:
        pytest.fail(f"{message}; CI must provide it", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
        ok, detail = True, ""
    except Exception as error:
        ok, detail = False, str(error)
    require_server("Redis", ok, f"{REDIS_URL}: {detail}")
    return REDIS_URL


@pytest.fixture(scope="session")
def postgres_url() -> str:
    import psycopg

    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        ok, detail = True, ""
    except Exception as error:
        ok, detail = False, str(error)
    require_server("PostgreSQL", ok, f"{POSTGRES_URL}: {detail}")
    return POSTGRES_URL


@pytest.fixture
def unique() -> str:
    """A fresh namespace so tests sharing a server never see each other's keys."""
    return uuid.uuid4().hex[:12]


@pytest.fixture
def sqlite_path(tmp_path) -> Iterator[str]:
    yield str(tmp_path / "toolguard.db")


@pytest.fixture(autouse=True)
def _no_terminal_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output under test is piped: a COLUMNS/LINES exported by the runner (pytest-xdist
    workers, a CI shell) would make the CLI wrap at that width instead."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
