"""LangGraph and LangChain features run the same plain and guarded, sync and async.

Each test runs one graph twice, with a plain ``ToolNode`` (or agent) and with
toolguard in it, and compares what comes out: messages, state, stream chunks,
which nodes ran, interrupts. The only differences allowed are toolguard's
documented ones (its decision under ``response_metadata["toolguard"]``,
replays instead of re-runs); the ids LangGraph gives messages and the
checkpoint namespaces it makes up are left out of the comparison.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import pytest
from guard.tools import scripted
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware, ToolCallLimitMiddleware
from langchain.tools import ToolRuntime
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.cache.memory import InMemoryCache
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.config import get_stream_writer
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.store.memory import InMemoryStore
from langgraph.types import CachePolicy, Command, RetryPolicy, interrupt
from pydantic import BaseModel

from adapters.conftest import MODES, ai, answers, one_node, read_only, run, tool_call
from toolguard.adapters import GuardedToolCalls, ToolGuardMiddleware


def node(guard: Any | None, tools: list[Any], **options: Any) -> ToolNode:
    if guard is None:
        return ToolNode(tools, **options)
    calls = GuardedToolCalls(guard, agent="tester")
    return ToolNode(tools, wrap_tool_call=calls.wrap_tool_call,
                    awrap_tool_call=calls.awrap_tool_call, **options)


def plain(value: Any) -> Any:
    """``value`` without toolguard's metadata, message ids and checkpoint namespaces."""
    if hasattr(value, "model_dump") and not isinstance(value, type):
        return plain(value.model_dump(warnings=False))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()
                if k not in ("toolguard", "id", "langgraph_checkpoint_ns", "checkpoint_ns")}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def stream(app: Any, mode: str, inputs: Any, **options: Any) -> list[Any]:
    if mode == "sync":
        return list(app.stream(inputs, **options))

    async def chunks() -> list[Any]:
        return [chunk async for chunk in app.astream(inputs, **options)]

    return asyncio.run(chunks())


# --- streaming and the runtime a tool sees ------------------------------------------------------


class Session(MessagesState):
    user: str


@tool
def report(step: int, runtime: ToolRuntime) -> str:
    """Report progress through the stream writer and read the runtime."""
    get_stream_writer()({"progress": step})
    runtime.stream_writer({"runtime": step})
    stored = runtime.store.get(("prefs",), "k") if runtime.store is not None else None
    return (f"{step} user={runtime.state['user']} context={runtime.context} "
            f"store={stored.value if stored else None} call={runtime.tool_call_id} "
            f"tag={runtime.config.get('metadata', {}).get('tag')}")


@pytest.mark.parametrize("mode", MODES)
def test_stream_modes_and_the_tool_runtime_are_the_same_guarded(guarded, mode: str) -> None:
    g = guarded(read_only("report"))
    outs = []
    for guard in (None, g.guard):
        store = InMemoryStore()
        store.put(("prefs",), "k", {"lang": "en"})
        app = one_node(node(guard, [report]), state=Session, store=store)
        outs.append(stream(app, mode, {**ai(tool_call("report", {"step": 1})), "user": "ana"},
                           config={"metadata": {"tag": "t"}}, context={"tenant": "acme"},
                           stream_mode=["custom", "updates", "messages", "values"]))
    expected, out = outs

    assert plain(out) == plain(expected)
    assert ["custom", {"progress": 1}] in plain(out) and ["custom", {"runtime": 1}] in plain(out)
    assert g.decisions("c1") == [("accepted", "applied")]


# --- interrupts, retries, caching -------------------------------------------------------------


@tool
def two_questions() -> str:
    """Ask a person twice."""
    first = interrupt("first?")
    second = interrupt("second?")
    return f"{first}+{second}"


@pytest.mark.parametrize("mode", MODES)
def test_interrupts_in_one_tool_resumed_by_id_are_the_same_guarded(guarded, mode: str) -> None:
    g = guarded(read_only("two_questions"))
    outs = []
    for index, guard in enumerate((None, g.guard)):
        app = one_node(node(guard, [two_questions]), checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": f"t{index}"}}
        asked = run(app, mode, ai(tool_call("two_questions", {})), config)["__interrupt__"]
        again = run(app, mode, Command(resume={asked[0].id: "A"}), config)["__interrupt__"]
        out = run(app, mode, Command(resume={again[0].id: "B"}), config)
        outs.append(([i.value for i in asked], [i.value for i in again], plain(out),
                     app.get_state(config).next, app.get_state(config).interrupts))
    assert outs[1] == outs[0]
    assert outs[1][2]["messages"][-1]["content"] == "A+B"
    assert g.decisions("c1") == [("unknown", "interrupted")] * 2 + [("accepted", "applied")]


def flaky(attempts: list[int]) -> Any:
    @tool
    def fetch(key: str) -> str:
        """Fail on the first attempt."""
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            msg = "connection reset"
            raise ConnectionError(msg)
        return f"value of {key}"

    return fetch


@pytest.mark.parametrize("mode", MODES)
def test_a_retry_policy_reruns_a_failed_tool_as_without_toolguard(guarded, mode: str) -> None:
    g = guarded(read_only("fetch"))
    outs = []
    for guard in (None, g.guard):
        attempts: list[int] = []
        graph = StateGraph(MessagesState)
        graph.add_node("tools", node(guard, [flaky(attempts)], handle_tool_errors=False),
                       retry_policy=RetryPolicy(max_attempts=3, initial_interval=0, jitter=False,
                                                retry_on=ConnectionError))
        graph.add_edge(START, "tools")
        outs.append((plain(run(graph.compile(), mode, ai(tool_call("fetch", {"key": "k"})))),
                     attempts))
    assert outs[1] == outs[0]
    assert outs[1][1] == [1, 2]
    assert g.decisions("c1") == [("failed", "error"), ("accepted", "applied")]


def counted(runs: list[int]) -> Any:
    @tool
    def lookup(key: str) -> str:
        """Look a key up."""
        runs.append(1)
        return f"value of {key}"

    return lookup


@pytest.mark.parametrize("mode", MODES)
def test_a_cached_tool_node_is_answered_from_the_cache_as_without_toolguard(guarded,
                                                                            mode: str) -> None:
    g = guarded(read_only("lookup"))
    outs = []
    for guard in (None, g.guard):
        runs: list[int] = []
        graph = StateGraph(MessagesState)
        graph.add_node("tools", node(guard, [counted(runs)]), cache_policy=CachePolicy())
        graph.add_edge(START, "tools")
        app = graph.compile(cache=InMemoryCache())
        inputs = ai(tool_call("lookup", {"key": "k"}))
        outs.append((plain(run(app, mode, inputs)), plain(run(app, mode, inputs)), len(runs)))
    assert outs[1] == outs[0]
    assert outs[1][2] == 1  # the second invocation came from the cache: nothing ran, nothing audited
    assert g.decisions("c1") == [("accepted", "applied")]


# --- what tools return --------------------------------------------------------------------------


class Score(BaseModel):
    value: int


class Opaque:
    """An artifact JSON cannot hold."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)

    __hash__ = object.__hash__


@tool
def blocks() -> list[dict[str, str]]:
    """Content blocks."""
    return [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]


@tool
def mapping() -> dict[str, int]:
    """A dict."""
    return {"a": 1}


@tool
def nothing() -> None:
    """Nothing."""


@tool
def model() -> Score:
    """A pydantic object."""
    return Score(value=3)


@tool(response_format="content_and_artifact")
def opaque() -> tuple[str, Opaque]:
    """Text for the model, an object for the graph."""
    return "summary", Opaque()


KINDS = [blocks, mapping, nothing, model, opaque]


@pytest.mark.parametrize("mode", MODES)
def test_every_kind_of_tool_result_comes_out_as_toolnode_makes_it(guarded, mode: str) -> None:
    g = guarded(read_only(*(t.name for t in KINDS)))
    inputs = ai(*(tool_call(t.name, {}, t.name) for t in KINDS))
    expected = answers(run(one_node(node(None, KINDS)), mode, inputs))
    out = answers(run(one_node(node(g.guard, KINDS)), mode, inputs))

    assert {k: plain(m) for k, m in out.items()} == {k: plain(m) for k, m in expected.items()}
    assert isinstance(out["opaque"].artifact, Opaque)  # the first answer keeps the object itself
    assert [d for d, _ in g.decisions()] == ["accepted"] * len(KINDS)


# --- a tool in a subgraph sending the parent graph elsewhere ------------------------------------


class Routed(MessagesState):
    where: str


@tool
def escalate(reason: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
    """Hand the conversation to the parent graph's escalation node."""
    return Command(graph=Command.PARENT, goto="escalation",
                   update={"messages": [ToolMessage(f"escalated: {reason}", tool_call_id=tool_call_id)],
                           "where": "parent"})


def nested(guard: Any | None) -> Any:
    sub = StateGraph(Routed)
    sub.add_node("tools", node(guard, [escalate]))
    sub.add_edge(START, "tools")
    parent = StateGraph(Routed)
    parent.add_node("agent", sub.compile(), destinations=("escalation",))
    parent.add_node("escalation", lambda _s: {"messages": [AIMessage("a person takes over")]})
    parent.add_edge(START, "agent")
    return parent.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("mode", MODES)
def test_a_command_to_the_parent_graph_goes_there_as_without_toolguard(guarded, mode: str) -> None:
    g = guarded(read_only("escalate"))
    config = {"configurable": {"thread_id": "t1"}}
    inputs = ai(tool_call("escalate", {"reason": "angry"}))
    expected = run(nested(None), mode, inputs, config)
    out = run(nested(g.guard), mode, inputs, config)

    assert plain(out) == plain(expected)
    assert out["where"] == "parent" and out["messages"][-1].content == "a person takes over"
    assert g.decisions("c1") == [("accepted", "applied")]


# --- create_agent: toolguard beside LangChain's own tool middlewares ----------------------------


def sender(sent: list[str]) -> Any:
    @tool
    def send(to: str) -> str:
        """Send a message."""
        sent.append(to)
        return f"sent to {to}"

    return send


def agent_outcome(middleware: list[Any], mode: str, thread: str) -> tuple[Any, list[str]]:
    sent: list[str] = []
    model = scripted(AIMessage(content="", tool_calls=[
        tool_call("send", {"to": "a"}, "s1"), tool_call("send", {"to": "b"}, "s2"),
        tool_call("send", {"to": "c"}, "s3")]), AIMessage(content="done"))
    agent = create_agent(model, [sender(sent)], middleware=middleware, checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": thread}}
    out = run(agent, mode, {"messages": [HumanMessage("go")]}, config)
    if "__interrupt__" in out:
        out = run(agent, mode, Command(resume={"decisions": [
            {"type": "approve"},
            {"type": "edit", "edited_action": {"name": "send", "args": {"to": "B"}}},
            {"type": "reject", "message": "not c"}]}), config)
    by_call = {m.tool_call_id: plain(m) for m in out["messages"] if isinstance(m, ToolMessage)}
    return (by_call, plain(out["messages"][-1])), sorted(sent)


MIDDLEWARES = {
    "call-limit": lambda: ToolCallLimitMiddleware(run_limit=2),
    "human-in-the-loop": lambda: HumanInTheLoopMiddleware(interrupt_on={"send": True}),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ["toolguard-last", "toolguard-first"])
@pytest.mark.parametrize("kind", list(MIDDLEWARES))
def test_langchains_tool_middlewares_work_as_without_toolguard(guarded, mode: str, order: str,
                                                               kind: str) -> None:
    g = guarded(read_only("send"))
    other = MIDDLEWARES[kind]
    mine = ToolGuardMiddleware(g.guard, agent="tester")
    stack = [other(), mine] if order == "toolguard-last" else [mine, other()]
    expected = agent_outcome([other()], mode, "plain")
    out = agent_outcome(stack, mode, "guarded")

    assert out == expected
    ran = sorted(call_id for call_id, _ in
                 ((row.intent_id, row) for row in g.audit()) if call_id)
    assert ran == ["s1", "s2"]  # the refused third call never reached toolguard
    assert [d for d, _ in g.decisions()] == ["accepted", "accepted"]
