"""Cancel a guarded call at each of its await points in turn, and check what it leaves.

``Counted(coro)`` forwards a coroutine and counts the times it suspends its task
(each is an await point the task can be cancelled at). A first run counts them;
then the call is run again once per point, cancelled at the 1st, 2nd, ... nth
suspension: ``Task.cancel()`` made while the task is running cancels the future
it suspends on next, so the ``CancelledError`` arrives exactly at that point.

After each cancellation the checks are those of DESIGN.md point 17: every
connection of the asyncio store's pool idle and usable, no task exception left
unretrieved, the lease released (its keys free at once for another manager),
exactly one audit row for the call (``unknown``/``cancelled``, or the decision it
had reached when the cancellation came after it was recorded), the retry of the
same call applies its effect once in total, and the next calls succeed.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any

from guard.harness import Harness
from toolguard.call.context import CallContext
from toolguard.call.decision import Decision
from toolguard.call.intent import Intent
from toolguard.guard import ToolGuard
from toolguard.steps.schema import SchemaCheck

__all__ = ["Counted", "Sweep", "sweep"]

#: Calls that must succeed after each cancellation (run together, on their own leads).
FOLLOW_UP = 20


class Counted:
    """Await ``coro``, counting its suspensions; cancel its task at the ``cancel_at``-th."""

    def __init__(self, coro: Coroutine[Any, Any, Any], cancel_at: int | None = None) -> None:
        self.coro = coro
        self.cancel_at = cancel_at
        self.points = 0

    def __await__(self) -> Generator[Any, Any, Any]:
        inner = self.coro.__await__()
        send: Any = None
        throw: BaseException | None = None
        while True:
            try:
                yielded = inner.throw(throw) if throw is not None else inner.send(send)
            except StopIteration as stop:
                return stop.value
            self.points += 1
            if self.points == self.cancel_at:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()  # delivered at this suspension
            try:
                send, throw = (yield yielded), None
            except BaseException as error:
                send, throw = None, error


@dataclass
class Sweep:
    """What one path's sweep found: its await points and the outcome at each."""

    points: int = 0
    outcomes: list[str] = field(default_factory=list)


Body = Callable[[CallContext], Awaitable[Any]]


def effect_body(h: Harness) -> Body:
    """The test tool: one effect row in the fenced transaction (or none without keys)."""
    from guard.tools import EFFECT

    async def body(ctx: CallContext) -> str:
        if ctx.keys:
            args = ctx.args
            await ctx.atx.execute(EFFECT, ("add_score", args["lead_id"], args["delta"],
                                          ctx.intent.call_id, ctx.lease.token if ctx.lease else 0))
        return "ok"

    return body


async def _idle(h: Harness) -> None:
    """Wait (bounded) until the asyncio store's pool has every connection back, then use one."""
    store = h.guard.async_store
    pool = getattr(store, "_pool", None)
    if pool is not None:
        for _ in range(1000):
            stats = pool.get_stats()
            if stats.get("pool_available", 0) == stats.get("pool_size", 0):
                break
            await asyncio.sleep(0.01)
        stats = pool.get_stats()
        assert stats.get("pool_available", 0) == stats.get("pool_size", 0), stats
        async with pool.connection() as conn:  # usable: a clean connection, no transaction
            await conn.execute("SELECT 1")
    for _ in range(3):  # let shielded cleanups finish their last steps
        await asyncio.sleep(0)


async def sweep(h: Harness, make_intent: Callable[..., Intent], *, keys: tuple[str, ...],
                expect_first: str, body: Body | None = None) -> Sweep:
    """Count ``make_intent``'s await points, then cancel at each one and check the aftermath.

    ``expect_first`` is the decision kind of the uncancelled call (``accepted``,
    ``rejected``...). Runs inside the harness's asyncio edges.
    """
    guard = h.guard
    run_body = body or effect_body(h)
    found = Sweep()
    unretrieved: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))

    cold(guard)
    first = Counted(guard.arun(make_intent("count"), run_body))
    decision: Decision = await first
    assert decision.kind == expect_first, decision
    found.points = first.points
    await _idle(h)

    other = h.backend.alocks()  # another manager, as another process would take the keys
    try:
        await _sweep_points(h, make_intent, keys, expect_first, run_body, found, unretrieved,
                            other)
    finally:
        await other.aclose()
    loop.set_exception_handler(None)
    return found


async def _sweep_points(h: Harness, make_intent: Callable[..., Intent], keys: tuple[str, ...],
                        expect_first: str, run_body: Body, found: Sweep,
                        unretrieved: list[dict[str, Any]], other: Any) -> None:
    guard = h.guard
    for point in range(1, found.points + 1):
        call_id = f"cancel-{point}"
        intent = make_intent(call_id)
        cold(guard)
        counted = Counted(guard.arun(intent, run_body), cancel_at=point)
        try:
            reached = await asyncio.create_task(_await(counted))
        except asyncio.CancelledError:
            outcome = "cancelled"
        else:
            # Network I/O suspends a varying number of times (a reply already there or not):
            # a run with fewer points than ``point`` ends before it, and is checked the same.
            assert counted.points < point, (point, counted.points, reached)
            outcome = f"completed:{reached.kind}"
        found.outcomes.append(outcome)
        await _idle(h)
        gc.collect()
        await asyncio.sleep(0)
        assert not unretrieved, (point, unretrieved)

        # the lease is released: another manager takes the keys at once
        if keys:
            lease = await other.acquire(list(keys), timeout_s=10)
            await lease.arelease()

        rows = await asyncio.to_thread(h.decisions, call_id)
        assert len(rows) == 1, (point, outcome, rows)
        if outcome != "cancelled":
            assert rows[0][0] == expect_first, (point, rows)
        if outcome == "cancelled":
            assert rows[0][0] in ("unknown", expect_first, "replayed"), (point, rows)

        # the retry of the same call: its effect applies once in total
        again = await guard.arun(intent, run_body)
        assert again.kind in (expect_first, "replayed"), (point, again)
        effects = [e for e in await asyncio.to_thread(h.effects) if e[3] == call_id]
        assert len(effects) <= 1, (point, effects)
        if expect_first == "accepted" and keys:
            assert len(effects) == 1, (point, effects)

        # the next calls in this process succeed
        follow = await asyncio.gather(*(guard.arun(make_intent(f"after-{point}-{n}", lead=f"f{n}"),
                                                   run_body) for n in range(FOLLOW_UP)))
        assert all(d.kind == expect_first for d in follow), [d.kind for d in follow]


def cold(guard: ToolGuard) -> None:
    """Make the next call take every step: its store's schema is checked again (the guard
    checks it once per store; the harness's guards read the kill switch on every call)."""
    guard._schema = SchemaCheck()


async def _await(counted: Counted) -> Any:
    return await counted


