"""What a model reads about a real call, and what the operator reads about the same call.

Through a real compiled graph (ToolNode + ``GuardedToolCalls``) and plain
``@guarded`` callers: a paused tool, a call waiting for approval, a denied
one. The model's text is the pinned one for its reason (``test_model_texts``)
and names no operator, OS user, incident note or CLI command; the audit row
keeps all of that for the operator.
"""

from __future__ import annotations

from typing import Any

from guard.tools import calls_message, scripted, tool_graph, tool_messages
from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

from texts.conftest import GuardFactory
from texts.test_model_texts import PINNED
from toolguard.adapters import GuardedToolCalls, guarded
from toolguard.controls.approvals import ApprovalBook
from toolguard.controls.pause import PauseBoard

POLICY: dict[str, Any] = {
    "version": 1,
    "tools": {
        "transfer": {"locks": ["lead:{lead_id}"], "agents": ["payments"],
                     "approval": {"when": {"amount": {"gt": 1000}}, "expires": "10m",
                                  "reason": "large transfer"}},
    },
}
NOTE = "incident 42: call Dana on +1 555 0100"
FORBIDDEN = ("alice", "bob", "dana", "incident", "555", "toolguard approve", "toolguard deny",
             "toolguard resume", "ap_")


def text_of(reason: str) -> str:
    return PINNED[reason][1]


def clean(text: str) -> bool:
    lowered = text.lower()
    return not [word for word in FORBIDDEN if word in lowered]


def transfer_tool() -> StructuredTool:
    def transfer(lead_id: str, amount: int) -> str:
        """Move money."""
        return f"sent {amount}"

    return StructuredTool.from_function(func=transfer)


def graph_of(guard: Any, *calls: tuple[str, dict[str, Any], str]) -> Any:
    model = scripted(calls_message(*calls), AIMessage("done"), AIMessage("done"))
    wrapper = GuardedToolCalls(guard, agent="payments")
    return tool_graph(model, [transfer_tool()], wrap=wrapper.wrap_tool_call,
                      awrap=wrapper.awrap_tool_call, checkpointer=InMemorySaver())


def detail_of(guard: Any, call_id: str) -> str:
    (row,) = [r for r in guard.store.query_audit(intent_id=call_id, limit=None)
              if r.decision == "rejected"][-1:]
    return row.detail or ""


def test_a_paused_tool_tells_the_model_to_wait_and_the_operator_who_paused_it(
        make_guard: GuardFactory) -> None:
    guard = make_guard(POLICY)
    guard.pause_cache_s = 0
    PauseBoard(guard.store, cache_s=0).pause("tool", "transfer", by="alice", reason=NOTE)
    graph = graph_of(guard, ("transfer", {"lead_id": "l1", "amount": 5}, "call-1"))
    out = graph.invoke({"messages": [("user", "pay")]}, {"configurable": {"thread_id": "t1"}})
    message = tool_messages(out["messages"])["call-1"]
    assert message.status == "error"
    assert message.content == text_of("paused") and clean(str(message.content))
    detail = detail_of(guard, "call-1")
    assert "alice" in detail and NOTE in detail  # the operator's detail stays in the audit row


def test_a_call_waiting_for_approval_tells_the_model_to_wait_not_to_run_the_cli(
        make_guard: GuardFactory) -> None:
    guard = make_guard(POLICY)

    @guarded(guard, agent="payments")
    def transfer(lead_id: str, amount: int) -> str:
        return f"sent {amount}"

    waiting = transfer.run({"lead_id": "l1", "amount": 5000}, call_id="c1", thread_id="t1")
    assert (waiting.kind, waiting.reason) == ("rejected", "approval_required")
    assert waiting.model_text() == text_of("approval_required") and clean(waiting.model_text())
    assert f"toolguard approve {waiting.approval_id}" in waiting.message  # the operator's
    assert f"toolguard approve {waiting.approval_id}" in detail_of(guard, "c1")

    assert waiting.approval_id is not None
    ApprovalBook(guard.store).decide(waiting.approval_id, "reject", by="bob", note=NOTE)
    denied = transfer.run({"lead_id": "l1", "amount": 5000}, call_id="c1", thread_id="t1")
    assert (denied.kind, denied.reason) == ("rejected", "approval_denied")
    assert denied.model_text() == text_of("approval_denied") and clean(denied.model_text())
    assert "bob" in denied.message and NOTE in denied.message


def test_a_person_rejecting_in_a_graph_is_not_named_to_the_model(
        make_guard: GuardFactory) -> None:
    guard = make_guard(POLICY)
    graph = graph_of(guard, ("transfer", {"lead_id": "l1", "amount": 5000}, "call-1"))
    config = {"configurable": {"thread_id": "g1"}}
    out = graph.invoke({"messages": [("user", "pay")]}, config)
    assert out["__interrupt__"]
    out = graph.invoke(Command(resume={"type": "reject", "message": NOTE, "by": "bob"}), config)
    message = tool_messages(out["messages"])["call-1"]
    assert message.content == text_of("approval_denied") and clean(str(message.content))


def test_a_completed_and_a_replayed_call_say_so(make_guard: GuardFactory) -> None:
    """Issue 23.3: ``model_text()`` of a success read "not completed ... could not complete"."""
    guard = make_guard(POLICY)

    @guarded(guard, agent="payments")
    def transfer(lead_id: str, amount: int) -> str:
        return f"sent {amount}"

    first = transfer.run({"lead_id": "l1", "amount": 5}, call_id="c1", thread_id="t1")
    again = transfer.run({"lead_id": "l1", "amount": 5}, call_id="c1", thread_id="t1")
    assert (first.kind, again.kind) == ("accepted", "replayed")
    assert first.model_text() == text_of("applied")
    assert again.model_text() == text_of("duplicate")
