"""Approvals through a real LangGraph graph with a checkpointer: interrupt, resume, bind.

The node below does what the guard's LangGraph adapter is to do with the
building blocks: on ``ApprovalRequired`` it interrupts with the request, and
checks the resume value against the request it answers.
"""

from __future__ import annotations

import operator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from controls.calls import call, policy
from toolguard.controls.approvals import ApprovalBook, parse_resume
from toolguard.errors import ApprovalRequired, IntentRejected


class State(TypedDict):
    call: dict[str, Any]
    results: Annotated[list[str], operator.add]


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def build(store: Any, clock: Clock, effects: list[dict[str, Any]]) -> Any:
    rules = policy()
    book = ApprovalBook(store, clock=clock)

    def tools(state: State, config: RunnableConfig) -> dict[str, Any]:
        request = state["call"]
        thread = config["configurable"]["thread_id"]
        facts = call(rules, "transfer", request["args"], key=f"{thread}/{request['id']}")
        rule = rules.tools["transfer"]
        try:
            try:
                approved = book.check(rule, facts)
            except ApprovalRequired as asked:
                answer = interrupt(asked.request)  # the graph stops here until resumed
                approved = book.check(rule, facts,
                                      resume=parse_resume(answer, approval_id=asked.approval_id))
        except IntentRejected as refused:
            return {"results": [f"rejected ({refused.reason})"]}
        args = approved.args(facts.args) if approved else dict(facts.args)
        effects.append(args)
        return {"results": [f"sent {args['amount']}"]}

    graph = StateGraph(State)
    graph.add_node("tools", tools)
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    return graph.compile(checkpointer=InMemorySaver())


BIG = {"from_id": "a1", "to_id": "b2", "amount": 5000, "memo": "rent"}


def start(graph: Any, thread: str, args: dict[str, Any] = BIG) -> tuple[dict[str, Any], Any]:
    config = {"configurable": {"thread_id": thread}}
    out = graph.invoke({"call": {"id": "call-1", "args": args}, "results": []}, config)
    (pending,) = out["__interrupt__"]
    return config, pending.value


def test_interrupt_then_approve(store) -> None:
    effects: list[dict[str, Any]] = []
    graph = build(store, Clock(), effects)
    config, request = start(graph, "t-approve")
    assert request["type"] == "toolguard_approval" and request["args"]["memo"] == "[redacted]"
    assert effects == []  # nothing ran before a person decided
    out = graph.invoke(Command(resume={"type": "approve", "by": "alice"}), config)
    assert out["results"] == ["sent 5000"] and effects == [BIG]
    (row,) = store.query_audit(decision="operator")
    assert (row.reason, row.args["by"], row.args["approval_id"]) == ("approved", "alice",
                                                                    request["approval_id"])


def test_resume_with_an_edit(store) -> None:
    effects: list[dict[str, Any]] = []
    graph = build(store, Clock(), effects)
    config, _ = start(graph, "t-edit")
    out = graph.invoke(Command(resume={"type": "edit", "edited_action": {"args": {"amount": 900}},
                                       "by": "alice"}), config)
    assert out["results"] == ["sent 900"] and effects == [{**BIG, "amount": 900}]


def test_resume_with_a_rejection(store) -> None:
    effects: list[dict[str, Any]] = []
    graph = build(store, Clock(), effects)
    config, _ = start(graph, "t-reject")
    out = graph.invoke(Command(resume={"type": "reject", "message": "no", "by": "bob"}), config)
    assert out["results"] == ["rejected (approval_denied)"] and effects == []


def test_an_approval_is_not_replayed_onto_changed_arguments(store) -> None:
    effects: list[dict[str, Any]] = []
    graph = build(store, Clock(), effects)
    config, request = start(graph, "t-tamper")
    # the checkpointed call is changed before the resume (a tampered state, a confused host)
    graph.update_state(config, {"call": {"id": "call-1", "args": {**BIG, "amount": 50000}}})
    out = graph.invoke(Command(resume={"type": "approve", "approval_id": request["approval_id"]}),
                       config)
    assert out["results"] == ["rejected (approval_mismatch)"] and effects == []


def test_an_answer_for_another_request_is_refused(store) -> None:
    """The call is refused (the model reads why); LangGraph would replay a raised error's answer."""
    effects: list[dict[str, Any]] = []
    graph = build(store, Clock(), effects)
    _, first = start(graph, "t-first")
    other, second = start(graph, "t-other")
    out = graph.invoke(Command(resume={"type": "approve", "approval_id": first["approval_id"]}),
                       other)
    assert out["results"] == ["rejected (invalid_resume)"] and effects == []
    book = ApprovalBook(store)
    assert {r.id for r in book.pending()} == {first["approval_id"], second["approval_id"]}


def test_an_answer_after_the_expiry_is_refused(store) -> None:
    effects: list[dict[str, Any]] = []
    clock = Clock()
    graph = build(store, clock, effects)
    config, _ = start(graph, "t-late")
    clock.now += timedelta(minutes=10)
    out = graph.invoke(Command(resume="approve"), config)
    assert out["results"] == ["rejected (approval_expired)"] and effects == []
    assert store.query_audit(decision="operator") == []  # nothing was decided
