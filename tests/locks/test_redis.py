"""Redis-only guarantees: Cluster hash tags, bounded memory, EVALSHA, and data loss.

Scenarios that flush, kill, freeze or restart the server run on a private
``redis-server`` (``private_redis``); the shared one on 6379 is never touched
beyond this test's own keys.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import redis
from redis.crc import key_slot
from servers import RedisServer

from toolguard.errors import LockLost, NotOwned
from toolguard.locks import LockManager, connect, connect_async, open_backend
from toolguard.locks.redis import redis_keys

SLACK_S = 1.0


def slots(names: list[str] | list[bytes]) -> set[int]:
    return {key_slot(name.encode() if isinstance(name, str) else name) for name in names}


@pytest.mark.parametrize("key", ["lead:1", "a{b}c", "}{", "{x}", "100%", "a%7Bb", "ünï"])
def test_all_keys_of_one_lock_share_one_hash_tag(key: str) -> None:
    names, signal_prefix = redis_keys(key)
    everything = [*names, signal_prefix + "owner:1000"]
    tags = {name[name.index("{") + 1:name.index("}")] for name in everything}
    assert len(tags) == 1
    assert len(slots(everything)) == 1


def test_escaping_keeps_distinct_keys_apart() -> None:
    keys = ["a{b", "a%7Bb", "a}b", "a%7Db", "a%b", "a%25b"]
    assert len({redis_keys(key)[0][0] for key in keys}) == len(keys)


def elsewhere(url: str) -> LockManager:
    """A manager that waits at the server as another process would: its backend is handed
    in directly, so it shares no claims with ``connect``'s managers in this process."""
    return LockManager(open_backend(url))


def test_live_keys_of_a_lock_share_one_slot(redis_url: str, unique: str) -> None:
    """Every key the scripts create for a lock (queue, presence, wake-up list) is in one slot."""
    key = f"t{unique}:{{tagged}}"
    client = redis.Redis.from_url(redis_url)
    with connect(redis_url) as holder, elsewhere(redis_url) as waiter:
        lease = holder.acquire(key, ttl_ms=5_000)
        waiting = threading.Thread(target=lambda: waiter.acquire(key, timeout_s=5).release())
        waiting.start()
        time.sleep(0.3)
        seen = [name for name in client.scan_iter(match=f"*{unique}*")]
        lease.release()  # hands off: writes the waiter's wake-up list
        waiting.join(10)
    assert {b":lock", b":fence", b":q", b":qx"} <= {name[name.rindex(b":"):] for name in seen}
    assert len(slots(seen)) == 1


def test_counters_and_queues_expire(redis_url: str, unique: str) -> None:
    key = f"t{unique}:expiring"
    lock, fence, queue, presence = redis_keys(key)[0]
    client = redis.Redis.from_url(redis_url)
    with connect(redis_url) as holder, elsewhere(redis_url) as waiter:
        with holder.acquire(key, ttl_ms=5_000):
            assert client.pttl(fence) > 0
            assert 0 < client.pttl(lock) <= 5_000
            thread = threading.Thread(target=lambda: waiter.acquire(key, timeout_s=5).release())
            thread.start()
            time.sleep(0.3)
            assert client.pttl(queue) > 0
            assert client.pttl(presence) > 0
        thread.join(10)
    assert client.pttl(fence) > 0


def test_token_after_the_counter_vanished_is_still_greater(redis_url: str, unique: str) -> None:
    key = f"t{unique}:vanished"
    client = redis.Redis.from_url(redis_url)
    with connect(redis_url) as locks:
        with locks.acquire(key) as lease:
            before = lease.token
        client.delete(redis_keys(key)[0][1])  # the fence counter expired or was evicted
        with locks.acquire(key) as lease:
            assert lease.token > before


def test_raise_floor_keeps_an_expiry_on_the_counter(redis_url: str, unique: str) -> None:
    key = f"t{unique}:floored"
    client = redis.Redis.from_url(redis_url)
    with connect(redis_url) as locks:
        floor = time.time_ns() // 1000 + 10**12
        locks.raise_floor(key, floor)
        assert client.pttl(redis_keys(key)[0][1]) > 0
        with locks.acquire(key) as lease:
            assert lease.token > floor


def _commandstats(client: redis.Redis) -> dict[str, int]:
    return {name: int(stats["calls"]) for name, stats in client.info("commandstats").items()}


@pytest.mark.fault
def test_scripts_run_by_sha_and_survive_script_flush(private_redis: RedisServer) -> None:
    client = redis.Redis.from_url(private_redis.url)
    ttl_ms = 300
    with connect(private_redis.url) as locks:
        with locks.acquire("k", ttl_ms=ttl_ms) as lease:
            client.script_flush()
            time.sleep(ttl_ms / 1000)  # renewals must reload their script, not fail
            lease.check()
            before = lease.token
        client.script_flush()
        with locks.acquire("k") as lease:
            assert lease.token > before

    async def async_side() -> None:
        client.script_flush()
        manager = connect_async(private_redis.url)
        try:
            async with manager.acquire("k") as lease:
                assert lease.token > before
        finally:
            await manager.aclose()

    asyncio.run(async_side())
    stats = _commandstats(client)
    assert stats.get("cmdstat_evalsha", 0) > 0
    assert stats.get("cmdstat_eval", 0) == 0, "a script was sent as text with EVAL"


@pytest.mark.fault
def test_restart_with_empty_data_keeps_tokens_increasing(private_redis: RedisServer) -> None:
    with connect(private_redis.url) as locks:
        tokens = []
        for _ in range(3):
            with locks.acquire("k") as lease:
                tokens.append(lease.token)
        private_redis.restart()
        assert redis.Redis.from_url(private_redis.url).dbsize() == 0
        with locks.acquire("k", timeout_s=5) as lease:
            assert lease.token > max(tokens)


@pytest.mark.fault
def test_holder_learns_its_lock_vanished_in_a_restart(private_redis: RedisServer) -> None:
    ttl_ms = 600
    with connect(private_redis.url) as locks:
        lease = locks.acquire("k", ttl_ms=ttl_ms)
        private_redis.restart()
        assert lease.lost_event.wait(ttl_ms / 1000 + SLACK_S)
        with pytest.raises(NotOwned):
            lease.check()
        lease.release()


@pytest.mark.fault
def test_holder_learns_of_loss_when_the_server_is_gone(private_redis: RedisServer) -> None:
    """Renewal errors are retried only until the local deadline, then the lease is lost."""
    ttl_ms = 600
    with connect(private_redis.url) as locks:
        lease = locks.acquire("k", ttl_ms=ttl_ms)
        private_redis.kill()
        assert lease.lost_event.wait(ttl_ms / 1000 + SLACK_S)
        with pytest.raises(LockLost):
            lease.check()
        lease.release()  # never raises, never hangs, even with the server gone


@pytest.mark.fault
@pytest.mark.timeout(60)
def test_holder_learns_of_loss_when_the_server_hangs(private_redis: RedisServer) -> None:
    """A server that accepts but never answers must not freeze the heartbeat past the TTL."""
    ttl_ms = 600
    assert private_redis.process is not None
    with connect(private_redis.url) as locks:
        lease = locks.acquire("k", ttl_ms=ttl_ms)
        os.kill(private_redis.process.pid, signal.SIGSTOP)
        try:
            assert lease.lost_event.wait(ttl_ms / 1000 + SLACK_S), "heartbeat stuck on a hung server"
            with pytest.raises(LockLost):
                lease.check()
        finally:
            os.kill(private_redis.process.pid, signal.SIGCONT)
        lease.release()


def test_handed_off_holder_gets_a_token_even_if_the_counter_vanished(redis_url: str,
                                                                      unique: str) -> None:
    """A waiter that missed its wake-up asks again as holder; an evicted counter must not crash it."""
    from toolguard.locks.redis import RedisBackend

    key = f"t{unique}:handed"
    backend = RedisBackend(redis_url)
    try:
        first = backend.try_acquire(key, "first:1000", 1_000)
        assert first.token is not None
        assert backend.try_acquire(key, "second:1000", 1_000).token is None  # queued
        assert backend.release(key, "first:1000")  # hands off to "second"
        backend.client.delete(redis_keys(key)[0][1])
        again = backend.try_acquire(key, "second:1000", 1_000)
        assert again.token is not None and again.token > first.token
    finally:
        backend.release(key, "second:1000")
        backend.close()


def test_a_hand_off_lasts_the_waiters_hand_off_ttl_and_queueing_clears_stale_ones(
        redis_url: str, unique: str) -> None:
    from toolguard.locks.base import new_owner
    from toolguard.locks.redis import RedisBackend

    key = f"t{unique}:handoff"
    lock, fence, _, _ = redis_keys(key)[0]
    wake_prefix = redis_keys(key)[1]
    backend = RedisBackend(redis_url)
    client = redis.Redis.from_url(redis_url)
    first, late = new_owner(30_000), new_owner(30_000, 700)
    try:
        assert backend.try_acquire(key, first, 30_000).granted
        assert not backend.try_acquire(key, late, 30_000).granted
        assert backend.release(key, first)  # handed to the waiter, for its 700 ms
        assert client.get(lock) == late.encode()
        assert 0 < client.pttl(lock) <= 700
        handed = int(client.lindex(wake_prefix + late, 0))
        time.sleep(0.8)  # the hand-off runs out unclaimed; someone else takes the key
        other = new_owner(30_000)
        assert backend.try_acquire(key, other, 30_000).granted
        # The waiter asks again: it is queued, and the expired hand-off is gone for good.
        assert not backend.try_acquire(key, late, 30_000).granted
        assert client.llen(wake_prefix + late) == 0
        assert backend.wait(key, late, 0.2) is None
        assert int(client.get(fence)) > handed
        backend.release(key, other)
    finally:
        backend.release(key, late)
        backend.close()


def test_asking_again_while_holding_grants_again_from_now(redis_url: str, unique: str) -> None:
    from toolguard.locks.base import new_owner
    from toolguard.locks.redis import RedisBackend

    key = f"t{unique}:again"
    backend = RedisBackend(redis_url)
    client = redis.Redis.from_url(redis_url)
    owner = new_owner(1_000)
    try:
        first = backend.try_acquire(key, owner, 1_000).token
        time.sleep(0.5)
        again = backend.try_acquire(key, owner, 1_000).token  # e.g. a retry after a lost reply
        assert first is not None and again is not None and again > first
        assert client.pttl(redis_keys(key)[0][0]) > 900  # its TTL runs from the second call
    finally:
        backend.release(key, owner)
        backend.close()
