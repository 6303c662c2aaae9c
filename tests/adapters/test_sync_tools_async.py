"""Ordinary sync tools under ``ainvoke``/``astream``: the sync guarded call, in a worker thread.

A sync tool body reads ``current().tx`` (the sync fenced transaction). Through
an async adapter it runs its sync guarded call in one of toolguard's worker
threads when the guard has sync edges: the same identity, transaction and
audit as on ``invoke``, the caller's contextvars, and the event loop never
blocked. A guard with only asyncio edges cannot run such a body: the adapter
refuses to be built with the sync tools (``GuardMisconfigured`` naming them).
Every test runs on SQLite and on Redis + PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from guard.harness import KINDS, Backend, Harness, wait_until
from guard.tools import LEAD_POLICY, LeadTools, calls_message, scripted, tool_messages
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import BaseTool, StructuredTool, tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from toolguard import ToolGuard
from toolguard.adapters import GuardedToolCalls, ToolGuardMiddleware, guard_tool, guarded
from toolguard.errors import GuardMisconfigured
from toolguard.locks import connect_async
from toolguard.policies import Policy
from toolguard.store import open_async_store

#: What a sync tool body saw: the contextvar the caller set, and the thread it ran in.
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


@pytest.fixture(params=KINDS)
def harness(request: pytest.FixtureRequest, unique: str, tmp_path: Any) -> Iterator[Harness]:
    for backend in Backend.for_test(request, unique, tmp_path):
        made = Harness(backend, LEAD_POLICY)
        try:
            yield made
        finally:
            made.close()


class SyncLeadTools(LeadTools):
    """``add_score`` with a sync body only (no coroutine), as most tools are written."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.seen: list[tuple[str, str, bool]] = []
        self._lock = threading.Lock()

    def _write(self, tool: str, lead_id: str, delta: int) -> str:
        with self._lock:
            self.seen.append((REQUEST_ID.get(), threading.current_thread().name,
                              _loop_running()))
        return super()._write(tool, lead_id, delta)

    def tools(self) -> list[BaseTool]:
        def add_score(lead_id: str, delta: int) -> str:
            """Add ``delta`` to the lead's score."""
            return self._write("add_score", lead_id, delta)

        return [StructuredTool.from_function(func=add_score)]


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def tool_node_graph(guard: ToolGuard, tools: list[BaseTool]) -> Any:
    calls = GuardedToolCalls(guard, agent="scorer", tools=tools)
    node = ToolNode(tools, wrap_tool_call=calls.wrap_tool_call,
                    awrap_tool_call=calls.awrap_tool_call)
    return StateGraph(MessagesState).add_node("tools", node).add_edge(START, "tools").compile()


def adds(*calls: tuple[str, int, str]) -> dict[str, Any]:
    return {"messages": [calls_message(*[("add_score", {"lead_id": lead, "delta": d}, cid)
                                         for lead, d, cid in calls])]}


async def with_request_id(h: Harness, coroutine_fn: Any) -> Any:
    REQUEST_ID.set("req-42")
    async with h.async_edges():
        return await coroutine_fn()


def test_a_sync_tool_runs_its_sync_guarded_call_under_ainvoke(harness: Harness) -> None:
    """On main this raised GuardMisconfigured: the body ran on the async path (no tx)."""
    tools = SyncLeadTools()
    app = tool_node_graph(harness.guard, tools.tools())
    config = {"configurable": {"thread_id": "t-1"}}

    out = asyncio.run(with_request_id(harness, lambda: app.ainvoke(
        adds(("a", 5, "c1"), ("a", 7, "c2"), ("b", 1, "c3")), config)))

    answers = tool_messages(out["messages"])
    assert {cid: m.status for cid, m in answers.items()} == {"c1": "success", "c2": "success",
                                                              "c3": "success"}
    assert harness.scores() == {"a": 12, "b": 1}
    assert tools.probe.peak["a"] == 1  # serialized on the lead, as on invoke
    assert all(request == "req-42" for request, _, _ in tools.seen)  # contextvars carried
    assert all(name.startswith("toolguard-sync-call") and not on_loop
               for _, name, on_loop in tools.seen)
    for cid in ("c1", "c2", "c3"):
        assert harness.decisions(cid) == [("accepted", "applied")]
        meta = answers[cid].response_metadata["toolguard"]
        assert meta["idempotency_key"].startswith("thread:t-1/")
        assert meta["tokens"]  # written under its fence, in the sync fenced transaction


def test_the_worker_path_has_the_sync_paths_identity(harness: Harness) -> None:
    """A call applied under ainvoke is a replay under invoke (and back): one key, one effect."""
    tools = SyncLeadTools()
    app = tool_node_graph(harness.guard, tools.tools())
    config = {"configurable": {"thread_id": "t-2"}}

    asyncio.run(with_request_id(harness, lambda: app.ainvoke(adds(("a", 3, "c1")), config)))
    again = app.invoke(adds(("a", 3, "c1")), config)
    back = asyncio.run(with_request_id(harness, lambda: app.ainvoke(adds(("a", 3, "c1")),
                                                                     config)))

    assert tool_messages(again["messages"])["c1"].content == "a=3"
    assert tool_messages(back["messages"])["c1"].content == "a=3"
    assert harness.decisions("c1") == [("accepted", "applied"), ("replayed", "duplicate"),
                                       ("replayed", "duplicate")]
    assert harness.scores() == {"a": 3} and len(harness.effects()) == 1


def fail(_lead: str) -> None:
    raise KeyError("boom")


def test_a_failing_sync_tool_is_rolled_back_and_raises_as_on_invoke(harness: Harness) -> None:
    tools = SyncLeadTools(hooks={"x": fail})
    app = tool_node_graph(harness.guard, tools.tools())

    with pytest.raises(KeyError, match="boom"):  # ToolNode's default handler lets it through
        asyncio.run(with_request_id(harness, lambda: app.ainvoke(adds(("x", 1, "c1")))))

    assert harness.decisions("c1") == [("failed", "error")]
    assert harness.effects() == [] and harness.scores() == {}


def test_many_parallel_sync_calls_never_starve_the_workers(harness: Harness) -> None:
    """More calls in one superstep than toolguard's workers and the loop's default executor."""
    tools = SyncLeadTools(pause_s=0.0)
    app = tool_node_graph(harness.guard, tools.tools())
    calls = [(f"l{i % 5}", 1, f"c{i}") for i in range(40)]

    out = asyncio.run(with_request_id(harness, lambda: app.ainvoke(adds(*calls))))

    assert all(m.status == "success" for m in tool_messages(out["messages"]).values())
    assert harness.scores() == {f"l{i}": 8 for i in range(5)}
    assert all(tools.probe.peak[f"l{i}"] == 1 for i in range(5))


def test_astream_and_create_agent_run_sync_tools_too(harness: Harness) -> None:
    tools = SyncLeadTools()
    model = scripted(calls_message(("add_score", {"lead_id": "a", "delta": 2}, "c1"),
                                   ("add_score", {"lead_id": "a", "delta": 3}, "c2")),
                     AIMessage(content="done"))
    agent = create_agent(model, tools.tools(), middleware=[
        ToolGuardMiddleware(harness.guard, agent="scorer", tools=tools.tools())])

    async def chunks() -> list[Any]:
        return [chunk async for chunk in agent.astream({"messages": [HumanMessage("go")]},
                                                       stream_mode="updates")]

    streamed = asyncio.run(with_request_id(harness, chunks))

    assert any("tools" in chunk for chunk in streamed)
    assert harness.scores() == {"a": 5}
    assert [d for d, _ in harness.decisions("c1") + harness.decisions("c2")] == ["accepted"] * 2


def test_guard_tool_and_guarded_functions_run_sync_bodies_in_a_worker(harness: Harness) -> None:
    tools = SyncLeadTools()
    (add_score,) = tools.tools()
    guarded_add = guard_tool(harness.guard, add_score, agent="scorer")

    @guarded(harness.guard, name="add_score", agent="scorer")
    def add_points(lead_id: str, delta: int) -> str:
        return tools._write("add_score", lead_id, delta)

    async def main() -> tuple[Any, Any]:
        message = await guarded_add.ainvoke({"name": "add_score", "id": "c1", "type": "tool_call",
                                             "args": {"lead_id": "a", "delta": 4}},
                                            {"configurable": {"thread_id": "t-3"}})
        decision = await add_points.arun({"lead_id": "a", "delta": 6}, call_id="c2",
                                         thread_id="t-3")
        return message, decision

    message, decision = asyncio.run(with_request_id(harness, main))

    assert message.content == "a=4" and decision.result == "a=10"
    assert harness.decisions("c1") == [("accepted", "applied")]
    assert harness.decisions("c2") == [("accepted", "applied")]
    assert all(name.startswith("toolguard-sync-call") for _, name, _ in tools.seen)


def test_a_cancelled_caller_leaves_the_sync_call_to_finish_as_a_sync_sibling_does(
        harness: Harness) -> None:
    """Cancelling the awaiting task does not stop a sync body (as LangGraph's sync siblings):
    the call completes, is audited once and applied once; the next calls go through."""
    entered, release = threading.Event(), threading.Event()

    def hold(_lead: str) -> None:
        entered.set()
        release.wait(30)

    tools = SyncLeadTools(hooks={"held": hold})
    app = tool_node_graph(harness.guard, tools.tools())

    async def main() -> None:
        task = asyncio.create_task(app.ainvoke(adds(("held", 1, "c-held"))))
        await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.to_thread(wait_until, lambda: harness.decisions("c-held"), 30.0,
                                "the held call's audit row")
        out = await app.ainvoke(adds(*[("next", 1, f"n{i}") for i in range(20)]))
        assert all(m.status == "success" for m in tool_messages(out["messages"]).values())

    asyncio.run(with_request_id(harness, main))

    assert harness.decisions("c-held") == [("accepted", "applied")]
    assert harness.scores() == {"held": 1, "next": 20}


def test_a_loop_that_shuts_down_mid_call_leaves_it_unknown_and_rolled_back(
        harness: Harness) -> None:
    """``asyncio.run`` ends while the sync body runs: its transaction is rolled back and the
    call is recorded unknown; the retry (same thread and call id) then applies it once."""
    entered, release = threading.Event(), threading.Event()

    def hold(_lead: str) -> None:
        entered.set()
        release.wait(30)

    tools = SyncLeadTools(hooks={"held": hold})
    app = tool_node_graph(harness.guard, tools.tools())
    config = {"configurable": {"thread_id": "t-4"}}

    async def main() -> None:
        asyncio.get_running_loop().create_task(app.ainvoke(adds(("held", 1, "c1")), config))
        await asyncio.to_thread(entered.wait, 30)  # returning now cancels the graph's tasks

    asyncio.run(with_request_id(harness, main))
    release.set()
    wait_until(lambda: harness.decisions("c1"), 30.0, "the interrupted call's audit row")

    assert harness.decisions("c1") == [("unknown", "cancelled")]
    assert harness.effects() == []
    tools.hooks.clear()
    out = app.invoke(adds(("held", 1, "c1")), config)
    assert tool_messages(out["messages"])["c1"].content == "held=1"
    assert harness.scores() == {"held": 1}


# --- a guard with only asyncio edges -----------------------------------------------------------


@pytest.fixture
def async_only(tmp_path: Any) -> ToolGuard:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    return ToolGuard(Policy.from_dict(LEAD_POLICY), async_locks=connect_async(
        f"sqlite:///{tmp_path / 'locks.db'}"), async_store=open_async_store(url))


@tool
def reassign_lead(lead_id: str, owner: str) -> str:
    """A sync tool."""
    return owner


@tool
async def async_reassign(lead_id: str, owner: str) -> str:
    """An async tool."""
    return owner


def test_an_async_only_guard_refuses_to_be_built_with_sync_tools(async_only: ToolGuard) -> None:
    (add_score,) = SyncLeadTools().tools()
    sync_tools = [add_score, reassign_lead, async_reassign]
    with pytest.raises(GuardMisconfigured, match=r"'add_score', 'reassign_lead' are sync"):
        GuardedToolCalls(async_only, agent="scorer", tools=sync_tools)
    with pytest.raises(GuardMisconfigured, match=r"'add_score', 'reassign_lead' are sync"):
        ToolGuardMiddleware(async_only, agent="scorer", tools=sync_tools)
    with pytest.raises(GuardMisconfigured, match=r"'reassign_lead' is sync"):
        guard_tool(async_only, reassign_lead, agent="scorer")
    with pytest.raises(GuardMisconfigured, match="add_score is a sync function"):
        @guarded(async_only, name="add_score", agent="scorer")
        def add_points(lead_id: str, delta: int) -> None: ...

    GuardedToolCalls(async_only, agent="scorer", tools=[async_reassign])  # async tools are fine
    guard_tool(async_only, async_reassign, agent="scorer")


def test_without_tools_given_the_first_sync_call_names_the_nodes_sync_tools(
        async_only: ToolGuard) -> None:
    (add_score,) = SyncLeadTools().tools()
    calls = GuardedToolCalls(async_only, agent="scorer")
    node = ToolNode([add_score, reassign_lead, async_reassign], wrap_tool_call=calls.wrap_tool_call,
                    awrap_tool_call=calls.awrap_tool_call, handle_tool_errors=False)
    app = StateGraph(MessagesState).add_node("tools", node).add_edge(START, "tools").compile()

    with pytest.raises(GuardMisconfigured, match=r"'add_score', 'reassign_lead' are sync"):
        asyncio.run(app.ainvoke(adds(("a", 1, "c1"))))
