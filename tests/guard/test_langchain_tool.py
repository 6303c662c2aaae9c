"""``guard_tool(guard, tool)``: a LangChain tool that only runs through the guard.

Used as-is in a plain ``ToolNode`` (no wrapper): it answers a tool call with a
``ToolMessage`` (an error one naming the reason when refused), and plain Python
input with the output or a ``ToolException``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import ToolException
from langgraph.types import RetryPolicy

from guard.harness import Harness
from guard.tools import LEAD_POLICY, LeadTools, calls_message, scripted, tool_graph, tool_messages
from toolguard.adapters import guard_tool


class Flaky(ConnectionError):
    pass


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_guarded_langchain_tools_in_a_plain_tool_node(harness, mode: str) -> None:
    h: Harness = harness(LEAD_POLICY)
    lead_tools = LeadTools(pause_s=0.005)
    tools = [guard_tool(h.guard, tool, agent="scorer") for tool in lead_tools.tools()]
    calls = [("add_score", {"lead_id": "a", "delta": d}, f"a{d}") for d in range(1, 5)]
    refused = [("add_score", {"lead_id": "a", "delta": 500}, "c-range"),
               ("reassign_lead", {"lead_id": "a", "owner": "z"}, "c-denied")]
    app = tool_graph(scripted(calls_message(*calls, *refused), AIMessage(content="done")), tools)
    inputs = {"messages": [HumanMessage("go")]}

    if mode == "sync":
        out = app.invoke(inputs)
    else:
        async def main() -> Any:
            async with h.async_edges():
                return await app.ainvoke(inputs)

        out = asyncio.run(main())

    answers = tool_messages(out["messages"])
    assert all(answers[cid].status == "success" for _, _, cid in calls)
    assert {cid: answers[cid].response_metadata["toolguard"]["reason"]
            for _, _, cid in refused} == {"c-range": "invalid_arguments",
                                           "c-denied": "not_authorized"}
    assert lead_tools.probe.peak["a"] == 1
    assert h.scores() == {"a": 10}


def test_plain_input_returns_the_output_or_raises_tool_exception(harness) -> None:
    h: Harness = harness(LEAD_POLICY)
    add_score, _ = [guard_tool(h.guard, tool, agent="scorer") for tool in LeadTools().tools()]

    assert add_score.invoke({"lead_id": "a", "delta": 2}) == "a=2"
    with pytest.raises(ToolException, match="invalid_arguments"):
        add_score.invoke({"lead_id": "a", "delta": "2"})
    assert h.scores() == {"a": 2}


def test_retry_policy_without_checkpointer_replays_the_guarded_tool(harness) -> None:
    """No thread, no run id: the step's checkpoint id keeps the call's identity across the
    node's re-run, so the effect that landed before the failure is not applied twice."""
    h: Harness = harness(LEAD_POLICY)
    lead_tools = LeadTools()
    add_score = guard_tool(h.guard, lead_tools.tools()[0], agent="scorer")
    failures = {"left": 1}

    def wrap(request: Any, execute: Any) -> Any:
        result = execute(request)
        if request.tool_call["id"] == "c1" and failures["left"]:
            failures["left"] -= 1
            raise Flaky("response lost after the tool ran")
        return result

    app = tool_graph(scripted(calls_message(("add_score", {"lead_id": "a", "delta": 3}, "c1")),
                              AIMessage(content="done")), [add_score], wrap=wrap,
                     retry_policy=RetryPolicy(max_attempts=2, initial_interval=0.01,
                                              jitter=False, retry_on=Flaky))

    out = app.invoke({"messages": [HumanMessage("go")]})

    assert tool_messages(out["messages"])["c1"].content == "a=3"
    assert h.scores() == {"a": 3}
    assert lead_tools.probe.runs == {"a": 1}
    assert [d for d, _ in h.decisions("c1")] == ["accepted", "replayed"]
