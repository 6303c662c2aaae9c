"""Lock state for idle resources does not pile up: Redis expires it, PostgreSQL and etcd
are swept (``toolguard.locks.upkeep``). Each test on a private server of its own."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
import redis
from pg_server import PgServer
from servers import RedisServer

from toolguard.errors import ConfigurationError
from toolguard.locks import connect, heartbeat
from toolguard.locks.upkeep import compact_etcd, sweep_postgres_locks

#: Long enough that the 2,000 lock cycles below all finish inside it on a loaded machine (at
#: 1 s, a CI run under load saw 946 of the 2,000 counters already expired when it counted).
COUNTER_TTL_MS = 6_000


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_redis_memory_returns_to_its_baseline_after_the_counter_ttl(
        private_redis: RedisServer) -> None:
    client = redis.Redis(port=private_redis.port)
    locks = connect(private_redis.url, counter_ttl_ms=COUNTER_TTL_MS, ttl_ms=500)
    try:
        locks.acquire("warm").release()  # scripts loaded: not part of the lock state
        assert wait_until(lambda: client.dbsize() == 0, 10)
        baseline = client.info("memory")["used_memory"]
        for i in range(2_000):
            locks.acquire(f"idle:{i}").release()
        assert client.dbsize() == 2_000  # one counter per resource, nothing else
        grown = client.info("memory")["used_memory"]
        assert grown > baseline + 2_000 * 50
        # Redis expires keys actively: all of them go within a few cycles after the TTL.
        assert wait_until(lambda: client.dbsize() == 0, COUNTER_TTL_MS / 1000 + 10)
        back = client.info("memory")["used_memory"]
        assert back - baseline < (grown - baseline) / 10, (baseline, grown, back)
    finally:
        locks.close()
        client.close()


def _counts(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {table: conn.execute(f"SELECT count(*) FROM toolguard_lock_{table}").fetchone()[0]
                for table in ("fence", "holder", "waiter")}


def test_postgres_sweep_removes_idle_keys_and_tokens_keep_growing(
        private_postgres: PgServer) -> None:
    url = private_postgres.url
    locks = connect(url, ttl_ms=5_000)
    try:
        tokens = {}
        for i in range(300):
            with locks.acquire(f"idle:{i}") as lease:
                tokens[f"idle:{i}"] = lease.token
        crashed = locks.acquire("crashed", ttl_ms=200)  # its process "died": never renewed
        heartbeat().remove(crashed)
        held = locks.acquire("held")  # a live holder: its rows must stay
        time.sleep(0.3)
        assert _counts(url) == {"fence": 302, "holder": 2, "waiter": 0}
        swept = sweep_postgres_locks(url, idle_s=0, batch=100)
        assert (swept.fences, swept.holders, swept.waiters) == (301, 1, 0)
        assert _counts(url) == {"fence": 1, "holder": 1, "waiter": 0}
        assert not held.lost
        held.release()
        # Each swept key's next token is still above the one it had before the sweep.
        for key in ("idle:0", "idle:299", "crashed"):
            with locks.acquire(key) as again:
                assert again.token > tokens.get(key, crashed.token)
        assert sweep_postgres_locks(url, idle_s=3600).fences == 0  # nothing that old
    finally:
        locks.close()


def test_postgres_sweep_rejects_nonsense_settings(private_postgres: PgServer) -> None:
    with pytest.raises(ConfigurationError, match="idle_s"):
        sweep_postgres_locks(private_postgres.url, idle_s=-1)


@pytest.fixture
def private_etcd() -> Iterator[str]:
    from etcd_server import EtcdCluster, require_etcd

    require_etcd()
    cluster = EtcdCluster(1).start()
    try:
        yield cluster.url
    finally:
        cluster.stop()


def test_etcd_keeps_no_keys_for_idle_locks_and_compaction_shrinks_it(private_etcd: str) -> None:
    from etcd3gw.client import Etcd3Client

    from toolguard.locks.etcd import DEFAULT_PREFIX, parse_etcd_url

    (host, port), = parse_etcd_url(private_etcd)[0]
    etcd = Etcd3Client(host=host, port=port, timeout=5)
    locks = connect(private_etcd, ttl_ms=1_000)
    try:
        for i in range(400):
            locks.acquire(f"idle:{i}").release()
        # Released locks leave no key behind: only the cluster's epoch (one key, see locks/etcd.py).
        left = [meta["key"] for _value, meta in etcd.get_prefix(DEFAULT_PREFIX)]
        assert left == [f"{DEFAULT_PREFIX}epoch".encode()], left
        head = int(etcd.status()["header"]["revision"])
        done = compact_etcd(private_etcd, keep_revisions=10)
        assert done.revision == head - 10
        (before, after), = done.sizes.values()
        assert after < before, done.sizes  # the history of 400 lock cycles is gone
        assert compact_etcd(private_etcd, keep_revisions=10**9).revision == 0
        with locks.acquire("idle:0", timeout_s=2):  # and the locks still work
            pass
    finally:
        locks.close()
        etcd.session.close()
