"""A replay of a tool's own ToolMessage keeps what the tool put on it, not only its text.

A tool may answer with a ToolMessage of its own: an id, ``additional_kwargs``,
``response_metadata``, a name of its choosing. When LangGraph re-runs the node
(a resume), the plain graph gets that message again; the replay must give the
same message. The id stays only for the call the record answered: a new call
replaying the record under a business key must not take the place of the
earlier call's answer in the state (messages with one id replace each other).
"""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import ToolNode
from langgraph.types import Command, interrupt

from adapters.conftest import MODES, ai, answers, one_node, run, tool_call
from toolguard.adapters import GuardedToolCalls

RUNS: dict[str, int] = {}


@tool
def label(lead_id: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> ToolMessage:
    """Label a lead; the answer carries the tool's own id and metadata."""
    RUNS["label"] = RUNS.get("label", 0) + 1
    return ToolMessage(f"labelled {lead_id}", tool_call_id=tool_call_id, id=f"label-{lead_id}",
                       name="labeller", additional_kwargs={"lead": lead_id},
                       response_metadata={"source": "crm"}, artifact={"lead": lead_id})


@tool
def confirm(question: str) -> str:
    """Ask a person."""
    return f"answer: {interrupt(question)}"


POLICY = {"version": 1, "defaults": {"agents": ["*"]}, "tools": {
    "label": {"locks": ["lead:{lead_id}"], "idempotency_key": "label:{lead_id}"},
    "confirm": {"read_only": True}}}


def node(guard: Any | None) -> ToolNode:
    if guard is None:
        return ToolNode([label, confirm])
    calls = GuardedToolCalls(guard, agent="tester")
    return ToolNode([label, confirm], wrap_tool_call=calls.wrap_tool_call,
                    awrap_tool_call=calls.awrap_tool_call)


def own(message: ToolMessage) -> dict[str, Any]:
    fields = message.model_dump()
    fields["response_metadata"] = {k: v for k, v in fields["response_metadata"].items()
                                   if k != "toolguard"}
    return fields


def test_a_resumed_node_replays_the_tools_own_message_whole(guarded) -> None:
    """Sync: the sibling completes before the interrupt ends the node, so its record exists."""
    g = guarded(POLICY)
    inputs = ai(tool_call("label", {"lead_id": "L-1"}, "l1"),
                tool_call("confirm", {"question": "go?"}, "q1"))
    outs = []
    for guard in (None, g.guard):
        RUNS.clear()
        app = one_node(node(guard), checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": "t1"}}
        run(app, "sync", inputs, config)
        outs.append((answers(run(app, "sync", Command(resume="yes"), config)), dict(RUNS)))
    (plain, plain_runs), (mine, runs) = outs

    assert (plain_runs, runs) == ({"label": 2}, {"label": 1})
    assert own(mine["l1"]) == own(plain["l1"])
    assert mine["l1"].id == "label-L-1" and mine["l1"].additional_kwargs == {"lead": "L-1"}
    assert g.decisions("l1") == [("accepted", "applied"), ("replayed", "duplicate")]


@pytest.mark.parametrize("mode", MODES)
def test_a_new_call_replaying_the_record_does_not_take_the_earlier_answers_place(guarded,
                                                                                mode: str) -> None:
    g = guarded(POLICY)
    app = one_node(node(g.guard), checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}}
    run(app, mode, ai(tool_call("label", {"lead_id": "L-2"}, "l1")), config)
    out = run(app, mode, ai(tool_call("label", {"lead_id": "L-2"}, "l2")), config)

    both = answers(out)
    assert set(both) == {"l1", "l2"}  # the first answer is still in the state
    assert both["l1"].id == "label-L-2" and both["l2"].id != "label-L-2"
    replayed = own(both["l2"])
    first = own(both["l1"])
    assert {k: v for k, v in replayed.items() if k not in ("id", "tool_call_id")} == {
        k: v for k, v in first.items() if k not in ("id", "tool_call_id")}
    assert g.decisions("l2") == [("replayed", "duplicate")]


@tool
def note(lead_id: str, text: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> ToolMessage:
    """Note a text on a lead."""
    return ToolMessage(f"noted on {lead_id}", tool_call_id=tool_call_id, id=f"note-{lead_id}",
                       additional_kwargs={"text": text})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", ["ana@example.com", "name", "additional_kwargs", "call_id"])
def test_a_redacted_value_stays_out_of_the_replayed_message(guarded, mode: str, text: str) -> None:
    """Masking a value masks every equal text of the record, its field names too."""
    g = guarded({"version": 1, "defaults": {"agents": ["*"]}, "tools": {
        "note": {"locks": ["lead:{lead_id}"], "redact": ["text"], "idempotency_key": "note:{lead_id}"}}})
    calls = GuardedToolCalls(g.guard, agent="tester")
    app = one_node(ToolNode([note], wrap_tool_call=calls.wrap_tool_call,
                            awrap_tool_call=calls.awrap_tool_call), checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}}
    args = {"lead_id": "L-3", "text": text}
    first = answers(run(app, mode, ai(tool_call("note", args, "n1")), config))["n1"]
    replayed = answers(run(app, mode, ai(tool_call("note", args, "n2")), config))["n2"]

    assert first.additional_kwargs == {"text": text}  # the first answer, in clear
    assert (replayed.content, replayed.tool_call_id, replayed.status) == ("noted on L-3", "n2",
                                                                          "success")
    assert text not in str(replayed.additional_kwargs)
    assert g.decisions("n2") == [("replayed", "duplicate")]
