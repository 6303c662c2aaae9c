"""Fixtures for the store suite: each shared test runs on PostgreSQL and on SQLite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pg_server import private_postgres  # noqa: F401  (fixture for the PostgreSQL fault test)
from servers import private_redis  # noqa: F401  (fixture for the Redis fault tests)

from store.envs import StoreEnv
from toolguard.store import GuardedStore


def make_env(kind: str, request: pytest.FixtureRequest, unique: str, tmp_path) -> StoreEnv:
    if kind == "postgresql":
        postgres_url = request.getfixturevalue("postgres_url")
        redis_url = request.getfixturevalue("redis_url")
        return StoreEnv("postgresql", postgres_url, redis_url, f"tgstore:{unique}",
                        {"schema": f"tg_test_{unique}"})
    return StoreEnv("sqlite", f"sqlite:///{tmp_path}/store.db", f"sqlite:///{tmp_path}/locks.db",
                    f"tgstore:{unique}")


@pytest.fixture(params=["postgresql", "sqlite"])
def env(request: pytest.FixtureRequest, unique: str, tmp_path) -> Iterator[StoreEnv]:
    """One store setup (store URL + its lock backend); PostgreSQL gets a schema of its own."""
    environment = make_env(request.param, request, unique, tmp_path)
    try:
        yield environment
    finally:
        environment.drop()


@pytest.fixture
def store(env: StoreEnv) -> Iterator[GuardedStore]:
    """An installed store on ``env``."""
    opened = env.open()
    opened.install()
    try:
        yield opened
    finally:
        opened.close()
