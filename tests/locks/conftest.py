"""The ``backend`` fixture: every contract test runs once per entry of ``BACKENDS``;
``outage``: a private server of each backend that can be taken away."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_ha import redis_cluster_url, redis_sentinel_url, shared_cluster  # noqa: F401  (server fixtures)
from servers import private_redis  # noqa: F401  (a fixture for the Redis fault tests)

from locks.backends import BACKENDS, LockEnv, Outage


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, unique: str, tmp_path) -> Iterator[LockEnv]:
    factory = BACKENDS[request.param]
    server = request.getfixturevalue(factory.server_fixture) if factory.server_fixture else None
    env = LockEnv(factory, factory.make_url(server, tmp_path), unique)
    yield env
    env.close()


@pytest.fixture(params=sorted(name for name, f in BACKENDS.items() if f.outage is not None))
def outage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Outage]:
    """A private server of the backend, started for this test and stopped after it."""
    factory = BACKENDS[request.param]
    assert factory.outage is not None
    with factory.outage(tmp_path) as server:
        yield server
