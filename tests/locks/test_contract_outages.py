"""The lock contract through brief lock-server outages, on a private server per backend.

Transient connection errors while acquiring are retried within the caller's own
deadline: a server restarted (Redis: in a few milliseconds, empty), or away for
a second, costs waiters time, not an error. A server that stays away ends the
acquisition in ``BackendUnavailable`` (not ``LockTimeout``: nobody holds the key,
the server is gone) once the deadline has passed, and release never hangs.

SQLite has no server: its "outage" is the database file locked by another
connection for longer than the backend's busy timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from locks.backends import Outage
from toolguard.errors import BackendUnavailable
from toolguard.locks import Lease, connect, connect_async

pytestmark = pytest.mark.fault

WAITERS = 4


def _waiter_results(results: list[int | BaseException]) -> tuple[list[int], list[BaseException]]:
    tokens = [r for r in results if isinstance(r, int)]
    errors = [r for r in results if isinstance(r, BaseException)]
    return tokens, errors


@pytest.mark.timeout(120)
def test_waiting_threads_ride_out_a_server_restart(outage: Outage, unique: str) -> None:
    key = f"{unique}:restart"
    holder, waiters = connect(outage.url, **outage.options), connect(outage.url, **outage.options)
    results: list[int | BaseException] = []
    order: list[int] = []
    try:
        first = holder.acquire(key, ttl_ms=10_000)

        def wait_turn() -> None:
            try:
                with waiters.acquire(key, ttl_ms=5_000, timeout_s=60) as lease:
                    order.append(lease.token)  # append order = grant order
                    time.sleep(0.01)
                results.append(lease.token)
            except BaseException as error:  # reported below
                results.append(error)

        threads = [threading.Thread(target=wait_turn, daemon=True) for _ in range(WAITERS)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # every waiter is in line, most of them blocked in a wait
        outage.blip()
        first.release()  # never raises; the lock may be gone with the server's data
        for thread in threads:
            thread.join(60)
        tokens, errors = _waiter_results(results)
        assert not errors, f"waiters failed instead of riding out the restart: {errors}"
        assert len(tokens) == WAITERS
        assert all(a < b for a, b in itertools.pairwise(order)), order
        assert min(order) > first.token
    finally:
        holder.close()
        waiters.close()


@pytest.mark.timeout(120)
def test_waiting_tasks_ride_out_a_server_restart(outage: Outage, unique: str) -> None:
    key = f"{unique}:arestart"

    async def main() -> tuple[int, list[int | BaseException], list[int]]:
        holder = connect_async(outage.url, **outage.options)
        waiters = connect_async(outage.url, **outage.options)
        results: list[int | BaseException] = []
        order: list[int] = []

        async def wait_turn() -> None:
            try:
                async with waiters.acquire(key, ttl_ms=5_000, timeout_s=60) as lease:
                    order.append(lease.token)
                    await asyncio.sleep(0.01)
                results.append(lease.token)
            except Exception as error:  # reported below
                results.append(error)

        try:
            first = await holder.acquire(key, ttl_ms=10_000)
            tasks = [asyncio.create_task(wait_turn()) for _ in range(WAITERS)]
            await asyncio.sleep(0.5)
            await asyncio.to_thread(outage.blip)
            await first.arelease()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return first.token, results, order
        finally:
            await holder.aclose()
            await waiters.aclose()

    first, results, order = asyncio.run(main())
    tokens, errors = _waiter_results(results)
    assert not errors, f"waiting tasks failed instead of riding out the restart: {errors}"
    assert len(tokens) == WAITERS
    assert all(a < b for a, b in itertools.pairwise(order)), order
    assert min(order) > first


@pytest.mark.timeout(120)
def test_an_acquire_begun_while_the_server_is_away_gets_the_lock_when_it_is_back(
        outage: Outage, unique: str) -> None:
    key = f"{unique}:away"
    locks = connect(outage.url, **outage.options)
    try:
        with locks.acquire(key, ttl_ms=2_000) as lease:  # connections are open and warm
            before = lease.token
        got: list[Lease | BaseException] = []

        def take() -> None:
            try:
                got.append(locks.acquire(key, ttl_ms=2_000, timeout_s=60))
            except BaseException as error:  # reported below
                got.append(error)

        outage.down()
        thread = threading.Thread(target=take, daemon=True)
        try:
            thread.start()
            time.sleep(1.0)  # its first tries fail: the server is not there
        finally:
            outage.up()
        thread.join(60)
        assert got and isinstance(got[0], Lease), f"acquire did not ride out the outage: {got}"
        assert got[0].token > before
        got[0].release()
    finally:
        locks.close()


#: How far past its deadline a give-up may end: one call already in flight, and the
#: best-effort release of what it held. Each is bounded by a call timeout; on a server
#: that refuses connections both fail at once (a pool waiting 5 s per call would not).
GIVE_UP_SLACK_S = 3.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_server_that_stays_away_ends_in_backend_unavailable(outage: Outage, unique: str,
                                                              mode: str) -> None:
    key = f"{unique}:gone"
    if mode == "sync":
        locks = connect(outage.url, **outage.options)
        try:
            lease = locks.acquire(f"{key}:held", ttl_ms=2_000)
            outage.down()
            lease.release()  # returns (bounded by the call timeouts), never raises
            started = time.monotonic()
            with pytest.raises(BackendUnavailable):
                locks.acquire(key, timeout_s=1.0)
            assert time.monotonic() - started < 1.0 + GIVE_UP_SLACK_S, "the deadline was not kept"
        finally:
            outage.up()
            locks.close()
        return

    async def main() -> float:
        locks = connect_async(outage.url, **outage.options)
        try:
            lease = await locks.acquire(f"{key}:held", ttl_ms=2_000)
            await asyncio.to_thread(outage.down)
            await lease.arelease()
            started = time.monotonic()
            with pytest.raises(BackendUnavailable):
                await locks.acquire(key, timeout_s=1.0)
            return time.monotonic() - started
        finally:
            await asyncio.to_thread(outage.up)
            await locks.aclose()

    assert asyncio.run(main()) < 1.0 + GIVE_UP_SLACK_S, "the deadline was not kept"
