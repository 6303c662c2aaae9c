"""Compiled LangGraph graphs with a guarded ToolNode: serialization, parallelism, rejections.

A fake chat model emits one AIMessage with parallel tool calls; the ToolNode runs
them (threads on ``invoke``, ``asyncio.gather`` on ``ainvoke``) through
``GuardedToolCalls``. Every test runs sync and async, on SQLite and on
Redis + PostgreSQL.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage

from guard.harness import Harness
from guard.tools import (
    LEAD_POLICY,
    LeadTools,
    await_event,
    calls_message,
    scripted,
    tool_graph,
    tool_messages,
)
from toolguard.adapters import GuardedToolCalls

MODES = ("sync", "async")


def invoke(harness: Harness, app: Any, mode: str, inputs: Any,
           config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the graph once, sync or async (the async edges live in the test's own loop)."""
    if mode == "sync":
        return app.invoke(inputs, config)

    async def main() -> dict[str, Any]:
        async with harness.async_edges():
            return await app.ainvoke(inputs, config)

    return asyncio.run(main())


def guarded_graph(harness: Harness, tools: LeadTools, *turns: AIMessage, agent: str = "scorer",
                  **options: Any) -> Any:
    calls = GuardedToolCalls(harness.guard, agent=agent)
    model = scripted(*turns, AIMessage(content="done"))
    return tool_graph(model, tools.tools(), wrap=calls.wrap_tool_call,
                      awrap=calls.awrap_tool_call, **options)


@pytest.mark.parametrize("mode", MODES)
def test_calls_on_one_lead_serialize_and_the_score_is_exact(harness, mode: str) -> None:
    h: Harness = harness(LEAD_POLICY)
    tools = LeadTools(pause_s=0.005)
    on_a = [("add_score", {"lead_id": "a", "delta": d}, f"a{d}") for d in range(1, 7)]
    on_b = [("add_score", {"lead_id": "b", "delta": 10 * d}, f"b{d}") for d in range(1, 3)]
    app = guarded_graph(h, tools, calls_message(*on_a, *on_b))

    out = invoke(h, app, mode, {"messages": [HumanMessage("score the leads")]})

    answers = tool_messages(out["messages"])
    assert {cid: m.status for cid, m in answers.items()} == {
        cid: "success" for _, _, cid in [*on_a, *on_b]}
    assert out["messages"][-1].content == "done"
    assert tools.probe.peak["a"] == 1 and tools.probe.peak["b"] == 1
    assert h.scores() == {"a": 21, "b": 30}
    applied = [row for row in h.effects() if row[1] == "a"]
    assert sorted(row[2] for row in applied) == [1, 2, 3, 4, 5, 6]
    tokens = [row[4] for row in applied]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)  # commit order = grant order
    for _, _, call_id in [*on_a, *on_b]:
        assert h.decisions(call_id) == [("accepted", "applied")]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_calls_on_different_leads_run_in_parallel(harness, mode: str) -> None:
    """Both bodies are inside at once: each waits until the other lead's lock was granted
    and the other body entered.

    PostgreSQL only: the embedded SQLite store runs one fenced transaction at a
    time (``BEGIN IMMEDIATE``, and ``begin_intent`` writes before the lock is
    taken), so there calls on different leads are serialized by the file.
    """
    h: Harness = harness(LEAD_POLICY)
    granted: dict[str, threading.Event] = defaultdict(threading.Event)
    seen: dict[str, bool] = {}
    other = {"a": "b", "b": "a"}

    def hook(lead: str) -> None:
        seen[lead] = (granted[f"lead:{other[lead]}"].wait(10)
                      and tools.probe.event(other[lead]).wait(10))

    async def ahook(lead: str) -> None:
        seen[lead] = (await await_event(granted[f"lead:{other[lead]}"])
                      and await await_event(tools.probe.event(other[lead])))

    tools = LeadTools(hooks={"a": hook, "b": hook}, ahooks={"a": ahook, "b": ahook})
    app = guarded_graph(h, tools, calls_message(("add_score", {"lead_id": "a", "delta": 1}, "ca"),
                                                ("add_score", {"lead_id": "b", "delta": 2}, "cb")))
    spy_grants(h, granted)

    out = invoke(h, app, mode, {"messages": [HumanMessage("go")]})

    assert seen == {"a": True, "b": True}
    assert tools.probe.overlap == 2
    assert {m.status for m in tool_messages(out["messages"]).values()} == {"success"}
    assert h.scores() == {"a": 1, "b": 2}


def spy_grants(h: Harness, granted: dict[str, threading.Event]) -> None:
    """Set ``granted[key]`` when the guard's lock manager (sync or async) grants ``key``."""
    sync_acquire = h.guard.locks.acquire

    def acquire(keys: Any, **options: Any) -> Any:
        lease = sync_acquire(keys, **options)
        for key in lease.keys:
            granted[key].set()
        return lease

    h.guard.locks.acquire = acquire  # type: ignore[method-assign]
    edges = h.async_edges

    def async_edges() -> Any:
        manager = edges()

        class Spied:
            async def __aenter__(self) -> Any:
                guard = await manager.__aenter__()
                original = guard.async_locks.acquire

                async def aacquire(keys: Any, **options: Any) -> Any:
                    lease = await original(keys, **options)
                    for key in lease.keys:
                        granted[key].set()
                    return lease

                guard.async_locks.acquire = aacquire
                return guard

            async def __aexit__(self, *exc: Any) -> Any:
                return await manager.__aexit__(*exc)

        return Spied()

    h.async_edges = async_edges  # type: ignore[method-assign]


REJECTED_CALLS = [
    # (tool, args, call id, reason audited, who words the answer). A call toolguard refuses
    # never reaches ToolNode, also when the tool's own schema would refuse it too; a tool
    # neither the policy nor the ToolNode has gets ToolNode's own wording of that refusal.
    ("reassign_lead", {"lead_id": "a", "owner": "mallory"}, "c-denied", "not_authorized",
     "toolguard"),
    ("add_score", {"lead_id": "a", "delta": "7"}, "c-type", "invalid_arguments", "toolguard"),
    ("add_score", {"lead_id": "a", "delta": 1, "admin": True}, "c-extra", "invalid_arguments",
     "toolguard"),
    ("add_score", {"lead_id": "a", "delta": 1000}, "c-range", "invalid_arguments", "toolguard"),
    ("add_score", {"lead_id": "a"}, "c-missing", "invalid_arguments", "toolguard"),
    ("add_score", {"lead_id": {"$ne": None}, "delta": 1}, "c-object", "invalid_arguments",
     "toolguard"),
    ("add_score", {"lead_id": "a", "delta": 1.5}, "c-float", "invalid_arguments", "toolguard"),
    ("drop_tables", {"confirm": True}, "c-unknown", "unknown_tool", "toolnode"),
]


@pytest.mark.parametrize("mode", MODES)
def test_refused_calls_come_back_as_error_messages_and_change_nothing(harness, mode: str) -> None:
    h: Harness = harness(LEAD_POLICY)
    tools = LeadTools()
    ok = ("add_score", {"lead_id": "a", "delta": 5}, "c-ok")
    app = guarded_graph(h, tools, calls_message(ok, *[c[:3] for c in REJECTED_CALLS]))

    out = invoke(h, app, mode, {"messages": [HumanMessage("go")]})

    assert out["messages"][-1].content == "done"  # the graph went on to the model's next turn
    answers = tool_messages(out["messages"])
    assert answers["c-ok"].status == "success" and answers["c-ok"].content == "a=5"
    for name, _, call_id, reason, wording in REJECTED_CALLS:
        message = answers[call_id]
        assert message.status == "error", call_id
        assert message.name == name
        if wording == "toolguard":
            assert f"rejected by toolguard ({reason})" in message.content, (call_id, message.content)
        else:
            assert message.content.startswith("Error"), (call_id, message.content)
            assert "toolguard" not in message.content, (call_id, message.content)
        assert message.response_metadata["toolguard"]["reason"] == reason
        assert h.decisions(call_id) == [("rejected", reason)]
    assert h.scores() == {"a": 5}
    assert [(row[0], row[3]) for row in h.effects()] == [("add_score", "c-ok")]
    assert tools.probe.runs == {"a": 1}


@pytest.mark.parametrize("mode", MODES)
def test_agent_identity_comes_from_run_metadata(harness, mode: str) -> None:
    """With ``agent_from="metadata"``, the run's ``toolguard_agent`` metadata is the identity."""
    h: Harness = harness(LEAD_POLICY)
    tools = LeadTools()
    calls = GuardedToolCalls(h.guard, agent_from="metadata")
    turn = calls_message(("add_score", {"lead_id": "a", "delta": 1}, "c1"),
                         ("reassign_lead", {"lead_id": "a", "owner": "bob"}, "c2"))
    app = tool_graph(scripted(turn, AIMessage(content="done")), tools.tools(),
                     wrap=calls.wrap_tool_call, awrap=calls.awrap_tool_call)

    out = invoke(h, app, mode, {"messages": [HumanMessage("go")]},
                 {"metadata": {"toolguard_agent": "router"}})

    answers = tool_messages(out["messages"])
    assert answers["c1"].response_metadata["toolguard"]["reason"] == "not_authorized"
    assert answers["c2"].status == "success"
    assert [e.agent for e in h.audit(intent_id="c2")] == ["router"]
