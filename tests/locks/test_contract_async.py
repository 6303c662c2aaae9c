"""The lock contract, asyncio side: the same backends through ``connect_async``.

Each test drives its own event loop with ``asyncio.run`` and builds its async
manager inside it (connection pools belong to the loop that made them).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest

import toolguard.locks.manager as manager_module
from locks.backends import QUIET_POLL_S, LockEnv
from toolguard.errors import LockLost, LockTimeout, NotOwned
from toolguard.locks import AsyncLockManager, Lease

SLACK_S = 1.0


async def assert_free(manager: AsyncLockManager, key: str) -> None:
    async with manager.acquire(key, timeout_s=0):
        pass


@pytest.mark.timeout(60)
def test_tasks_lose_no_update_and_tokens_follow_grant_order(backend: LockEnv) -> None:
    key = backend.key("acounter")
    tasks, rounds = 8, 15
    state = {"value": 0, "inside": 0, "max_inside": 0}
    grants: list[int] = []

    async def work(manager: AsyncLockManager) -> None:
        for _ in range(rounds):
            async with manager.acquire(key, ttl_ms=5_000, timeout_s=30) as lease:
                state["inside"] += 1
                state["max_inside"] = max(state["max_inside"], state["inside"])
                grants.append(lease.token)
                value = state["value"]
                await asyncio.sleep(random.uniform(0, 0.001))
                state["value"] = value + 1
                state["inside"] -= 1

    async def main() -> None:
        managers = [backend.async_manager(), backend.async_manager()]
        try:
            await asyncio.gather(*(work(managers[i % 2]) for i in range(tasks)))
        finally:
            for manager in managers:
                await manager.aclose()

    asyncio.run(main())
    assert state["max_inside"] == 1
    assert state["value"] == tasks * rounds
    assert all(a < b for a, b in itertools.pairwise(grants))


def test_await_form_timeout_and_idempotent_release(backend: LockEnv) -> None:
    key = backend.key("aawait")

    async def main() -> None:
        holder, waiter = backend.async_manager(), backend.async_manager()
        try:
            lease = await holder.acquire(key, ttl_ms=5_000)
            with pytest.raises(LockTimeout) as caught:
                await waiter.acquire(key, timeout_s=0.2)
            assert caught.value.keys == (key,)
            assert key in str(caught.value)
            await lease.arelease()
            await lease.arelease()
            with pytest.raises(TypeError):  # an async lease is not released from sync code
                lease.release()
            await assert_free(waiter, key)
        finally:
            await holder.aclose()
            await waiter.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("tamper", ["drop", "steal"])
def test_lost_lease_cancels_the_task_inside_async_with(backend: LockEnv, tamper: str) -> None:
    key = backend.key("alost")
    # The heartbeat renews every ttl/3 and hears "not yours" (NotOwned) at its first renewal
    # after the tamper; only if no renewal at all runs within a whole TTL does the lease's own
    # deadline end it first (LockLost). With 600 ms that happened once under a full CI run (a
    # worker starting a Redis cluster starved this one's heartbeat): the TTL must be longer than
    # a 2-core machine's scheduling stalls for the test to see which answer the server gave.
    ttl_ms = 2_000

    async def main() -> tuple[float, Lease | None]:
        manager = backend.async_manager()
        held: Lease | None = None
        started = time.monotonic()
        try:
            with pytest.raises(LockLost) as caught:
                async with manager.acquire(key, ttl_ms=ttl_ms) as lease:
                    held = lease
                    await asyncio.to_thread(getattr(backend, tamper), key)  # sync: off the loop
                    await asyncio.sleep(30)  # only the loss can end this early
            assert isinstance(caught.value, NotOwned)
            await asyncio.sleep(0)  # the task is usable again: the cancellation was consumed
            return time.monotonic() - started, held
        finally:
            await manager.aclose()

    elapsed, lease = asyncio.run(main())
    assert lease is not None and lease.lost
    assert elapsed < ttl_ms / 1000 / 3 + SLACK_S + 5, "cancelled by the loss, not by the sleep"


def test_outside_cancellation_is_not_reported_as_loss(backend: LockEnv) -> None:
    key = backend.key("acancel")

    async def main() -> None:
        manager = backend.async_manager()
        try:
            entered = asyncio.Event()

            async def body() -> None:
                async with manager.acquire(key, ttl_ms=2_000):
                    entered.set()
                    await asyncio.sleep(30)

            task = asyncio.create_task(body())
            await entered.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await assert_free(manager, key)
        finally:
            await manager.aclose()

    asyncio.run(main())


def test_cancelled_waiter_leaves_the_queue(backend: LockEnv) -> None:
    key = backend.key("aqueue")

    async def main() -> None:
        holder, waiter, observer = (backend.async_manager() for _ in range(3))
        try:
            lease = await holder.acquire(key, ttl_ms=5_000)
            task = asyncio.create_task(waiter.acquire(key, timeout_s=20).__aenter__())
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await lease.arelease()
            await assert_free(observer, key)  # not handed to the cancelled waiter
        finally:
            for manager in (holder, waiter, observer):
                await manager.aclose()

    asyncio.run(main())


def test_multi_key_all_or_nothing_async(backend: LockEnv) -> None:
    a, b = backend.key("aa"), backend.key("ab")

    async def main() -> None:
        holder, taker, observer = (backend.async_manager() for _ in range(3))
        try:
            blocker = await holder.acquire(b, ttl_ms=5_000)
            with pytest.raises(LockTimeout) as caught:
                await taker.acquire([b, a], timeout_s=0.4)
            assert caught.value.keys == (b,)
            await assert_free(observer, a)
            await blocker.arelease()
            await assert_free(observer, b)
        finally:
            for manager in (holder, taker, observer):
                await manager.aclose()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_async_long_holder_keeps_the_lock(backend: LockEnv) -> None:
    key = backend.key("along")
    # 2 s: at 1 s one renewal on Redis Cluster missed its window once in a full CI run (2 cores,
    # three xdist workers); renewal runs at ttl/3, so a stall of over ~0.6 s lost the lease
    ttl_ms = 2_000

    async def main() -> int:
        holder, rival = backend.async_manager(), backend.async_manager()
        stolen = 0
        try:
            async with holder.acquire(key, ttl_ms=ttl_ms) as lease:
                until = time.monotonic() + 3 * ttl_ms / 1000
                while time.monotonic() < until:
                    try:
                        other = await rival.acquire(key, timeout_s=0.05)
                    except LockTimeout:
                        continue
                    stolen += 1
                    await other.arelease()
                assert not lease.lost
            return stolen
        finally:
            await holder.aclose()
            await rival.aclose()

    assert asyncio.run(main()) == 0


@pytest.mark.timeout(60)
def test_async_waiter_is_woken_by_the_release(backend: LockEnv, monkeypatch) -> None:
    """With every fallback poll at least QUIET_POLL_S apart, only a wake-up can hand over
    within 10 s."""
    monkeypatch.setattr(manager_module, "MAX_POLL_S", 30.0)
    key = backend.key("awake")
    assert QUIET_POLL_S > 10

    async def main() -> None:
        holder, waiter = backend.quiet_async_manager(), backend.quiet_async_manager()
        try:
            lease = await holder.acquire(key)
            task = asyncio.create_task(_acquire(waiter, key))
            await asyncio.sleep(0.3)
            released_at = time.monotonic()
            await lease.arelease()
            got = await asyncio.wait_for(task, 25)
            assert time.monotonic() - released_at < 10
            assert got.token > lease.token
            await got.arelease()
        finally:
            await holder.aclose()
            await waiter.aclose()

    asyncio.run(main())


async def _acquire(manager: AsyncLockManager, key: str) -> Lease:
    return await manager.acquire(key, timeout_s=25)


@pytest.mark.timeout(60)
def test_many_async_waiters_are_all_woken_by_releases(backend: LockEnv, monkeypatch) -> None:
    """More waiters than the default executor has threads: waiting must not block releasing.

    Polls are at least QUIET_POLL_S apart: sixteen hand-offs in 20 s need wake-ups."""
    monkeypatch.setattr(manager_module, "MAX_POLL_S", 30.0)
    key = backend.key("amany")
    waiters = 16
    order: list[int] = []

    async def one(index: int, manager: AsyncLockManager) -> None:
        async with manager.acquire(key, timeout_s=20):
            order.append(index)
            await asyncio.sleep(0.001)

    async def main() -> None:
        manager = backend.quiet_async_manager()
        try:
            first = await manager.acquire(key)
            tasks = [asyncio.create_task(one(i, manager)) for i in range(waiters)]
            await asyncio.sleep(0.3)
            await first.arelease()
            await asyncio.gather(*tasks)
        finally:
            await manager.aclose()

    asyncio.run(main())
    assert sorted(order) == list(range(waiters))


def test_async_backend_declares_the_presence_window_of_its_sync_twin(backend: LockEnv) -> None:
    """Hand-off TTLs and etcd's presence rule come from it: a missing one would fall back
    to the full TTL, and a dead async waiter would hold up the line that long."""
    from toolguard.locks import AsyncLockBackend, LockBackend

    async def main() -> None:
        manager = backend.async_manager()
        try:
            assert isinstance(manager.backend, AsyncLockBackend)
            assert isinstance(manager.renewer, LockBackend)
            assert manager.backend.presence_ms == manager.renewer.presence_ms == 2_000
        finally:
            await manager.aclose()

    asyncio.run(main())
