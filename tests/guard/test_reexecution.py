"""Re-execution: resume after ``interrupt()``, node ``RetryPolicy``, cancelled async siblings.

LangGraph re-runs a whole node on resume and on retry, so a call that already
applied runs again; the idempotency record must answer it, so every effect
happens exactly once.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Command, RetryPolicy, interrupt

from guard.harness import Harness
from guard.tools import (
    EFFECT,
    LEAD_POLICY,
    LeadTools,
    await_event,
    calls_message,
    scripted,
    tool_graph,
    tool_messages,
)
from toolguard.adapters import GuardedToolCalls
from toolguard.call.context import current

MODES = ("sync", "async")

POLICY: dict[str, Any] = {
    "version": 1,
    "tools": {**LEAD_POLICY["tools"],
              "approve_discount": {"locks": ["lead:{lead_id}"], "agents": ["scorer"]}},
}


def approval_tool(asked: Counter[str]) -> BaseTool:
    """A fenced tool that asks a human (``interrupt``) before it writes."""

    def approve_discount(lead_id: str, pct: int) -> str:
        """Apply a discount once a person approved it."""
        asked[lead_id] += 1
        answer = interrupt({"lead": lead_id, "pct": pct})
        ctx = current()
        ctx.tx.execute(EFFECT, ("approve_discount", lead_id, pct, ctx.intent.call_id,
                                max(ctx.tokens.values())))
        return f"discount {pct}% on {lead_id}: {answer}"

    async def aapprove_discount(lead_id: str, pct: int) -> str:
        asked[lead_id] += 1
        answer = interrupt({"lead": lead_id, "pct": pct})
        ctx = current()
        await ctx.atx.execute(EFFECT, ("approve_discount", lead_id, pct, ctx.intent.call_id,
                                      max(ctx.tokens.values())))
        return f"discount {pct}% on {lead_id}: {answer}"

    return StructuredTool.from_function(func=approve_discount, coroutine=aapprove_discount)


def chained(calls: GuardedToolCalls, outer: Callable[..., Any],
            aouter: Callable[..., Any]) -> tuple[Any, Any]:
    """``outer`` wraps the guard (it is listed first, so it is the outermost layer)."""

    def wrap(request: Any, execute: Any) -> Any:
        return outer(request, lambda r: calls.wrap_tool_call(r, execute))

    async def awrap(request: Any, execute: Any) -> Any:
        async def inner(r: Any) -> Any:
            return await calls.awrap_tool_call(r, execute)

        return await aouter(request, inner)

    return wrap, awrap


def run_all(h: Harness, mode: str, plan: list[tuple[Any, Any, Any]]) -> list[Any]:
    """Invoke each ``(app, inputs, config)`` in order, sync or in one event loop."""
    if mode == "sync":
        return [app.invoke(inputs, config) for app, inputs, config in plan]

    async def main() -> list[Any]:
        async with h.async_edges():
            return [await app.ainvoke(inputs, config) for app, inputs, config in plan]

    return asyncio.run(main())


# --- interrupt / resume ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_resume_after_interrupt_applies_the_sibling_once(harness, mode: str) -> None:
    h: Harness = harness(POLICY)
    lead_tools = LeadTools()
    asked: Counter[str] = Counter()
    done: dict[str, threading.Event] = defaultdict(threading.Event)

    def outer(request: Any, call_next: Any) -> Any:  # the approval call starts once c1 is done
        if request.tool_call["id"] == "c2":
            assert done["c1"].wait(10)
        try:
            return call_next(request)
        finally:
            done[request.tool_call["id"]].set()

    async def aouter(request: Any, call_next: Any) -> Any:
        if request.tool_call["id"] == "c2":
            assert await await_event(done["c1"])
        try:
            return await call_next(request)
        finally:
            done[request.tool_call["id"]].set()

    wrap, awrap = chained(GuardedToolCalls(h.guard, agent="scorer"), outer, aouter)
    model = scripted(calls_message(("add_score", {"lead_id": "a", "delta": 5}, "c1"),
                                   ("approve_discount", {"lead_id": "b", "pct": 10}, "c2")),
                     AIMessage(content="done"))
    app = tool_graph(model, [*lead_tools.tools(), approval_tool(asked)], wrap=wrap, awrap=awrap,
                     checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"t-{uuid.uuid4().hex}"}}

    first, second = run_all(h, mode, [
        (app, {"messages": [HumanMessage("go")]}, config),
        (app, Command(resume="approved by ana"), config),
    ])

    assert [i.value for i in first["__interrupt__"]] == [{"lead": "b", "pct": 10}]
    assert second["messages"][-1].content == "done"
    answers = tool_messages(second["messages"])
    assert answers["c1"].status == "success" and answers["c1"].content == "a=5"  # as first time
    assert answers["c2"].content == "discount 10% on b: approved by ana"
    assert lead_tools.probe.runs == {"a": 1}  # the sibling's body ran once, its replay did not
    assert asked == {"b": 2}
    assert [(row[0], row[3]) for row in h.effects()] == [("add_score", "c1"),
                                                          ("approve_discount", "c2")]
    assert h.scores() == {"a": 5}
    assert h.decisions("c1") == [("accepted", "applied"), ("replayed", "duplicate")]
    assert [d for d, _ in h.decisions("c2")] == ["unknown", "accepted"]
    (entry,) = h.audit(intent_id="c2", decision="accepted")
    assert h.intent_status(entry.idempotency_key) == "applied"


# --- RetryPolicy -------------------------------------------------------------------------


class TransientError(ConnectionError):
    """A failure outside the guard after the effect landed: the response was lost."""


@pytest.mark.parametrize("checkpointed", [True, False], ids=["checkpointer", "no-checkpointer"])
@pytest.mark.parametrize("mode", MODES)
def test_retry_policy_rerun_applies_each_effect_once(harness, mode: str,
                                                     checkpointed: bool) -> None:
    h: Harness = harness(LEAD_POLICY)
    lead_tools = LeadTools()
    attempts: Counter[str] = Counter()

    def outer(request: Any, call_next: Any) -> Any:
        call_id = request.tool_call["id"]
        attempts[call_id] += 1
        result = call_next(request)
        if call_id == "c1" and attempts[call_id] == 1:
            raise TransientError("connection reset after the tool ran")
        return result

    async def aouter(request: Any, call_next: Any) -> Any:
        call_id = request.tool_call["id"]
        attempts[call_id] += 1
        result = await call_next(request)
        if call_id == "c1" and attempts[call_id] == 1:
            raise TransientError("connection reset after the tool ran")
        return result

    wrap, awrap = chained(GuardedToolCalls(h.guard, agent="scorer"), outer, aouter)
    model = scripted(calls_message(("add_score", {"lead_id": "a", "delta": 3}, "c1"),
                                   ("add_score", {"lead_id": "b", "delta": 4}, "c2")),
                     AIMessage(content="done"))
    retry = RetryPolicy(max_attempts=3, initial_interval=0.01, jitter=False,
                        retry_on=TransientError)
    app = tool_graph(model, lead_tools.tools(), wrap=wrap, awrap=awrap, retry_policy=retry,
                     checkpointer=InMemorySaver() if checkpointed else None)
    config = {"configurable": {"thread_id": f"t-{uuid.uuid4().hex}"}} if checkpointed else None

    (out,) = run_all(h, mode, [(app, {"messages": [HumanMessage("go")]}, config)])

    assert attempts["c1"] == 2  # the node did run again
    answers = tool_messages(out["messages"])
    assert answers["c1"].content == "a=3" and answers["c2"].content == "b=4"
    assert h.scores() == {"a": 3, "b": 4}
    assert sorted(row[3] for row in h.effects()) == ["c1", "c2"]
    assert lead_tools.probe.runs == {"a": 1, "b": 1}
    assert h.decisions("c1") == [("accepted", "applied"), ("replayed", "duplicate")]


# --- cancellation of async siblings -------------------------------------------------------


def test_cancelled_sibling_releases_locks_and_is_reconciled_once(harness) -> None:
    """One task of the superstep fails; LangGraph cancels the guarded call mid-tool.

    The lock is free at once, the intent is recorded as ``unknown``, and
    resuming from the checkpoint applies it exactly once.
    """
    h: Harness = harness(LEAD_POLICY)
    state = {"fail": True}
    stuck = threading.Event()

    async def hang_first_time(lead: str) -> None:
        if state["fail"]:
            stuck.set()
            await asyncio.sleep(30)  # cancelled here, inside the fenced transaction

    lead_tools = LeadTools(ahooks={"a": hang_first_time})
    calls = GuardedToolCalls(h.guard, agent="scorer")

    async def boom(_: MessagesState) -> dict[str, Any]:
        if state["fail"]:
            assert await await_event(stuck)
            raise RuntimeError("the enrichment service is down")
        return {}

    graph = StateGraph(MessagesState)
    graph.add_node("tools", ToolNode(lead_tools.tools(), wrap_tool_call=calls.wrap_tool_call,
                                     awrap_tool_call=calls.awrap_tool_call))
    graph.add_node("enrich", boom)
    graph.add_edge(START, "tools")
    graph.add_edge(START, "enrich")
    graph.add_edge("tools", END)
    graph.add_edge("enrich", END)
    app = graph.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"t-{uuid.uuid4().hex}"}}
    start = {"messages": [calls_message(("add_score", {"lead_id": "a", "delta": 7}, "c1"))]}

    def cancelled_and_free() -> None:
        # The cancelled call let go of its lock: taking it now needs no wait at all.
        lease = h.locks.acquire(["lead:a"], timeout_s=0)
        lease.release()
        assert [d for d, _ in h.decisions("c1")] == ["unknown"]
        (entry,) = h.audit(intent_id="c1")
        assert entry.reason == "cancelled"
        assert h.intent_status(entry.idempotency_key) == "unknown"
        assert h.scores() == {}

    async def main() -> dict[str, Any]:
        async with h.async_edges():
            with pytest.raises(RuntimeError, match="enrichment service"):
                await app.ainvoke(start, config)
            await asyncio.to_thread(cancelled_and_free)  # sync reads: not in the loop

            state["fail"] = False
            return await app.ainvoke(None, config)  # the next attempt: resume the superstep

    out = asyncio.run(main())

    assert tool_messages(out["messages"])["c1"].content == "a=7"
    assert h.scores() == {"a": 7}
    assert [row[3] for row in h.effects()] == ["c1"]
    assert [d for d, _ in h.decisions("c1")] == ["unknown", "accepted"]
    (entry,) = h.audit(intent_id="c1", decision="accepted")
    assert h.intent_status(entry.idempotency_key) == "applied"
