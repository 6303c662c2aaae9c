"""Identity fails closed: the agent comes from the host, never from a node name or the model.

A ToolNode is a graph node called ``tools``; authorizing its calls as an agent
named ``tools`` (what the node-name fallback did) grants them to an agent that
does not exist. Without ``agent=`` and without the run's ``toolguard_agent``
metadata every call is refused as ``missing_identity``, audited, on every
adapter, sync and async; a ``"*"`` in the policy does not change that. (An adapter
built with no identity source at all raises when built: tests/adapters/test_wiring_checks.py;
these read the identity from run metadata, and the run has none.)
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage

from guard.harness import Harness, HarnessFactory, invoke_graph
from guard.tools import LeadTools, calls_message, scripted, tool_graph, tool_messages
from toolguard.adapters import GuardedToolCalls, ToolGuardMiddleware, guard_tool, guarded

#: The node-name fallback would have authorized ``add_score`` as agent "tools".
POLICY: dict[str, Any] = {"version": 1, "tools": {
    "add_score": {"locks": ["lead:{lead_id}"], "agents": ["tools"]},
    "reassign_lead": {"locks": ["lead:{lead_id}"], "agents": ["*"]},
}}
CALLS: list[tuple[str, dict[str, Any], str]] = [("add_score", {"lead_id": "a", "delta": 1}, "c-node-name"),
         ("reassign_lead", {"lead_id": "a", "owner": "bo"}, "c-anyone")]




def assert_refused_without_identity(h: Harness, out: dict[str, Any], tools: LeadTools) -> None:
    answers = tool_messages(out["messages"])
    for _, _, call_id in CALLS:
        assert answers[call_id].status == "error", answers[call_id]
        assert answers[call_id].response_metadata["toolguard"]["reason"] == "missing_identity"
        assert [(e.decision, e.reason, e.agent) for e in h.audit(intent_id=call_id)] == [
            ("rejected", "missing_identity", None)]
    assert tools.probe.runs == {} and h.scores() == {}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tool_node_without_identity_is_refused_not_authorized_as_its_node(harness: HarnessFactory,
                                                                          mode: str) -> None:
    h: Harness = harness(POLICY)
    tools = LeadTools()
    calls = GuardedToolCalls(h.guard, agent_from="metadata")  # and the run has no metadata
    app = tool_graph(scripted(calls_message(*CALLS), AIMessage(content="done")), tools.tools(),
                     wrap=calls.wrap_tool_call, awrap=calls.awrap_tool_call)

    out = invoke_graph(h, app, mode, {"messages": [HumanMessage("go")]})

    assert_refused_without_identity(h, out, tools)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_create_agent_middleware_without_identity_is_refused(harness: HarnessFactory, mode: str) -> None:
    h: Harness = harness(POLICY)
    tools = LeadTools()
    agent = create_agent(scripted(calls_message(*CALLS), AIMessage(content="done")),
                         tools.tools(), middleware=[ToolGuardMiddleware(h.guard, agent_from="metadata")])

    out = invoke_graph(h, agent, mode, {"messages": [HumanMessage("go")]})

    assert_refused_without_identity(h, out, tools)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_guarded_langchain_tools_without_identity_are_refused(harness: HarnessFactory, mode: str) -> None:
    h: Harness = harness(POLICY)
    tools = LeadTools()
    guarded_tools = [guard_tool(h.guard, tool, agent_from="metadata") for tool in tools.tools()]
    app = tool_graph(scripted(calls_message(*CALLS), AIMessage(content="done")), guarded_tools)

    out = invoke_graph(h, app, mode, {"messages": [HumanMessage("go")]})

    assert_refused_without_identity(h, out, tools)


def test_identity_metadata_is_checked_not_coerced(harness: HarnessFactory) -> None:
    """``toolguard_agent: 7`` is not the agent ``"7"``; an empty name is no name."""
    h: Harness = harness({"version": 1, "tools": {
        "add_score": {"locks": ["lead:{lead_id}"], "agents": ["7", "scorer"]}}})
    tools = LeadTools()
    calls = GuardedToolCalls(h.guard, agent_from="metadata")
    turn = calls_message(("add_score", {"lead_id": "a", "delta": 1}, "c1"))

    for agent in (7, "", ["scorer"]):
        app = tool_graph(scripted(turn, AIMessage(content="done")), tools.tools(),
                         wrap=calls.wrap_tool_call)
        out = app.invoke({"messages": [HumanMessage("go")]},
                         {"metadata": {"toolguard_agent": agent}})
        answer = tool_messages(out["messages"])["c1"]
        assert answer.response_metadata["toolguard"]["reason"] == "invalid_intent", agent
    assert [e.reason for e in h.audit()] == ["invalid_intent"] * 3
    assert h.scores() == {}

    app = tool_graph(scripted(turn, AIMessage(content="done")), tools.tools(),
                     wrap=calls.wrap_tool_call)
    out = app.invoke({"messages": [HumanMessage("go")]}, {"metadata": {"toolguard_agent": "scorer"}})
    assert tool_messages(out["messages"])["c1"].status == "success"
    assert h.audit()[-1].agent == "scorer"


def test_a_guarded_function_without_an_agent_is_refused(harness: HarnessFactory) -> None:
    h: Harness = harness(POLICY)

    @guarded(h.guard, name="reassign_lead", agent_from="call")
    def reassign(lead_id: str, owner: str) -> str:
        return "done"

    decision = reassign.run({"lead_id": "a", "owner": "bo"})
    assert (decision.kind, decision.reason) == ("rejected", "missing_identity")
    assert reassign.run({"lead_id": "a", "owner": "bo"}, agent="router").ok
    assert [e.reason for e in h.audit()] == ["missing_identity", "applied"]
