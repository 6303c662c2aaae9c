"""A lock manager never grants a key it holds, whatever the server answers (every backend).

After a Redis restarted empty under load, one process's lock manager granted a
key to a second of its own threads while its first lease on that key was still
live: the server had forgotten the lock, and the manager asked only the server.
A process knows its own live leases. Now a key with a live lease in this process is
not granted to another holder in this process, whether it asks through the same
manager or another one made for the same lock server and namespace (sync or
asyncio, as a guard and a tool each connecting do): the second acquisition waits for
the local release (as another process waits in the server's queue), until its
own deadline (``LockTimeout``), and gets the key once the first lets go.

The server's forgetting is modelled by deleting the lock record behind the
holder's back (``LockEnv.drop``), and, for Redis, by restarting a private
``redis-server`` empty. The first lease is taken off the heartbeat so that no
renewal notices the loss meanwhile: it is live until its local deadline.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest
from servers import RedisServer

from locks.backends import LockEnv
from toolguard.errors import LockTimeout
from toolguard.locks import AsyncLockManager, Lease, connect, connect_async, heartbeat

TTL_MS = 30_000  # the first lease stays live through the whole test
WAIT_S = 0.5  # the second acquisition's own deadline


def test_a_key_held_is_not_granted_again_after_the_server_forgot_it(backend: LockEnv) -> None:
    manager = backend.manager(ttl_ms=TTL_MS)
    key = backend.key("held")
    first = manager.acquire(key)
    heartbeat().remove(first)  # no renewal learns of the loss: the lease is live
    backend.drop(key)  # the server forgot the lock (restarted empty, record deleted)
    got: list[Lease | BaseException] = []

    def second() -> None:
        try:
            got.append(manager.acquire(key, timeout_s=WAIT_S))
        except BaseException as error:
            got.append(error)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(60)
    assert len(got) == 1 and isinstance(got[0], LockTimeout), got
    assert not first.lost
    first.release()
    with manager.acquire(key, timeout_s=10) as again:  # released: the next holder gets it
        assert again.token > 0


def test_a_second_acquisition_waits_for_the_local_release(backend: LockEnv) -> None:
    manager = backend.manager(ttl_ms=TTL_MS)
    key = backend.key("handover")
    first = manager.acquire(key)
    heartbeat().remove(first)
    backend.drop(key)
    waiting = threading.Event()
    got: list[Lease] = []

    def second() -> None:
        waiting.set()
        got.append(manager.acquire(key, timeout_s=30))

    thread = threading.Thread(target=second)
    thread.start()
    waiting.wait(10)
    assert not got  # nothing granted while the first lease is live
    first.release()
    thread.join(60)
    assert len(got) == 1
    got[0].release()


async def refused_then_handed_on(manager: AsyncLockManager, key: str,
                                 let_go: Callable[[], Awaitable[None]]) -> None:
    """While another holder of this process has ``key``: ``manager`` times out on it, then a
    waiting acquisition gets it once ``let_go()`` releases it."""
    with pytest.raises(LockTimeout):
        await manager.acquire(key, timeout_s=WAIT_S)

    async def acquire() -> Lease:
        lease: Lease = await manager.acquire(key, timeout_s=30)
        return lease

    waiting = asyncio.create_task(acquire())
    await asyncio.sleep(0.05)
    assert not waiting.done()  # nothing granted while the first lease is live
    await let_go()
    lease = await asyncio.wait_for(waiting, 60)
    await lease.arelease()


def test_the_asyncio_manager_never_grants_a_key_it_holds(backend: LockEnv) -> None:
    key = backend.key("aheld")

    async def main() -> None:
        manager = backend.async_manager(ttl_ms=TTL_MS)
        try:
            first = await manager.acquire(key)
            heartbeat().remove(first)
            await asyncio.to_thread(backend.drop, key)
            await refused_then_handed_on(manager, key, first.arelease)
        finally:
            await manager.aclose()

    asyncio.run(main())


def test_another_manager_of_the_process_does_not_get_a_key_held(backend: LockEnv) -> None:
    """Per process, not per manager: a second ``connect`` and a ``connect_async`` for the
    same URL wait for the first's live lease, and get the key once it is released."""
    holder = backend.manager(ttl_ms=TTL_MS)
    other = backend.manager(ttl_ms=TTL_MS)
    key = backend.key("process")
    try:
        first = holder.acquire(key)
        heartbeat().remove(first)
        backend.drop(key)
        with pytest.raises(LockTimeout):
            other.acquire(key, timeout_s=WAIT_S)

        async def from_asyncio() -> None:
            manager = backend.async_manager(ttl_ms=TTL_MS)
            try:
                # the sync holder lets go (off the loop): the claim is handed on
                await refused_then_handed_on(manager, key,
                                             lambda: asyncio.to_thread(first.release))
            finally:
                await manager.aclose()

        asyncio.run(from_asyncio())
        with other.acquire(key, timeout_s=10) as again:
            assert again.token > 0
    finally:
        holder.close()
        other.close()


def test_managers_on_different_spaces_do_not_share_claims(backend: LockEnv) -> None:
    """Two backend objects handed in directly are two spaces (as two processes would be):
    once the server forgot the first's lock, the second is granted it by the server."""
    from toolguard.locks import LockManager, open_backend

    key = backend.key("spaces")
    one = LockManager(open_backend(backend.url, **backend.factory.options), ttl_ms=TTL_MS)
    two = LockManager(open_backend(backend.url, **backend.factory.options), ttl_ms=TTL_MS)
    try:
        first = one.acquire(key, timeout_s=5)
        heartbeat().remove(first)
        backend.drop(key)
        with two.acquire(key, timeout_s=10) as taken:
            assert taken.token > 0
        first.release()
    finally:
        one.close()
        two.close()


@pytest.mark.fault
@pytest.mark.parametrize("face", ["sync", "asyncio"])
def test_redis_restarted_empty_does_not_grant_a_held_key_twice(
        private_redis: RedisServer, face: str) -> None:
    key = "restarted:held"
    if face == "sync":
        manager = connect(private_redis.url, ttl_ms=TTL_MS)
        try:
            first = manager.acquire(key)
            heartbeat().remove(first)
            private_redis.restart()  # empty: the lock and its counter are gone
            with pytest.raises(LockTimeout):
                manager.acquire(key, timeout_s=WAIT_S)
            first.release()
            with manager.acquire(key, timeout_s=10) as again:
                assert again.token > 0
        finally:
            manager.close()
        return

    async def main() -> None:
        manager = connect_async(private_redis.url, ttl_ms=TTL_MS)
        try:
            first = await manager.acquire(key)
            heartbeat().remove(first)
            await asyncio.to_thread(private_redis.restart)
            with pytest.raises(LockTimeout):
                await manager.acquire(key, timeout_s=WAIT_S)
            await first.arelease()
            again = await manager.acquire(key, timeout_s=10)
            await again.arelease()
        finally:
            await manager.aclose()

    asyncio.run(main())
