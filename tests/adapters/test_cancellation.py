"""Each async adapter path, cancelled at each of its await points in turn (issue 20).

Paths: the ToolNode wrapper's ``awrap_tool_call`` (around a real ToolNode's
async execution), ``ToolGuardMiddleware.awrap_tool_call`` and
``guard_tool(...).ainvoke``; on SQLite and on Redis + PostgreSQL. A first run
counts the call's await points (``cancel_harness``); then for k = 1..n a new
call is cancelled at its k-th. After each: the async pools idle, no task
exception left unretrieved, exactly one audit row for the call (``unknown``/
``cancelled`` when the cancellation landed, the call's own decision when it
finished first or the cancellation came after its commit was sent: a commit
runs to its end), at most one effect, the retry of the same call (same thread
and id) applying it exactly once in all, and the next 20 calls going through
(on the same lock key too: the lease was released, or expired within its TTL).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from guard.harness import KINDS, Backend, Harness
from guard.tools import LeadTools
from langchain_core.messages import ToolMessage
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.runtime import ExecutionInfo

from adapters.cancel_harness import (
    UnretrievedExceptions,
    cancel_at,
    count_await_points,
    idle_pools,
    settle,
)
from toolguard.adapters import GuardedToolCalls, ToolGuardMiddleware, guard_tool

POLICY = {"version": 1, "tools": {"add_score": {
    "locks": ["lead:{lead_id}"], "agents": ["scorer"], "ttl_ms": 3_000, "wait_timeout_s": 10}}}
PATHS = ("tool_node", "middleware", "guard_tool")
#: The await points counted per path and backend (printed with -s; the report quotes them).
COUNTED: dict[tuple[str, str], int] = {}


@pytest.fixture(params=KINDS)
def harness(request: pytest.FixtureRequest, unique: str, tmp_path: Any) -> Iterator[Harness]:
    for backend in Backend.for_test(request, unique, tmp_path):
        made = Harness(backend, POLICY)
        try:
            yield made
        finally:
            made.close()


def tool_call(call_id: str, lead: str) -> dict[str, Any]:
    return {"name": "add_score", "args": {"lead_id": lead, "delta": 1}, "id": call_id,
            "type": "tool_call"}


def path_call(path: str, h: Harness, tools: LeadTools) -> Callable[[str, str], Callable[[],
                                                                                      Awaitable[Any]]]:
    """``make(call_id, lead)``: a zero-argument coroutine function making that call on ``path``."""
    (add_score, _) = tools.tools()
    node = ToolNode([add_score])
    tool = node.tools_by_name["add_score"]
    calls = GuardedToolCalls(h.guard, agent="scorer")
    middleware = ToolGuardMiddleware(h.guard, agent="scorer")
    guarded_tool = guard_tool(h.guard, add_score, agent="scorer")

    async def execute(request: ToolCallRequest) -> Any:
        return await node._execute_tool_async(request, "tool_calls", {})

    def make(call_id: str, lead: str) -> Callable[[], Awaitable[Any]]:
        call = tool_call(call_id, lead)
        if path == "guard_tool":
            return lambda: guarded_tool.ainvoke(call, {"configurable": {"thread_id": "t-cancel"}})
        info = ExecutionInfo(thread_id="t-cancel", checkpoint_ns="tools:task", checkpoint_id="cp",
                             task_id="task", run_id=None, node_attempt=1)
        request = ToolCallRequest(tool_call=call, tool=tool, state={},
                                  runtime=SimpleNamespace(execution_info=info, config={}))  # type: ignore[arg-type]
        wrapper = calls.awrap_tool_call if path == "tool_node" else middleware.awrap_tool_call
        return lambda: wrapper(request, execute)

    return make


async def in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """The harness's sync reads, off the event loop."""
    return await asyncio.to_thread(function, *args)


def effects_of(h: Harness, call_id: str) -> int:
    return sum(1 for row in h.effects() if row[3] == call_id)


@pytest.mark.parametrize("path", PATHS)
def test_cancelled_at_every_await_point(harness: Harness, path: str) -> None:
    h = harness
    tools = LeadTools(pause_s=0.001)
    make = path_call(path, h, tools)

    async def main() -> int:
        async with h.async_edges():
            with UnretrievedExceptions().watching(asyncio.get_running_loop()) as watch:
                await make("c-warm", "warm")()  # once-per-guard checks (schema) out of the way
                points, answer = await count_await_points(make("c-count", "count"))
                assert isinstance(answer, ToolMessage) and answer.status == "success", answer
                assert points > 0
                for k in range(1, points + 1):
                    await one_cancellation(h, make, k, outcomes)
                await settle()
            assert not watch.reports, watch.reports
        return points

    outcomes: Counter[tuple[str, ...]] = Counter()
    points = asyncio.run(main())
    COUNTED[(path, h.backend.kind)] = points
    assert outcomes[("cancelled", "unknown", "cancelled")], outcomes
    print(f"\n{path} on {h.backend.kind}: {points} await points, each cancelled in turn: "
          f"{dict(outcomes)}")


async def one_cancellation(h: Harness, make: Callable[[str, str], Callable[[], Awaitable[Any]]],
                           k: int, outcomes: Counter[tuple[str, ...]]) -> None:
    call_id, lead = f"c-{k}", f"lead-{k}"
    ended = await cancel_at(make(call_id, lead), k)
    await settle()
    where = f"cancelled at await point {k}: {ended.where}"
    assert not idle_pools(h.guard), (where, idle_pools(h.guard))
    rows = await in_thread(h.decisions, call_id)
    applied = await in_thread(effects_of, h, call_id)
    assert applied <= 1, where
    if ended.cancelled and not applied:
        assert rows == [("unknown", "cancelled")], (where, rows)
    else:  # it finished first, or the cancellation came after its commit was sent
        assert rows == [("accepted", "applied")], (where, rows)
    outcomes[("cancelled" if ended.cancelled else "finished", *rows[0])] += 1

    retried = await make(call_id, lead)()  # the same call again: it replays or it runs, once
    assert isinstance(retried, ToolMessage) and retried.status == "success", (where, retried)
    assert await in_thread(effects_of, h, call_id) == 1, (where, "applied exactly once")

    after = await asyncio.gather(*(make(f"n{k}-{i}", lead if i % 2 else f"{lead}-{i}")()
                                   for i in range(20)))
    assert all(isinstance(m, ToolMessage) and m.status == "success" for m in after), (where, after)
    assert not idle_pools(h.guard), (where, idle_pools(h.guard))
