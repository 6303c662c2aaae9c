"""Replay scope: a tool-call id is unique per thread and agent/node path, not per superstep.

LangGraph's checkpoint namespace carries a task id that changes every
superstep (``tools:<task id>``), so keying on it let the same call id re-sent
later in the thread (a model re-emitting a call, a long call re-dispatched) run
again, and the same id with other arguments be accepted. The default key is
now thread + node path (the namespace without task ids) + call id: such a
re-send is replayed (same arguments) or refused (``idempotency_conflict``),
while two agents or subgraphs that reuse ids (scripted models do) stay apart.
``idempotency_scope: task`` narrows it back to one task.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph

from guard.harness import Harness, HarnessFactory, invoke_graph
from guard.tools import LEAD_POLICY, LeadTools, calls_message, scripted, tool_graph
from toolguard.adapters import GuardedToolCalls

MODES = ("sync", "async")




def thread() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"t-{uuid.uuid4().hex}"}}


def answers_for(out: dict[str, Any], call_id: str) -> list[ToolMessage]:
    return [m for m in out["messages"] if isinstance(m, ToolMessage) and m.tool_call_id == call_id]


def two_turns(h: Harness, tools: LeadTools, first: dict[str, Any], second: dict[str, Any]) -> Any:
    """A model that sends call ``c1`` in one turn and again, with ``second``, in the next."""
    calls = GuardedToolCalls(h.guard, agent="scorer")
    model = scripted(calls_message(("add_score", first, "c1")),
                     calls_message(("add_score", second, "c1")), AIMessage(content="done"))
    return tool_graph(model, tools.tools(), wrap=calls.wrap_tool_call,
                      awrap=calls.awrap_tool_call, checkpointer=InMemorySaver())


@pytest.mark.parametrize("mode", MODES)
def test_a_call_id_re_sent_in_a_later_superstep_is_replayed(harness: HarnessFactory, mode: str) -> None:
    h: Harness = harness(LEAD_POLICY)
    tools = LeadTools()
    args = {"lead_id": "a", "delta": 5}

    out = invoke_graph(h, two_turns(h, tools, args, args), mode, {"messages": [HumanMessage("go")]},
              thread())

    assert [m.content for m in answers_for(out, "c1")] == ["a=5", "a=5"]  # the same answer
    assert tools.probe.runs == {"a": 1} and h.scores() == {"a": 5}
    assert h.decisions("c1") == [("accepted", "applied"), ("replayed", "duplicate")]


@pytest.mark.parametrize("mode", MODES)
def test_the_same_call_id_with_other_arguments_is_refused(harness: HarnessFactory, mode: str) -> None:
    h: Harness = harness(LEAD_POLICY)
    tools = LeadTools()

    out = invoke_graph(h, two_turns(h, tools, {"lead_id": "a", "delta": 5}, {"lead_id": "a", "delta": 50}),
              mode, {"messages": [HumanMessage("go")]}, thread())

    first, second = answers_for(out, "c1")
    assert first.status == "success" and second.status == "error"
    assert second.response_metadata["toolguard"]["reason"] == "idempotency_conflict"
    assert h.scores() == {"a": 5}
    assert h.decisions("c1") == [("accepted", "applied"), ("rejected", "idempotency_conflict")]


@pytest.mark.parametrize("mode", MODES)
def test_two_agents_reusing_call_ids_stay_apart(harness: HarnessFactory, mode: str) -> None:
    """Two subgraph agents in one thread, each with a scripted model that says ``c1``."""
    h: Harness = harness(LEAD_POLICY)
    tools = LeadTools()
    calls = GuardedToolCalls(h.guard, agent="scorer")

    def agent(delta: int) -> Any:
        model = scripted(calls_message(("add_score", {"lead_id": "a", "delta": delta}, "c1")),
                         AIMessage(content="done"))
        return tool_graph(model, tools.tools(), wrap=calls.wrap_tool_call,
                          awrap=calls.awrap_tool_call)

    graph = StateGraph(MessagesState)
    graph.add_node("scorer_one", agent(1))
    graph.add_node("scorer_two", agent(10))
    graph.add_edge(START, "scorer_one")
    graph.add_edge("scorer_one", "scorer_two")
    graph.add_edge("scorer_two", END)
    app = graph.compile(checkpointer=InMemorySaver())

    invoke_graph(h, app, mode, {"messages": [HumanMessage("go")]}, thread())

    assert h.scores() == {"a": 11} and tools.probe.runs == {"a": 2}
    entries = h.audit(intent_id="c1")
    assert [(e.decision, e.reason) for e in entries] == [("accepted", "applied")] * 2
    keys = [e.idempotency_key or "" for e in entries]
    assert "scorer_one%7Ctools" in keys[0] and "scorer_two%7Ctools" in keys[1]


@pytest.mark.parametrize("mode", MODES)
def test_task_scope_lets_a_re_sent_id_run_again(harness: HarnessFactory, mode: str) -> None:
    """``idempotency_scope: task`` is for frameworks that reuse call ids within a thread."""
    policy = {**LEAD_POLICY, "defaults": {"idempotency_scope": "task"}}
    h: Harness = harness(policy)
    tools = LeadTools()
    args = {"lead_id": "a", "delta": 5}

    invoke_graph(h, two_turns(h, tools, args, args), mode, {"messages": [HumanMessage("go")]}, thread())

    assert tools.probe.runs == {"a": 2} and h.scores() == {"a": 10}
    assert h.decisions("c1") == [("accepted", "applied")] * 2
