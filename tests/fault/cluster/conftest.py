"""Fixtures and markers of the Redis Cluster and Sentinel scenarios.

Run them alone with ``pytest -m cluster`` or ``pytest -m sentinel``; their rows join
the fault suite's scenarios x invariants table (``tests/fault/conftest.py``).
"""

from __future__ import annotations

import pytest
from redis_ha import redis_cluster, redis_cluster_url, sentinel_group, shared_cluster  # noqa: F401  (fixtures)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cluster: scenarios on a private Redis Cluster "
                                       "(3 primaries + 3 replicas started by the test)")
    config.addinivalue_line("markers", "sentinel: scenarios on a private Redis primary, "
                                       "2 replicas and 3 sentinels started by the test")
