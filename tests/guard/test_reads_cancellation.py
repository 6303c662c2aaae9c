"""Cancellation at every await point of a read and of a checked write (DESIGN 17, 19).

A read cancelled anywhere leaves exactly one audit row, records no observation
unless its row says it was read, leaves the store's pool idle, and the next
calls work. A write whose policy tracks reads is swept by ``cancel_harness``
like any fenced write (its read check runs in the fenced transaction).
"""

from __future__ import annotations

import asyncio
from typing import Any

from guard.cancel_harness import Counted, _idle, cold, sweep
from guard.harness import Harness
from guard.tools import READ
from toolguard.call.context import CallContext
from toolguard.call.intent import Intent, WorkflowIdentity
from toolguard.store.reads import caller_of

POLICY: dict[str, Any] = {"version": 1, "tools": {
    "get_score": {"reads": ["lead:{lead_id}"], "agents": ["scorer"]},
    "add_score": {"locks": ["lead:{lead_id}"], "agents": ["scorer"]},
}}


def _read_intent(call_id: str, lead: str = "a") -> Intent:
    return Intent(tool="get_score", agent="scorer", call_id=call_id, args={"lead_id": lead},
                  workflow=WorkflowIdentity(thread_id=f"thread-{call_id}"))


async def _read_body(ctx: CallContext) -> int:
    row = await (await ctx.atx.execute(READ, (ctx.args["lead_id"],))).fetchone()
    return int(row[0]) if row else 0


def _observations(h: Harness, call_id: str) -> int:
    caller = caller_of("scorer", f"thread-{call_id}")
    return len(h.sql("SELECT key FROM toolguard_read WHERE caller = %s", (caller,)))


def test_a_read_cancelled_at_every_await_point(harness: Any) -> None:
    h: Harness = harness(POLICY)

    async def main() -> tuple[int, list[str]]:
        async with h.async_edges():
            guard = h.guard
            cold(guard)
            first = Counted(guard.arun(_read_intent("count"), _read_body))
            assert (await first).reason == "read"
            outcomes = []
            for point in range(1, first.points + 1):
                call_id = f"cancel-{point}"
                cold(guard)
                counted = Counted(guard.arun(_read_intent(call_id), _read_body), cancel_at=point)
                try:
                    reached = await asyncio.create_task(_await(counted))
                    outcomes.append(f"completed:{reached.reason}")
                except asyncio.CancelledError:
                    outcomes.append("cancelled")
                await _idle(h)
                rows = await asyncio.to_thread(h.decisions, call_id)
                assert len(rows) == 1, (point, rows)
                seen = await asyncio.to_thread(_observations, h, call_id)
                # an observation only for a read its row says completed; a read keeps no intent
                assert seen == (1 if rows[0] == ("accepted", "read") else 0), (point, rows, seen)
                intents = await asyncio.to_thread(
                    h.sql, "SELECT count(*) FROM toolguard_intent WHERE tool = 'get_score'")
                assert intents == [(0,)], (point, intents)
                follow = await asyncio.gather(*(guard.arun(_read_intent(f"after-{point}-{n}"),
                                                           _read_body) for n in range(5)))
                assert all(d.reason == "read" for d in follow)
            return first.points, outcomes

    points, outcomes = asyncio.run(main())
    assert points > 0 and "cancelled" in outcomes


def test_a_checked_write_cancelled_at_every_await_point(harness: Any) -> None:
    h: Harness = harness(POLICY)

    def write(call_id: str, lead: str = "a") -> Intent:
        return Intent(tool="add_score", agent="scorer", call_id=call_id,
                      args={"lead_id": lead, "delta": 1})

    async def main() -> int:
        async with h.async_edges():
            return (await sweep(h, write, keys=("lead:a",), expect_first="accepted")).points

    assert asyncio.run(main()) > 0


async def _await(counted: Counted) -> Any:
    return await counted
