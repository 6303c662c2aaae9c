"""The ``backend`` fixture: every contract test runs once per entry of ``BACKENDS``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_ha import redis_cluster_url, redis_sentinel_url  # noqa: F401  (server fixtures)
from servers import private_redis  # noqa: F401  (a fixture for the Redis fault tests)

from locks.backends import BACKENDS, LockEnv


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, unique: str, tmp_path) -> Iterator[LockEnv]:
    factory = BACKENDS[request.param]
    server = request.getfixturevalue(factory.server_fixture) if factory.server_fixture else None
    env = LockEnv(factory, factory.make_url(server, tmp_path), unique)
    yield env
    env.close()
