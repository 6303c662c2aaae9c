"""``quota_env``: every backend test runs on Redis, PostgreSQL (a schema of its own) and SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from store.envs import drop_schema

from quotas.envs import QuotaEnv


@pytest.fixture(params=["redis", "postgresql", "sqlite"])
def quota_env(request: pytest.FixtureRequest, unique: str, tmp_path: Path) -> Iterator[QuotaEnv]:
    if request.param == "redis":
        env = QuotaEnv("redis", request.getfixturevalue("redis_url"), unique)
    elif request.param == "postgresql":
        env = QuotaEnv("postgresql", request.getfixturevalue("postgres_url"), unique)
    else:
        env = QuotaEnv("sqlite", f"sqlite:///{tmp_path}/store.db", unique)
    env.install()
    try:
        yield env
    finally:
        if env.kind == "postgresql":
            drop_schema(env.url, env.schema)
        elif env.kind == "redis":
            import redis

            client = redis.Redis.from_url(env.url)
            keys = list(client.scan_iter(match=f"{{tgq-{unique}}}:*"))
            if keys:
                client.delete(*keys)
            client.close()
