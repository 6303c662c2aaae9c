"""Waiters blocked in the lock's wake-up ``BLPOP`` on a primary that a failover demotes.

A demoted primary answers every blocked command ``-UNBLOCKED force unblock from blocking
operation, instance state changed (master -> replica?)`` (Sentinel also drops the
clients), then redirects (``MOVED``) or refuses writes (``READONLY``). Through a planned
``CLUSTER FAILOVER``, a primary paused past ``cluster-node-timeout`` and demoted when it
resumes, and a Sentinel failover, a waiter (one sync, one asyncio) goes on waiting on the
new primary and gets the lock once its holder releases it there: never a redis-py error.

The waiters block in one long ``BLPOP`` (up to 30 s, instead of half a second between
looks), so each is surely blocked on the old primary when it is demoted, not between two
polls: the state these tests are about. Every server is started by the test.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable

import pytest
import redis
from redis.cluster import key_slot
from redis_ha import RedisClusterGroup, RedisNode, SentinelGroup

from toolguard.errors import BackendUnavailable
from toolguard.locks import connect, connect_async, manager, open_backend
from toolguard.locks.redis import redis_keys

pytestmark = [pytest.mark.fault]

#: The waiters' deadline, TTLs and socket timeout: far past every failover here. The
#: socket timeout caps one BLPOP at half of it.
WAIT_S = 60.0
TTL_MS = 120_000
OPTIONS = "?socket_timeout=60"


@pytest.fixture(autouse=True)
def long_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """One BLPOP lasts until the waiter's hand-off is due (30 s here), not half a second."""
    monkeypatch.setattr(manager, "MAX_POLL_S", 40.0)


def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except (redis.RedisError, OSError):
            pass
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        time.sleep(0.02)


def blocked(node: RedisNode) -> int:
    with node.client() as client:
        return sum(1 for c in client.client_list() if c["cmd"] == "blpop" and "b" in c["flags"])


def role(node: RedisNode) -> str:
    return str(node.info("replication").get("role"))


def unblocked(node: RedisNode) -> int:
    stats = node.info("errorstats").get("errorstat_UNBLOCKED")
    return int(stats["count"]) if isinstance(stats, dict) else 0


def in_sync(primary: RedisNode, replicas: list[RedisNode]) -> bool:
    offset = primary.info("replication")["master_repl_offset"]
    return all(r.info("replication").get("slave_repl_offset") == offset for r in replicas)


class Waiters:
    """A sync and an asyncio waiter, each in its own thread, on keys a holder holds."""

    def __init__(self, url: str, keys: tuple[str, str]) -> None:
        self.outcomes: dict[str, object] = {}
        self.threads = [threading.Thread(target=self._sync, args=(url, keys[0]), daemon=True),
                        threading.Thread(target=lambda: asyncio.run(self._async(url, keys[1])),
                                         daemon=True)]
        for thread in self.threads:
            thread.start()

    def _sync(self, url: str, key: str) -> None:
        locks = connect(url, ttl_ms=TTL_MS, timeout_s=WAIT_S, presence_ms=TTL_MS)
        try:
            with locks.acquire(key) as lease:
                self.outcomes["sync"] = lease.token
        except BaseException as error:  # what the test checks
            self.outcomes["sync"] = error
        finally:
            locks.close()

    async def _async(self, url: str, key: str) -> None:
        locks = connect_async(url, ttl_ms=TTL_MS, timeout_s=WAIT_S, presence_ms=TTL_MS)
        try:
            async with locks.acquire(key) as lease:
                self.outcomes["asyncio"] = lease.token
        except BaseException as error:  # what the test checks
            self.outcomes["asyncio"] = error
        finally:
            await locks.aclose()

    def results(self) -> dict[str, object]:
        for thread in self.threads:
            thread.join(timeout=WAIT_S + 10)
        return self.outcomes


class Holder:
    """Holds keys through its own backend; releases them on whichever primary has them."""

    def __init__(self, url: str, keys: tuple[str, ...]) -> None:
        self.backend = open_backend(url)
        self.owner = f"{secrets.token_hex(8)}:{TTL_MS}"
        self.keys = keys
        for key in keys:
            assert self.backend.try_acquire(key, self.owner, TTL_MS).token is not None

    def release(self) -> None:
        for key in self.keys:
            for _ in range(20):  # the first calls may still meet the old primary
                try:
                    assert self.backend.release(key, self.owner)
                    break
                except BackendUnavailable:
                    time.sleep(0.1)
            else:
                pytest.fail(f"could not release {key} on the new primary")
        self.backend.close()


def assert_got_their_locks(outcomes: dict[str, object]) -> None:
    raw = {mode: f"{type(o).__name__}: {o}" for mode, o in outcomes.items()
           if isinstance(o, redis.RedisError)}
    assert not raw, f"a raw redis error reached the caller: {raw}"
    assert sorted(outcomes) == ["asyncio", "sync"], outcomes
    assert all(isinstance(token, int) for token in outcomes.values()), outcomes


# --- Redis Cluster --------------------------------------------------------------------------


def keys_on(cluster: RedisClusterGroup, primary: RedisNode, prefix: str) -> tuple[str, str]:
    views = cluster.topology()
    owner = next(v for v in views if v.port == primary.port)
    found = [f"{prefix}:{i}" for i in range(1_000)
             if owner.owns(key_slot(redis_keys(f"{prefix}:{i}")[0][0].encode()))]
    return found[0], found[1]


def through_cluster_demotion(cluster: RedisClusterGroup, unique: str,
                             demote: Callable[[RedisNode, RedisNode], None]) -> None:
    url = cluster.url + OPTIONS
    primary = cluster.primaries()[0]
    replica = cluster.replicas_of(primary)[0]
    keys = keys_on(cluster, primary, unique)
    holder = Holder(url, keys)
    waiters = Waiters(url, keys)
    until(lambda: blocked(primary) == 2, "both waiters blocked on the primary")
    until(lambda: in_sync(primary, [replica]), "the replica caught up")
    demote(primary, replica)
    until(lambda: role(primary) == "slave", "the old primary demoted")
    assert unblocked(primary) == 2, "the waiters were not blocked when the primary was demoted"
    holder.release()
    assert_got_their_locks(waiters.results())


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_waiters_go_on_waiting_through_a_planned_cluster_failover(
        redis_cluster: RedisClusterGroup, unique: str) -> None:
    def planned(_primary: RedisNode, replica: RedisNode) -> None:
        with replica.client() as client:
            client.execute_command("CLUSTER", "FAILOVER")

    through_cluster_demotion(redis_cluster, unique, planned)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_waiters_go_on_waiting_through_a_paused_primarys_demotion(
        redis_cluster: RedisClusterGroup, unique: str) -> None:
    """SIGSTOP past ``cluster-node-timeout``: the replica takes over; SIGCONT: the old primary
    learns it lost its slots and becomes the new one's replica."""
    def paused(primary: RedisNode, replica: RedisNode) -> None:
        primary.pause()
        try:
            until(lambda: role(replica) == "master", "the replica promoted")
        finally:
            primary.resume()

    through_cluster_demotion(redis_cluster, unique, paused)


# --- Sentinel -------------------------------------------------------------------------------


@pytest.mark.sentinel
@pytest.mark.timeout(120)
def test_waiters_go_on_waiting_through_a_sentinel_failover(sentinel_group: SentinelGroup,
                                                           unique: str) -> None:
    """``SENTINEL FAILOVER``: a replica is promoted at once; the sentinels turn the old
    primary into its replica some seconds later (Sentinel waits 8 s before it reconfigures a
    server that still says it is a primary), then drop its clients."""
    url = sentinel_group.url + OPTIONS
    old = sentinel_group.primary
    keys = (f"{unique}:a", f"{unique}:b")
    holder = Holder(url, keys)
    waiters = Waiters(url, keys)
    until(lambda: blocked(old) == 2, "both waiters blocked on the primary")
    until(lambda: in_sync(old, sentinel_group.replicas), "the replicas caught up")
    started = time.monotonic()
    with sentinel_group.sentinels[0].client() as client:
        client.execute_command("SENTINEL", "FAILOVER", sentinel_group.SERVICE)
    sentinel_group.wait_failover(old)
    until(lambda: role(old) == "slave", "the old primary demoted")
    assert time.monotonic() - started < 25, "demoted after the waiters' BLPOP would have ended"
    holder.release()
    assert_got_their_locks(waiters.results())
