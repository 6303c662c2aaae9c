"""The Redis backend's hot path: connections borrowed from the client's pool, used cleanly."""

from __future__ import annotations

import redis

from toolguard.locks.base import new_owner
from toolguard.locks.redis import RedisBackend, _direct_pool


def test_only_a_plain_unbounded_pool_is_borrowed_from(redis_url: str) -> None:
    plain = redis.Redis.from_url(redis_url)
    bounded = redis.Redis.from_url(redis_url, max_connections=4)
    single = redis.Redis.from_url(redis_url, single_connection_client=True)
    blocking = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(redis_url))
    try:
        assert _direct_pool(plain) is plain.connection_pool
        assert _direct_pool(bounded) is None  # idle connections kept here could starve it
        assert _direct_pool(single) is None
        assert _direct_pool(blocking) is None
    finally:
        for client in (plain, bounded, single, blocking):
            client.close()


def test_a_bounded_pool_takes_the_usual_path_and_still_locks(redis_url: str, unique: str) -> None:
    backend = RedisBackend(redis.Redis.from_url(redis_url, max_connections=2))
    owner = new_owner(5_000)
    try:
        assert backend.try_acquire(f"t{unique}:b", owner, 5_000).granted
        assert backend.release(f"t{unique}:b", owner)
        assert backend._idle == []
    finally:
        backend.close()


def test_borrowed_connections_are_reused_and_returned_on_close(redis_url: str,
                                                               unique: str) -> None:
    backend = RedisBackend(redis_url)
    pool = backend.client.connection_pool
    key, owner = f"t{unique}:d", new_owner(5_000)
    try:
        for _ in range(20):
            assert backend.try_acquire(key, owner, 5_000).granted
            assert backend.release(key, owner)
        assert len(backend._idle) == 1  # one thread, one connection, used again and again
        assert len(pool._in_use_connections) == 1
    finally:
        backend.close()
    assert backend._idle == []
    assert not pool._in_use_connections


def test_a_connection_that_failed_is_reconnected_not_reused_dirty(redis_url: str,
                                                                  unique: str) -> None:
    backend = RedisBackend(redis_url)
    key, owner = f"t{unique}:f", new_owner(5_000)
    try:
        assert backend.try_acquire(key, owner, 5_000).granted
        conn = backend._idle[-1]
        conn.send_command("PING")  # a reply nobody read: what an interrupted call leaves
        conn.disconnect()  # ... which the hot path does to a connection that raised
        assert backend.release(key, owner)  # reconnects, reads its own reply
        assert backend.try_acquire(key, owner, 5_000).granted
        assert backend.release(key, owner)
    finally:
        backend.close()
