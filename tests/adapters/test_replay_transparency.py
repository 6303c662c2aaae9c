"""A replayed call answers as the tool answered the first time: artifact, state update, goto.

LangGraph re-runs a ToolNode's calls when it resumes an interrupt or retries a
node; toolguard then answers the calls that already applied from their
records instead of running them again. What the graph does next must not
change: the plain graph re-runs the tool and gets its whole answer again, so a
replay must rebuild that whole answer (a ``Command``'s update and ``goto``, a
message's artifact), under the id of the call it answers.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any

import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Command, Send, interrupt

from adapters.conftest import MODES, ai, answers, run, tool_call
from toolguard.adapters import GuardedToolCalls


class Flow(MessagesState):
    stage: str
    seen: Annotated[list[str], operator.add]


RUNS: dict[str, int] = {}


@tool(response_format="content_and_artifact")
def fetch_rows(table: str) -> tuple[str, dict[str, Any]]:
    """Read rows; the model gets a summary, the graph the rows."""
    RUNS["fetch_rows"] = RUNS.get("fetch_rows", 0) + 1
    return f"3 rows from {table}", {"rows": [1, 2, 3], "table": table}


@tool
def advance(lead_id: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
    """Move a lead on: a state update and where the graph goes next."""
    RUNS["advance"] = RUNS.get("advance", 0) + 1
    return Command(update={"messages": [ToolMessage(f"{lead_id} advanced", tool_call_id=tool_call_id,
                                                    artifact={"lead": lead_id})],
                           "stage": f"qualified:{lead_id}", "seen": [lead_id]},
                   goto=["notify", Send("audit_trail", {"lead": lead_id})])


@tool
def confirm(question: str) -> str:
    """Ask a person."""
    return f"answer: {interrupt(question)}"


def flow(tools_node: ToolNode) -> Any:
    graph = StateGraph(Flow)
    graph.add_node("tools", tools_node, destinations=("notify", "audit_trail"))
    graph.add_node("notify", lambda _s: {"messages": [AIMessage(content="notified")]})
    graph.add_node("audit_trail", lambda arg: {"seen": [f"trail:{arg['lead']}"]})
    graph.add_edge(START, "tools")
    return graph.compile(checkpointer=InMemorySaver())


def node(guard: Any | None) -> ToolNode:
    tools = [fetch_rows, advance, confirm]
    if guard is None:
        return ToolNode(tools)
    calls = GuardedToolCalls(guard, agent="tester")
    return ToolNode(tools, wrap_tool_call=calls.wrap_tool_call, awrap_tool_call=calls.awrap_tool_call)


POLICY = {"version": 1, "defaults": {"agents": ["*"]}, "tools": {
    "fetch_rows": {"locks": ["table:{table}"], "idempotency_key": "rows:{table}"},
    "advance": {"locks": ["lead:{lead_id}"]},
    "confirm": {"read_only": True}}}


def seen(message: ToolMessage) -> tuple[Any, ...]:
    return (message.content, message.artifact, message.status, message.name, message.tool_call_id)


def test_a_resumed_node_replays_the_siblings_whole_answers(guarded) -> None:
    """Sync: ToolNode runs the siblings to completion before the interrupt ends the node.

    (On the async path LangGraph cancels the siblings still waiting when one
    interrupts; they never applied, so resuming runs them: nothing to replay.)
    """
    g = guarded(POLICY)
    inputs = ai(tool_call("fetch_rows", {"table": "leads"}, "f1"),
                tool_call("advance", {"lead_id": "L-1"}, "a1"),
                tool_call("confirm", {"question": "go?"}, "q1"))
    outs = []
    for guard in (None, g.guard):
        RUNS.clear()
        app = flow(node(guard))
        config = {"configurable": {"thread_id": f"t-{guard is None}"}}
        run(app, "sync", inputs, config)
        outs.append((run(app, "sync", Command(resume="yes"), config), dict(RUNS)))
    (plain, plain_runs), (out, runs) = outs

    assert plain_runs == {"fetch_rows": 2, "advance": 2}  # LangGraph re-runs the siblings
    assert runs == {"fetch_rows": 1, "advance": 1}  # toolguard answers them from their records
    assert (out["stage"], out["seen"]) == (plain["stage"], plain["seen"]) == (
        "qualified:L-1", ["L-1", "trail:L-1"])
    assert said(out) == said(plain)  # the goto was followed: notify ran
    mine, theirs = answers(out), answers(plain)
    assert {k: seen(m) for k, m in mine.items()} == {k: seen(m) for k, m in theirs.items()}
    assert mine["a1"].artifact == {"lead": "L-1"} and mine["f1"].artifact["rows"] == [1, 2, 3]
    assert g.decisions("f1") == [("accepted", "applied"), ("replayed", "duplicate")]
    assert g.decisions("a1") == [("accepted", "applied"), ("replayed", "duplicate")]


def said(out: dict[str, Any]) -> list[Any]:
    return [m.content for m in out["messages"] if isinstance(m, AIMessage)]


@pytest.mark.parametrize("mode", MODES)
def test_calls_sent_again_replay_under_the_id_of_the_call_in_hand(guarded, mode: str) -> None:
    """The same call id again (the default key) and a new id under a business key both replay."""
    g = guarded(POLICY)
    first = ai(tool_call("fetch_rows", {"table": "leads"}, "f1"),
               tool_call("advance", {"lead_id": "L-1"}, "a1"))
    second = ai(tool_call("fetch_rows", {"table": "leads"}, "f2"),
                tool_call("advance", {"lead_id": "L-1"}, "a1"))
    outs = []
    for guard in (None, g.guard):
        RUNS.clear()
        app = flow(node(guard))
        config = {"configurable": {"thread_id": "t1"}}
        run(app, mode, first, config)
        outs.append((run(app, mode, second, config), dict(RUNS)))
    (plain, plain_runs), (out, runs) = outs

    assert plain_runs == {"fetch_rows": 2, "advance": 2} and runs == {"fetch_rows": 1, "advance": 1}
    assert (out["stage"], out["seen"], said(out)) == (plain["stage"], plain["seen"], said(plain))
    mine, theirs = answers(out), answers(plain)
    assert {k: seen(m) for k, m in mine.items()} == {k: seen(m) for k, m in theirs.items()}
    assert mine["f2"].tool_call_id == "f2" and mine["f2"].artifact["rows"] == [1, 2, 3]
    assert g.decisions("f2") == [("replayed", "duplicate")]
    assert g.decisions("a1") == [("accepted", "applied"), ("replayed", "duplicate")]


@tool
def tag_contact(contact_id: str, email: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
    """Tag a contact by e-mail address."""
    return Command(update={"messages": [ToolMessage(f"tagged {email}", tool_call_id=tool_call_id,
                                                    artifact={"email": email})],
                           "stage": f"tagged {email}"})


def tagging(guard: Any) -> Any:
    """A checkpointed graph whose one guarded ToolNode holds ``tag_contact``."""
    graph = StateGraph(Flow)
    calls = GuardedToolCalls(guard, agent="tester")
    graph.add_node("tools", ToolNode([tag_contact], wrap_tool_call=calls.wrap_tool_call,
                                     awrap_tool_call=calls.awrap_tool_call))
    graph.add_edge(START, "tools")
    return graph.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("mode", MODES)
def test_a_replayed_update_holds_no_redacted_value(guarded, mode: str) -> None:
    g = guarded({"version": 1, "defaults": {"agents": ["*"]}, "tools": {
        "tag_contact": {"locks": ["contact:{contact_id}"], "redact": ["email"],
                        "idempotency_key": "tag:{contact_id}"}}})
    app = tagging(g.guard)
    config = {"configurable": {"thread_id": "t1"}}
    args = {"contact_id": "C-1", "email": "ana@example.com"}
    first = run(app, mode, ai(tool_call("tag_contact", args, "c1")), config)
    again = run(app, mode, ai(tool_call("tag_contact", args, "c2")), config)

    assert first["stage"] == "tagged ana@example.com"  # the first answer, in clear
    replayed = answers(again)["c2"]
    assert "ana@example.com" not in str(replayed.content) + str(replayed.artifact) + again["stage"]
    assert again["stage"] == "tagged [redacted]"
    assert g.decisions("c2") == [("replayed", "duplicate")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("email", ["tool", "content", "messages", "type", "data"])
def test_a_redacted_value_that_names_a_part_of_the_record_still_replays(guarded, mode: str,
                                                                         email: str) -> None:
    """Masking a value masks every equal text of the record, its field names too."""
    g = guarded({"version": 1, "defaults": {"agents": ["*"]}, "tools": {
        "tag_contact": {"locks": ["contact:{contact_id}"], "redact": ["email"],
                        "idempotency_key": "tag:{contact_id}"}}})
    app = tagging(g.guard)
    config = {"configurable": {"thread_id": "t1"}}
    args = {"contact_id": "C-1", "email": email}
    run(app, mode, ai(tool_call("tag_contact", args, "c1")), config)
    again = run(app, mode, ai(tool_call("tag_contact", args, "c2")), config)

    replayed = answers(again)["c2"]
    assert (replayed.tool_call_id, replayed.status) == ("c2", "success")
    assert g.decisions("c2") == [("replayed", "duplicate")]
