"""Locks on a real Redis Cluster: spread over slots and primaries, all-or-nothing across
primaries, no deadlock, and redirections (ASK, MOVED, TRYAGAIN) during a resharding.

Every test starts its own cluster (3 primaries + 3 replicas on free loopback ports).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, defaultdict

import pytest
import redis
from redis.cluster import key_slot
from redis_ha import RedisClusterGroup, RedisNode

from toolguard.errors import BackendUnavailable, LockTimeout
from toolguard.locks import LockManager, connect
from toolguard.locks.redis import AsyncRedisBackend, RedisBackend, redis_keys
from toolguard.locks.redis_ha import (
    AsyncRedisClusterBackend,
    RedisClusterBackend,
    RedisSentinelBackend,
)

pytestmark = [pytest.mark.fault, pytest.mark.cluster]


def lock_key(key: str) -> str:
    return redis_keys(key)[0][0]


def slot_of(key: str) -> int:
    return key_slot(lock_key(key).encode())


def keys_by_primary(cluster: RedisClusterGroup, prefix: str, per_primary: int = 1,
                    ) -> dict[int, list[str]]:
    """Lock keys grouped by the port of the primary that serves them."""
    primaries = {n.port for n in cluster.primaries()}
    found: dict[int, list[str]] = defaultdict(list)
    for i in range(10_000):
        key = f"{prefix}:k{i}"
        port = cluster.primary_of_key(lock_key(key)).port
        if len(found[port]) < per_primary:
            found[port].append(key)
        if len(found) == len(primaries) and all(len(v) >= per_primary for v in found.values()):
            return dict(found)
    raise AssertionError("could not find keys on every primary")


def holder_on(node: RedisNode, key: str) -> str | None:
    with node.client() as client:
        return client.get(lock_key(key))


def test_backends_set_the_same_attributes_as_the_single_server_one(redis_url: str,
                                                                   redis_cluster_url: str) -> None:
    """The cluster backend builds itself without ``RedisBackend.__init__``: nothing may be
    missing when that constructor gains an attribute (the sentinel one inherits it)."""
    single = RedisBackend(redis_url)
    cluster = RedisClusterBackend(redis_cluster_url)
    try:
        assert set(vars(cluster)) == set(vars(single))
        assert cluster.info.name == "redis-cluster"
        assert cluster._max_block_s == single._max_block_s  # the same socket timeout
        assert issubclass(RedisSentinelBackend, RedisBackend)
    finally:
        single.close()
        cluster.close()
    asingle = AsyncRedisBackend(redis_url)
    acluster = AsyncRedisClusterBackend(redis_cluster_url)  # connects on first use
    assert set(vars(acluster)) == set(vars(asingle))


def test_an_unreachable_cluster_is_a_backend_error() -> None:
    with pytest.raises(BackendUnavailable, match=r"127\.0\.0\.1:1\b"):
        connect("redis+cluster://127.0.0.1:1")


@pytest.mark.timeout(60)
def test_locks_spread_over_slots_and_primaries(shared_cluster: RedisClusterGroup,
                                               unique: str) -> None:
    locks = connect(shared_cluster.url, ttl_ms=5_000, timeout_s=5)
    keys = [f"{unique}:r{i}" for i in range(60)]
    try:
        with locks.acquire(keys) as lease:
            owners: Counter[int] = Counter()
            for key in keys:
                primary = shared_cluster.primary_of_key(lock_key(key))
                # The lock lives on the primary that serves its slot, and only there.
                assert holder_on(primary, key) == lease.owner
                owners[primary.port] += 1
            slots = {slot_of(key) for key in keys}
        assert len(owners) == 3, f"60 locks landed on {len(owners)} primaries: {owners}"
        assert len(slots) == 60
        for key in keys:  # released on every primary
            assert holder_on(shared_cluster.primary_of_key(lock_key(key)), key) is None
    finally:
        locks.close()


@pytest.mark.timeout(60)
def test_multi_key_lease_across_primaries_is_all_or_nothing(shared_cluster: RedisClusterGroup,
                                                            unique: str) -> None:
    (first, *_), (second, *_), _ = keys_by_primary(shared_cluster, unique).values()
    holder = connect(shared_cluster.url, ttl_ms=5_000)
    contender = connect(shared_cluster.url, ttl_ms=5_000)
    try:
        with holder.acquire([second]):
            with pytest.raises(LockTimeout) as timed_out:
                contender.acquire([first, second], timeout_s=1.0)
            assert timed_out.value.keys == (second,)
            # The key on the other primary was given back: free, nobody queued.
            assert holder_on(shared_cluster.primary_of_key(lock_key(first)), first) is None
            with contender.acquire([first], timeout_s=0):
                pass
        with contender.acquire([first, second], timeout_s=2) as both:
            assert set(both.tokens) == {first, second}
    finally:
        holder.close()
        contender.close()


@pytest.mark.timeout(90)
def test_overlapping_sets_across_primaries_never_deadlock(shared_cluster: RedisClusterGroup,
                                                          unique: str) -> None:
    """Agents take overlapping sets of keys on all three primaries, each listing its keys
    in its own order: every round completes and no two holders of a key overlap."""
    groups = list(keys_by_primary(shared_cluster, unique, per_primary=2).values())
    keys = [k for group in groups for k in group]
    sets = [[keys[0], keys[2], keys[4]], [keys[4], keys[2], keys[0]], [keys[5], keys[1], keys[3]],
            [keys[3], keys[0]], [keys[1], keys[4], keys[5]], [keys[2], keys[3], keys[1]]]
    inside: Counter[str] = Counter()
    overlaps: list[str] = []
    guard = threading.Lock()
    errors: list[BaseException] = []
    rounds = 15

    def agent(index: int, locks: LockManager) -> None:
        try:
            for _ in range(rounds):
                with locks.acquire(sets[index], ttl_ms=5_000, timeout_s=30):
                    with guard:
                        inside.update(sets[index])
                        overlaps.extend(k for k in sets[index] if inside[k] > 1)
                    time.sleep(0.002)
                    with guard:
                        inside.subtract(sets[index])
        except BaseException as error:
            errors.append(error)

    managers = [connect(shared_cluster.url) for _ in sets]
    threads = [threading.Thread(target=agent, args=(i, m), daemon=True)
               for i, m in enumerate(managers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "an agent is stuck: deadlock"
        assert not errors, errors[:1]
        assert not overlaps, f"two holders of {overlaps[:3]} at once"
    finally:
        for manager in managers:
            manager.close()


def _refuses(node: RedisNode, key: str, error: type[Exception]) -> bool:
    """``node`` answers a plain GET of ``key`` with ``error`` (ASK or MOVED)."""
    with node.client() as client:
        try:
            client.get(key)
        except error:
            return True
    return False


def as_single_server(node: RedisNode, key: str) -> set[str]:
    """What the single-server backends (sync and asyncio) pointed at ``node`` get for
    ``key``: ``BackendUnavailable``, from the redis-py errors named here."""
    url = f"redis://127.0.0.1:{node.port}/0"
    causes: list[BaseException | None] = []
    backend = RedisBackend(url)
    try:
        with pytest.raises(BackendUnavailable) as caught:
            backend.try_acquire(key, "contender:3000", 3_000)
        causes.append(caught.value.__cause__)
    finally:
        backend.close()

    async def attempt() -> None:
        abackend = AsyncRedisBackend(url)
        try:
            with pytest.raises(BackendUnavailable) as caught:
                await abackend.try_acquire(key, "contender:3000", 3_000)
            causes.append(caught.value.__cause__)
        finally:
            await abackend.aclose()

    asyncio.run(attempt())
    return {type(cause).__name__ for cause in causes}


@pytest.mark.timeout(60)
def test_ask_and_moved_are_followed_while_a_slot_moves(redis_cluster: RedisClusterGroup,
                                                       unique: str) -> None:
    key = f"{unique}:moving"
    locks = connect(redis_cluster.url, ttl_ms=3_000, timeout_s=5)
    backend = locks.backend
    assert isinstance(backend, RedisClusterBackend)
    slot = slot_of(key)
    source = redis_cluster.primary_of_slot(slot)
    target = next(n for n in redis_cluster.primaries() if n is not source)
    routed = backend.client.nodes_manager.get_node_from_slot
    try:
        lease = locks.acquire(key)
        redis_cluster.begin_migration(slot, target)
        assert redis_cluster.move_keys(slot, source, target) >= 2  # the lock and its counter
        # ASK: the source no longer has the keys; the client still routes the slot to it.
        assert _refuses(source, lock_key(key), redis.exceptions.AskError)
        assert as_single_server(source, key) == {"AskError"}  # nothing follows it there
        assert routed(slot).port == source.port
        assert backend.renew([(key, lease.owner, 3_000)]) == [True]  # asked the target
        # TRYAGAIN: a script whose keys are only partly there cannot run anywhere yet.
        with pytest.raises(BackendUnavailable):
            backend.try_acquire(key, "contender:3000", 3_000)
        redis_cluster.end_migration(slot, target)
        # MOVED: the source now redirects for good; the client follows and learns it.
        assert _refuses(source, lock_key(key), redis.exceptions.MovedError)
        assert as_single_server(source, key) == {"MovedError"}
        assert routed(slot).port == source.port
        assert not lease.lost
        lease.release()
        assert routed(slot).port == target.port
        with locks.acquire(key, timeout_s=2) as again:
            assert again.token > lease.token
            assert holder_on(target, key) == again.owner
    finally:
        locks.close()
