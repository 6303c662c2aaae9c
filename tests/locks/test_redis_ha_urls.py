"""Cluster and Sentinel URLs: what they mean, and clear errors for what they cannot mean."""

from __future__ import annotations

import pytest

from toolguard.errors import ConfigurationError
from toolguard.locks import connect, open_backend
from toolguard.locks.redis_ha import RedisSentinelBackend, parse_redis_ha_url


def test_cluster_url_names_every_startup_node_and_options() -> None:
    url = parse_redis_ha_url("rediss+cluster://app:s3cret@r1:7000,[::1]:7001?socket_timeout=0.5")
    assert url.nodes == (("r1", 7000), ("::1", 7001))
    assert (url.username, url.password, url.tls, url.service) == ("app", "s3cret", True, None)
    options = url.connection_options()
    assert options["socket_timeout"] == 0.5 and options["ssl"] is True
    assert "s3cret" not in repr(url)


def test_sentinel_url_names_the_service_and_db() -> None:
    url = parse_redis_ha_url("redis+sentinel://s1:26379,s2:26379/orders/3"
                             "?sentinel_password=x&socket_connect_timeout=2")
    assert (url.service, url.db, url.nodes[1]) == ("orders", 3, ("s2", 26379))
    assert url.options == {"sentinel_password": "x", "socket_connect_timeout": 2.0}


@pytest.mark.parametrize(("url", "says"), [
    ("redis+cluster://r1", "is not host:port"),
    ("redis+cluster://r1:0", "is not host:port"),
    ("redis+cluster://r1:7000/0", "no path or db number"),
    ("redis+sentinel://s1:26379", "must name the monitored primary"),
    ("redis+sentinel://s1:26379/orders/x", "is not a number"),
    ("redis+sentinel://s1:26379/a/b/c", "must name the monitored primary"),
    ("redis+cluster://r1:7000?sentinel_password=x", "unknown option 'sentinel_password'"),
    ("redis+cluster://r1:7000?socket_timeout=-1", "must be positive"),
    ("redis+cluster://u:hunter2@r1:7000?socket_timeout=soon", "not a number of seconds"),
])
def test_a_wrong_url_is_a_configuration_error_that_says_why(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says) as raised:
        connect(url)
    assert "hunter2" not in str(raised.value)


def test_schemes_pick_the_ha_backends() -> None:
    backend = open_backend("redis+sentinel://127.0.0.1:1/orders")  # connects on first use
    try:
        assert isinstance(backend, RedisSentinelBackend)
        assert backend.info.name == "redis-sentinel"
    finally:
        backend.close()
