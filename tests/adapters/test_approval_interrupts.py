"""A tool behind a toolguard approval that asks a question of its own gets its own answer.

LangGraph hands a task's resume values out by the order of its ``interrupt()``
calls, and re-runs the task from its top on every resume. toolguard's approval
step asks (interrupts) only while the request is undecided; on the re-run after
the tool's own interrupt it must still take back the answer it read, or the
tool's ``interrupt()`` receives the person's approval instead of the answer to
its question (and a payment goes out with the approval as its note).
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, interrupt

from adapters.conftest import MODES, ai, answers, one_node, run, tool_call
from adapters.test_langgraph_features import node


@tool
def pay(amount: int) -> str:
    """Pay an amount; asks which note to put on the payment."""
    note = interrupt("which note?")
    return f"paid {amount}, note {note!r}"


POLICY: dict[str, Any] = {"version": 1, "defaults": {"agents": ["*"]}, "tools": {
    "pay": {"locks": ["payment:{amount}"],
            "approval": {"when": {"amount": {"gt": 10}}, "expires": "10m"}}}}


def resume(by_id: bool, pending: Any, value: Any) -> Command:
    return Command(resume={pending.id: value} if by_id else value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("by_id", [True, False], ids=["resume-by-id", "resume-value"])
def test_the_tools_own_interrupt_gets_its_own_answer_after_an_approval(guarded, mode: str,
                                                                       by_id: bool) -> None:
    g = guarded(POLICY)
    app = one_node(node(g.guard, [pay]), checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}}

    (approval,) = run(app, mode, ai(tool_call("pay", {"amount": 50})), config)["__interrupt__"]
    assert approval.value["type"] == "toolguard_approval"
    (question,) = run(app, mode, resume(by_id, approval, {"type": "approve", "by": "ana"}),
                      config)["__interrupt__"]
    assert question.value == "which note?"
    out = run(app, mode, resume(by_id, question, "rent"), config)

    assert answers(out)["c1"].content == "paid 50, note 'rent'"
    assert [d for d, _ in g.decisions("c1")] == ["rejected", "unknown", "accepted"]
    assert app.get_state(config).interrupts == ()


@tool
def transfer(amount: int) -> str:
    """Transfer an amount; asks for a reference, then for a confirmation."""
    reference = interrupt("reference?")
    confirmed = interrupt(f"send {amount} with reference {reference}?")
    return f"sent {amount} ref={reference} confirmed={confirmed}"


@pytest.mark.parametrize("mode", MODES)
def test_each_of_the_tools_interrupts_gets_its_answer_after_an_approval(guarded, mode: str) -> None:
    g = guarded({"version": 1, "defaults": {"agents": ["*"]}, "tools": {
        "transfer": {"locks": ["transfer:{amount}"],
                     "approval": {"when": {"amount": {"gt": 10}}, "expires": "10m"}}}})
    app = one_node(node(g.guard, [transfer]), checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}}

    (approval,) = run(app, mode, ai(tool_call("transfer", {"amount": 70})), config)["__interrupt__"]
    (reference,) = run(app, mode, resume(True, approval, "approve"), config)["__interrupt__"]
    (confirm,) = run(app, mode, resume(True, reference, "INV-9"), config)["__interrupt__"]
    assert confirm.value == "send 70 with reference INV-9?"
    out = run(app, mode, resume(True, confirm, "yes"), config)

    assert answers(out)["c1"].content == "sent 70 ref=INV-9 confirmed=yes"


@pytest.mark.parametrize("mode", MODES)
def test_an_approval_given_in_another_thread_leaves_the_tools_answers_alone(guarded,
                                                                           mode: str) -> None:
    """A business key finds the request another thread asked and a person approved there."""
    g = guarded({"version": 1, "defaults": {"agents": ["*"]}, "tools": {
        "pay": {"locks": ["payment:{amount}"], "idempotency_key": "pay:{amount}",
                "approval": {"when": {"amount": {"gt": 10}}, "expires": "10m"}}}})
    app = one_node(node(g.guard, [pay]), checkpointer=InMemorySaver())
    first, second = ({"configurable": {"thread_id": t}} for t in ("t1", "t2"))
    (approval,) = run(app, mode, ai(tool_call("pay", {"amount": 50}, "p1")), first)["__interrupt__"]
    run(app, mode, resume(True, approval, "approve"), first)  # then it asks its question there

    (question,) = run(app, mode, ai(tool_call("pay", {"amount": 50}, "p2")), second)["__interrupt__"]
    assert question.value == "which note?"  # approved already: only the tool asks
    out = run(app, mode, resume(True, question, "rent"), second)

    assert answers(out)["p2"].content == "paid 50, note 'rent'"
    assert [d for d, _ in g.decisions("p2")] == ["unknown", "accepted"]
