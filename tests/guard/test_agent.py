"""``create_agent(model, tools, middleware=[ToolGuardMiddleware(guard)])`` with a fake model.

``create_agent`` sends each tool call as its own task (``Send("tools", [call])``),
so parallel calls are parallel tasks of one superstep: threads on ``invoke``,
asyncio tasks on ``ainvoke``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage

from guard.harness import Harness
from guard.tools import LEAD_POLICY, LeadTools, calls_message, scripted, tool_messages
from toolguard.adapters import ToolGuardMiddleware


def run_agent(h: Harness, agent: Any, mode: str, inputs: Any,
              config: dict[str, Any] | None = None) -> dict[str, Any]:
    if mode == "sync":
        return agent.invoke(inputs, config)

    async def main() -> dict[str, Any]:
        async with h.async_edges():
            return await agent.ainvoke(inputs, config)

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_create_agent_middleware_serializes_and_refuses(harness, mode: str) -> None:
    h: Harness = harness(LEAD_POLICY)
    tools = LeadTools(pause_s=0.005)
    on_a = [("add_score", {"lead_id": "a", "delta": d}, f"a{d}") for d in range(1, 6)]
    refused = [("add_score", {"lead_id": "a", "delta": "9"}, "c-type"),
               ("reassign_lead", {"lead_id": "a", "owner": "x"}, "c-denied"),
               ("shell", {"cmd": "rm -rf /"}, "c-unknown")]
    model = scripted(calls_message(*on_a, *refused), AIMessage(content="done"))
    agent = create_agent(model, tools.tools(),
                         middleware=[ToolGuardMiddleware(h.guard, agent="scorer")])

    out = run_agent(h, agent, mode, {"messages": [HumanMessage("score lead a")]})

    assert out["messages"][-1].content == "done"
    answers = tool_messages(out["messages"])
    assert all(answers[cid].status == "success" for _, _, cid in on_a)
    reasons = {cid: answers[cid].response_metadata["toolguard"]["reason"] for _, _, cid in refused}
    assert reasons == {"c-type": "invalid_arguments", "c-denied": "not_authorized",
                       "c-unknown": "unknown_tool"}
    assert all(answers[cid].status == "error" for _, _, cid in refused)
    assert tools.probe.peak["a"] == 1
    assert h.scores() == {"a": 15}
    assert len(h.effects()) == 5
    for _, _, cid in refused:
        assert [d for d, _ in h.decisions(cid)] == ["rejected"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_create_agent_identity_from_metadata(harness, mode: str) -> None:
    """With ``agent_from="metadata"``, the identity is the run's ``toolguard_agent`` metadata."""
    h: Harness = harness(LEAD_POLICY)
    tools = LeadTools()
    model = scripted(calls_message(("reassign_lead", {"lead_id": "a", "owner": "bo"}, "c1")),
                     AIMessage(content="done"))
    agent = create_agent(model, tools.tools(),
                         middleware=[ToolGuardMiddleware(h.guard, agent_from="metadata")])

    out = run_agent(h, agent, mode, {"messages": [HumanMessage("route")]},
                    {"metadata": {"toolguard_agent": "router"}})

    assert tool_messages(out["messages"])["c1"].status == "success"
    assert [(e.agent, e.decision) for e in h.audit(intent_id="c1")] == [("router", "accepted")]
