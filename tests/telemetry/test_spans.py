"""The spans of guarded calls: names, parent/child links, attributes, and the audit row they match.

Each test runs on the embedded default (SQLite locks and store) and on Redis +
PostgreSQL, with the SDK's in-memory exporter behind toolguard
(``use_providers``). Span and attribute names are the GenAI semantic
conventions' for a tool execution (``execute_tool {name}``, ``gen_ai.*``,
``error.type``) and toolguard's own under ``toolguard.``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from guard.harness import Harness, HarnessFactory
from guard.tools import EFFECT, LEAD_POLICY, LeadTools, calls_message, scripted, tool_graph
from langchain_core.messages import AIMessage, HumanMessage
from opentelemetry.trace import StatusCode

from telemetry.recorder import Recorder
from toolguard.adapters import GuardedToolCalls, guarded
from toolguard.call.context import current
from toolguard.call.intent import Intent
from toolguard.runtime import telemetry
from toolguard.store import AuditEntry

POLICY: dict[str, Any] = {"version": 1, "tools": {
    "add_score": {"locks": ["lead:{lead_id}"], "agents": ["scorer"],
                  "args": {"delta": {"ge": -100, "le": 100}}},
    "merge_leads": {"locks": ["lead:{into}", "lead:{other}"], "agents": ["scorer"]},
    "lookup": {"read_only": True},
}}

FENCED_TREE = [(0, "execute_tool add_score"), (1, "toolguard.validate"),
               (1, "toolguard.lock.wait"), (1, "toolguard.fenced_transaction"),
               (2, "toolguard.tool")]


def lead_functions(h: Harness) -> tuple[Any, Any, Any]:
    @guarded(h.guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        ctx = current()
        ctx.tx.execute(EFFECT, ("add_score", lead_id, delta, ctx.intent.call_id, 1))
        return delta

    @guarded(h.guard, agent="scorer")
    def merge_leads(into: str, other: str) -> str:
        ctx = current()
        ctx.tx.execute(EFFECT, ("merge_leads", into, 0, ctx.intent.call_id, 1))
        return into

    @guarded(h.guard, agent="scorer")
    def lookup(lead_id: str) -> str:
        return lead_id

    return add_score, merge_leads, lookup


def audit_row(h: Harness, call_id: str) -> AuditEntry:
    (row,) = h.audit(intent_id=call_id)
    return row


def assert_matches_audit(span: Any, row: AuditEntry) -> None:
    """The call's span says what its audit row says."""
    attributes = span.attributes
    assert attributes["toolguard.decision"] == row.decision
    assert attributes["toolguard.reason"] == row.reason
    assert attributes["gen_ai.tool.name"] == row.tool
    assert attributes["gen_ai.tool.call.id"] == row.intent_id
    assert attributes["gen_ai.agent.name"] == row.agent
    assert attributes["toolguard.keys.count"] == len(row.keys)
    assert list(attributes.get("toolguard.fencing_tokens", [])) == \
        [token for _, token in sorted(row.tokens.items())]
    if row.decision in ("rejected", "failed"):
        assert attributes["error.type"] == row.reason
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description is None  # never the message: it may quote values
    else:
        assert "error.type" not in attributes
        assert span.status.status_code is StatusCode.UNSET


def test_an_accepted_call_is_one_execute_tool_span_with_its_steps(
        harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)
    add_score, _, _ = lead_functions(h)

    decision = add_score.run({"lead_id": "L-1", "delta": 5}, call_id="c1", thread_id="t1")

    assert decision.kind == "accepted"
    (call,) = otel.calls()
    assert call.parent is None and call.kind.name == "INTERNAL"
    assert otel.tree(call) == FENCED_TREE
    assert len(otel.spans()) == len(FENCED_TREE)  # nothing outside the call's tree
    assert {s.context.trace_id for s in otel.spans()} == {call.context.trace_id}
    assert call.attributes["gen_ai.operation.name"] == "execute_tool"
    assert call.attributes["gen_ai.tool.type"] == "function"
    assert call.attributes["gen_ai.conversation.id"] == "t1"
    assert call.attributes["toolguard.idempotency_key"] == decision.idempotency_key == \
        "thread:t1//c1"
    row = audit_row(h, "c1")
    assert_matches_audit(call, row)
    (wait,) = otel.spans("toolguard.lock.wait")
    (transaction,) = otel.spans("toolguard.fenced_transaction")
    assert wait.attributes["toolguard.keys.count"] == 1 and wait.attributes["toolguard.attempt"] == 1
    assert list(transaction.attributes["toolguard.fencing_tokens"]) == list(row.tokens.values())
    # the steps happen in order inside the call's time
    assert call.start_time <= wait.start_time <= wait.end_time <= transaction.start_time
    assert transaction.end_time <= call.end_time


def test_several_keys_count_and_tokens_in_key_order_never_the_keys(
        harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)
    _, merge_leads, _ = lead_functions(h)

    assert merge_leads.run({"into": "L-9", "other": "L-2"}, call_id="m1", thread_id="t1").ok

    (call,) = otel.calls()
    row = audit_row(h, "m1")
    assert call.attributes["toolguard.keys.count"] == 2
    assert_matches_audit(call, row)
    assert not any("L-9" in str(v) or "L-2" in str(v) for v in otel.every_attribute_value())


def test_a_replay_shows_the_transaction_answering_from_the_record(
        harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)
    add_score, _, _ = lead_functions(h)
    args = {"lead_id": "L-1", "delta": 5}
    assert add_score.run(args, call_id="c1", thread_id="t1").kind == "accepted"

    again = add_score.run(args, call_id="c1", thread_id="t1")

    assert again.kind == "replayed"
    first, second = otel.calls()
    assert otel.tree(second) == [(0, "execute_tool add_score"), (1, "toolguard.validate"),
                                 (1, "toolguard.lock.wait"), (1, "toolguard.fenced_transaction")]
    (_, replay_tx) = otel.spans("toolguard.fenced_transaction")
    assert replay_tx.attributes["toolguard.replayed"] is True
    assert replay_tx.status.status_code is StatusCode.UNSET  # a replay is an answer, not an error
    first_row, second_row = h.audit(intent_id="c1")
    assert_matches_audit(first, first_row)
    assert_matches_audit(second, second_row)
    assert second.attributes["toolguard.reason"] == "duplicate"


@pytest.mark.parametrize(("args", "agent", "reason", "failed_step"), [
    ({"lead_id": "L-1", "delta": 500}, "scorer", "invalid_arguments", "toolguard.validate"),
    ({"lead_id": "L-1", "delta": "5"}, "scorer", "invalid_arguments", "toolguard.validate"),
    ({"lead_id": "L-1", "delta": 5}, "router", "not_authorized", "toolguard.validate"),
])
def test_a_refusal_before_the_lock_ends_in_validate_and_is_audited_by_the_guard(
        harness: HarnessFactory, otel: Recorder, args: dict[str, Any], agent: str, reason: str,
        failed_step: str) -> None:
    h = harness(POLICY)
    add_score, _, _ = lead_functions(h)

    decision = add_score.run(args, agent=agent, call_id="bad", thread_id="t1")

    assert (decision.kind, decision.reason) == ("rejected", reason)
    (call,) = otel.calls()
    assert otel.tree(call) == [(0, "execute_tool add_score"), (1, "toolguard.validate"),
                               (1, "toolguard.audit")]
    (step,) = otel.spans(failed_step)
    assert step.attributes["error.type"] == reason
    assert step.status.status_code is StatusCode.ERROR
    assert not step.events  # no exception event: its message may quote the arguments
    assert_matches_audit(call, audit_row(h, "bad"))


def test_a_tool_the_policy_does_not_know_keeps_its_name_out_of_the_span_name(
        harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)
    name = "drop_tables_" + "x" * 230
    intent = Intent(tool=name, args={}, call_id="u1", agent="scorer")

    decision = h.guard.run(intent, lambda ctx: None)

    assert decision.reason == "unknown_tool"
    (call,) = otel.calls()
    assert call.name == "execute_tool"  # span names stay a small set
    assert call.attributes["gen_ai.tool.name"] == name[:200]  # bounded like the audit log's
    assert call.attributes["error.type"] == "unknown_tool"
    row = audit_row(h, "u1")
    assert row.tool == call.attributes["gen_ai.tool.name"]
    assert otel.counts("toolguard.decisions", "gen_ai.tool.name", "toolguard.reason") == {
        ("_OTHER", "unknown_tool"): 1}


def test_a_read_only_tool_runs_without_lock_spans_and_the_guard_audits_it(
        harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)
    _, _, lookup = lead_functions(h)

    assert lookup.run({"lead_id": "L-1"}, call_id="r1", thread_id="t1").ok

    (call,) = otel.calls()
    assert otel.tree(call) == [(0, "execute_tool lookup"), (1, "toolguard.validate"),
                               (1, "toolguard.tool"), (1, "toolguard.audit")]
    assert_matches_audit(call, audit_row(h, "r1"))


def test_a_failing_tool_marks_the_tool_step_and_the_call_with_the_reason(
        harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)

    @guarded(h.guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        raise RuntimeError(f"could not score {lead_id}")

    decision = add_score.run({"lead_id": "L-1", "delta": 5}, call_id="f1", thread_id="t1")

    assert (decision.kind, decision.reason) == ("failed", "error")
    (call,) = otel.calls()
    assert otel.tree(call) == FENCED_TREE
    (tool,) = otel.spans("toolguard.tool")
    (transaction,) = otel.spans("toolguard.fenced_transaction")
    assert tool.attributes["error.type"] == "RuntimeError"
    assert transaction.attributes["error.type"] == "RuntimeError"
    assert_matches_audit(call, audit_row(h, "f1"))


def test_the_call_joins_the_callers_current_span(harness: HarnessFactory,
                                                  otel: Recorder) -> None:
    h = harness(POLICY)
    add_score, _, _ = lead_functions(h)

    with otel.tracer.start_as_current_span("agent turn") as turn:
        assert add_score.run({"lead_id": "L-1", "delta": 5}, call_id="c1", thread_id="t1").ok

    (call,) = otel.calls()
    assert call.parent is not None and call.parent.span_id == turn.get_span_context().span_id
    assert call.context.trace_id == turn.get_span_context().trace_id


def test_what_the_tool_traces_nests_under_the_tool_step(harness: HarnessFactory,
                                                        otel: Recorder) -> None:
    h = harness(POLICY)

    @guarded(h.guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        with otel.tracer.start_as_current_span("crm request"):
            return delta

    assert add_score.run({"lead_id": "L-1", "delta": 5}, call_id="c1", thread_id="t1").ok

    (call,) = otel.calls()
    assert otel.tree(call) == [*FENCED_TREE, (3, "crm request")]


def test_the_async_path_has_the_same_tree(harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)

    @guarded(h.guard, agent="scorer")
    async def add_score(lead_id: str, delta: int) -> int:
        ctx = current()
        await ctx.atx.execute(EFFECT, ("add_score", lead_id, delta, ctx.intent.call_id, 1))
        return delta

    async def main() -> list[Any]:
        async with h.async_edges():
            with otel.tracer.start_as_current_span("agent turn"):
                return list(await asyncio.gather(*(
                    add_score.arun({"lead_id": lead, "delta": 1}, call_id=f"a-{lead}",
                                   thread_id="t1") for lead in ("L-1", "L-2", "L-3"))))

    decisions = asyncio.run(main())

    assert [d.kind for d in decisions] == ["accepted"] * 3
    (turn,) = otel.spans("agent turn")
    calls = otel.calls()
    assert len(calls) == 3
    for call in calls:  # three concurrent tasks, each tree kept apart
        assert call.parent is not None and call.parent.span_id == turn.context.span_id
        assert otel.tree(call) == FENCED_TREE
        assert_matches_audit(call, audit_row(h, call.attributes["gen_ai.tool.call.id"]))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_under_a_langgraph_run_each_tool_call_is_a_child_of_the_callers_span(
        harness: HarnessFactory, otel: Recorder, mode: str) -> None:
    """ToolNode runs parallel calls in threads (sync, contextvars copied) or tasks (async):
    the guard's spans land in the caller's trace either way, one ``execute_tool`` per call."""
    h = harness(LEAD_POLICY)
    tools = LeadTools()
    calls = GuardedToolCalls(h.guard, agent="scorer")
    turn = calls_message(("add_score", {"lead_id": "a", "delta": 1}, "g1"),
                         ("add_score", {"lead_id": "b", "delta": 2}, "g2"),
                         ("reassign_lead", {"lead_id": "a", "owner": "eve"}, "g3"))
    app = tool_graph(scripted(turn, AIMessage(content="done")), tools.tools(),
                     wrap=calls.wrap_tool_call, awrap=calls.awrap_tool_call)
    inputs = {"messages": [HumanMessage("score")]}

    with otel.tracer.start_as_current_span("graph run") as run:
        if mode == "sync":
            app.invoke(inputs)
        else:
            async def main() -> None:
                async with h.async_edges():
                    await app.ainvoke(inputs)

            asyncio.run(main())

    by_id = {c.attributes["gen_ai.tool.call.id"]: c for c in otel.calls()}
    assert set(by_id) == {"g1", "g2", "g3"}
    for call_id, call in by_id.items():
        assert call.parent is not None and call.parent.span_id == run.get_span_context().span_id
        assert call.context.trace_id == run.get_span_context().trace_id
        assert_matches_audit(call, audit_row(h, call_id))
    assert by_id["g3"].attributes["toolguard.reason"] == "not_authorized"
    assert otel.tree(by_id["g1"]) == FENCED_TREE


def test_a_call_whose_provider_is_off_records_nothing(harness: HarnessFactory,
                                                      otel: Recorder) -> None:
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.trace import NoOpTracerProvider

    h = harness(POLICY)
    add_score, _, _ = lead_functions(h)
    telemetry.use_providers(tracer_provider=NoOpTracerProvider(),
                            meter_provider=NoOpMeterProvider())
    assert not telemetry.start_call(Intent(tool="add_score"), h.policy.tools).listening

    assert add_score.run({"lead_id": "L-1", "delta": 5}, call_id="c1", thread_id="t1").ok

    assert otel.spans() == [] and otel.points() == []
