"""Cancellation at every await point of a hold: its read, a holder's wait, its release.

``Counted`` (the cancellation suite's) counts a coroutine's suspensions; each
one is then the point a fresh run is cancelled at. After each: no hold of the
cancelled call is left (in the guard, in the store's wait-for graph, on the
lock server: another caller takes the key at once).
"""

from __future__ import annotations

import asyncio
from typing import Any

from guard.cancel_harness import Counted
from guard.harness import Harness
from guard.reads_world import Agent, Bank
from guard.test_holds import HELD


def _rows(h: Harness, caller: str | None) -> list[tuple[Any, ...]]:
    return (h.sql("SELECT key FROM toolguard_hold WHERE caller = %s", (caller,)) +
            h.sql("SELECT key FROM toolguard_hold_wait WHERE caller = %s", (caller,)))


async def _free(h: Harness, key: str) -> None:
    """Another caller takes ``key`` at once (nothing of the cancelled call holds it)."""
    assert h.guard.async_locks is not None
    lease = await h.guard.async_locks.acquire(key, timeout_s=2)
    await lease.arelease()


def test_a_hold_read_cancelled_at_every_await_point_keeps_no_hold(harness: Any) -> None:
    h: Harness = harness(HELD)
    Bank(h).open({"acct": 100})
    bank = Bank(h)

    async def main() -> int:
        async with h.async_edges():
            total = None
            point = 0
            while total is None or point < total:
                point += 1 if total is not None else 0
                agent = Agent(h, "reader", f"t-{point}")
                caller = h.guard.caller("reader", f"t-{point}")
                intent = agent.intent("get_balance", account_id="acct")
                counted = Counted(h.guard.arun(intent, bank.abody("get_balance")),
                                  cancel_at=point or None)

                async def run(c: Counted = counted) -> Any:
                    return await c

                task = asyncio.create_task(run())
                try:
                    decision = await task
                    assert decision.ok
                    assert await h.guard.arelease_holds(caller) == 1
                except asyncio.CancelledError:
                    pass
                if total is None:
                    total = counted.points
                assert h.guard.holds.holding(caller) == [], point
                assert await asyncio.to_thread(_rows, h, caller) == [], point
                await _free(h, "account:acct")
            return total

    assert asyncio.run(main()) > 3


def test_a_wait_and_a_release_cancelled_at_every_await_point(harness: Any) -> None:
    h: Harness = harness(HELD)
    Bank(h).open({"a": 1, "b": 2})
    bank = Bank(h)

    async def main() -> int:
        async with h.async_edges():
            owner = Agent(h, "owner", "t-o")
            assert (await owner.acall("get_balance", account_id="b")).ok  # b is held
            releases = 0
            # a holder (of a) waits for b, which stays held: every suspension of the wait
            # (the graph written, searched, each slice of the lock wait) is a point to cancel at
            for point in range(1, 16):
                waiter = Agent(h, "waiter", f"t-{point}")
                caller = h.guard.caller("waiter", f"t-{point}")
                assert (await waiter.acall("get_balance", account_id="a")).ok
                counted = Counted(h.guard.arun(waiter.intent("get_balance", account_id="b"),
                                               bank.abody("get_balance")), cancel_at=point)

                async def run(c: Counted = counted) -> Any:
                    return await c

                try:
                    await asyncio.wait_for(asyncio.create_task(run()), 30)
                    raise AssertionError("the wait for b ended although b is held")
                except asyncio.CancelledError:
                    pass
                assert [x.keys for x in h.guard.holds.holding(caller)] == [
                    frozenset({"account:a"})]  # its other hold stays until its turn ends
                assert await asyncio.to_thread(
                    h.sql, "SELECT key FROM toolguard_hold_wait WHERE caller = %s",
                    (caller,)) == []
                # its release, cancelled at the same point, still ends the hold
                release = Counted(h.guard.arelease_holds(caller), cancel_at=point)

                async def stop(c: Counted = release) -> Any:
                    return await c

                try:
                    await asyncio.create_task(stop())
                except asyncio.CancelledError:
                    releases += 1
                assert h.guard.holds.holding(caller) == []
                assert await asyncio.to_thread(_rows, h, caller) == []
                await _free(h, "account:a")
            return releases

    assert asyncio.run(main()) >= 1
