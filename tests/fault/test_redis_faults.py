"""Redis lock server faults: killed and restarted empty, client connections cut or stalled.

Agents take their locks from a private ``redis-server`` (directly, or through a
``TcpProxy``) and write to a schema of their own in the shared PostgreSQL.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from servers import RedisServer

import toolguard.locks.redis
from fault.harness import LINK_FAULTS, FaultRun, break_link, timed
from fault.workload import Setup
from toolguard.errors import BackendUnavailable, LockTimeout
from toolguard.locks import connect

pytestmark = pytest.mark.fault


def redis_setup(lock_url: str, postgres_url: str, schema: str, unique: str) -> Setup:
    return Setup(lock_url=lock_url, store_url=postgres_url, prefix=f"tgf:{unique}",
                 store_options={"schema": schema, "timeout_s": 3, "max_size": 6},
                 ttl_ms=500, wait_s=3)


@pytest.mark.timeout(60)
def test_redis_killed_and_restarted_empty(private_redis: RedisServer, postgres_url: str,
                                          pg_schema: str, unique: str, tmp_path: Path) -> None:
    setup = redis_setup(private_redis.url, postgres_url, pg_schema, unique)
    with FaultRun("redis: SIGKILL, restart empty", setup, tmp_path) as run:
        run.start_threads(4)
        run.warm_up()
        run.fault_started()
        private_redis.kill()
        time.sleep(0.7)  # longer than the TTL: every lease is lost meanwhile
        private_redis.start()
        run.healed()
        run.finish()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", list(LINK_FAULTS))
def test_redis_connections_broken(fault: str, private_redis: RedisServer, proxies,
                                  postgres_url: str, pg_schema: str, unique: str,
                                  tmp_path: Path) -> None:
    proxy = proxies(private_redis.port)
    direct = redis_setup(private_redis.url, postgres_url, pg_schema, unique)
    setup = replace(direct, lock_url=f"redis://127.0.0.1:{proxy.port}/0")
    with FaultRun(f"redis: connections {fault}", setup, tmp_path, direct=direct) as run:
        run.start_threads(4)
        run.warm_up()
        run.fault_started()
        break_link(proxy, fault)
        run.healed()
        run.finish()


@pytest.mark.timeout(60)
def test_redis_calls_are_bounded_while_stalled(private_redis: RedisServer, proxies,
                                               monkeypatch: pytest.MonkeyPatch,
                                               unique: str) -> None:
    """Release never hangs and acquire keeps its deadline on a link that stopped answering.

    (The default socket timeout is 5 s; 1 s here to keep the test short.)
    """
    monkeypatch.setattr(toolguard.locks.redis, "SOCKET_TIMEOUT_S", 1.0)
    proxy = proxies(private_redis.port)
    locks = connect(f"redis://127.0.0.1:{proxy.port}/0", ttl_ms=500, timeout_s=1)
    try:
        lease = locks.acquire([f"{unique}:held"])
        proxy.stall()
        took, _ = timed(lease.release, 3.0)
        assert took is not None, "release hung on a stalled link"
        took, outcome = timed(lambda: locks.acquire([f"{unique}:new"], timeout_s=1), 4.0)
        assert took is not None, "acquire ignored its deadline on a stalled link"
        assert isinstance(outcome, BackendUnavailable | LockTimeout), outcome
        assert lease.lost or lease.released
        proxy.heal()
        with locks.acquire([f"{unique}:new"], timeout_s=5) as again:  # and back to normal
            assert again.tokens
    finally:
        proxy.heal()
        locks.close()
