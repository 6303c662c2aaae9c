"""Approvals through the guard: plain callers and the CLI, and a real LangGraph graph.

In a graph the guard interrupts with the request and the resume value decides;
the node re-runs from its top on resume, so the request must be audited once
and the paused call never recorded as unknown.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from guard.tools import calls_message, scripted, tool_graph, tool_messages
from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from typer.testing import CliRunner

from controls.guarded import EFFECT, intent, write
from toolguard.adapters import GuardedToolCalls
from toolguard.call.context import current
from toolguard.cli import app
from toolguard.controls.approvals import ApprovalBook
from toolguard.errors import ApprovalRequired, GuardMisconfigured

POLICY: dict[str, Any] = {
    "version": 1,
    "tools": {
        "transfer": {"locks": ["lead:{lead_id}"], "redact": ["memo"],
                     "args": {"amount": {"ge": 0}},
                     "quotas": [{"budget": 10000, "arg": "amount", "window": "1d"}],
                     "approval": {"when": {"amount": {"gt": 1000}}, "expires": "10m",
                                  "reason": "large transfer"}},
    },
}
BIG = {"lead_id": "l1", "amount": 5000, "memo": "rent for flat 3"}


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


def cli(h: Any, *args: str) -> Any:
    options = ["--schema", h.backend.store_options["schema"]] \
        if h.backend.kind == "postgresql" else []
    result = CliRunner().invoke(app, [*args, "--url", h.backend.store_url, *options])
    assert result.exit_code == 0, result.output
    return result


# --- plain callers ----------------------------------------------------------------------


def test_a_plain_caller_is_refused_until_someone_approves(harness: Any) -> None:
    h = harness(POLICY)
    call = intent("transfer", BIG, call_id="p1")
    waiting = h.guard.run(call, write)
    assert (waiting.kind, waiting.reason) == ("rejected", "approval_required")
    approval_id = waiting.approval_id
    assert approval_id and approval_id.startswith("ap_") and approval_id in waiting.message
    with pytest.raises(ApprovalRequired) as raised:
        h.guard.call(call, write)
    assert raised.value.approval_id == approval_id  # the same request: one per intent
    assert h.effects() == [] and len(ApprovalBook(h.store).pending()) == 1
    cli(h, "approve", approval_id, "--by", "alice")
    assert h.guard.run(call, write).ok and len(h.effects()) == 1
    assert h.guard.run(call, write).kind == "replayed"  # and never twice
    assert h.decisions("p1") == [("rejected", "approval_required"),
                                 ("rejected", "approval_required"), ("accepted", "applied"),
                                 ("replayed", "duplicate")]
    (operator,) = h.audit(decision="operator")
    assert (operator.reason, operator.args["by"]) == ("approved", "alice")


def test_a_denial_an_edit_and_a_small_call(harness: Any) -> None:
    h = harness(POLICY)
    denied = intent("transfer", BIG, call_id="d1")
    cli(h, "deny", h.guard.run(denied, write).approval_id, "--by", "bob", "--note", "no")
    refused = h.guard.run(denied, write)
    assert refused.reason == "approval_denied" and "bob" in refused.message
    edited = intent("transfer", BIG, call_id="e1")
    cli(h, "approve", h.guard.run(edited, write).approval_id, "--args", '{"amount": 900}')
    assert h.guard.run(edited, write).ok
    assert h.guard.run(intent("transfer", {**BIG, "amount": 10}, call_id="s1"), write).ok
    assert [row[2] for row in h.effects()] == [900, 10]
    (accepted,) = [r for r in h.audit(intent_id="e1") if r.decision == "accepted"]
    assert accepted.args["amount"] == 900 and accepted.args["memo"] == "[redacted]"


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_budget_is_charged_what_the_person_approved_not_what_was_asked(
        harness: Any, asynchronous: bool) -> None:
    """Quotas decide on the edited call: asked 9,500, approved as 900, so 900 is spent."""
    h = harness(POLICY)
    asked = intent("transfer", {**BIG, "amount": 9500}, call_id="q1")
    small = [intent("transfer", {**BIG, "amount": 1000}, call_id=f"q{n}") for n in range(2, 12)]

    async def awrite(ctx: Any) -> None:
        await ctx.atx.execute(EFFECT, ("transfer", ctx.args["lead_id"], ctx.args["amount"],
                                       ctx.intent.call_id, None))

    async def scenario(run: Any) -> list[Any]:
        request = await run(asked)
        await asyncio.to_thread(cli, h, "approve", request.approval_id, "--args",
                                '{"amount": 900}')
        return [await run(call) for call in [asked, *small]]

    async def on_async_edges() -> list[Any]:
        async with h.async_edges() as guard:
            return await scenario(lambda call: guard.arun(call, awrite))

    async def sync_run(call: Any) -> Any:
        return await asyncio.to_thread(h.guard.run, call, write)

    approved, *rest = asyncio.run(on_async_edges() if asynchronous else scenario(sync_run))
    assert approved.ok, approved.message
    assert [d.ok for d in rest] == [True] * 9 + [False]  # 900 + 9 x 1,000 fit in 10,000
    assert rest[-1].reason == "budget_exceeded"
    assert [row[2] for row in h.effects()] == [900] + [1000] * 9


def test_an_approval_is_bound_to_the_arguments_and_expires(harness: Any) -> None:
    clock = Clock()
    h = harness(POLICY, approval_clock=clock)
    first = intent("transfer", BIG, call_id="m1")
    approval_id = h.guard.run(first, write).approval_id
    ApprovalBook(h.store, clock=clock).decide(approval_id, "approve", by="alice")
    # the same call id (same idempotency key) with other arguments: not what was approved
    changed = first.model_copy(update={"args": {**BIG, "amount": 50000}})
    assert h.guard.run(changed, write).reason == "approval_mismatch"
    late = intent("transfer", BIG, call_id="x1")
    h.guard.run(late, write)
    clock.now += timedelta(minutes=11)
    assert h.guard.run(late, write).reason == "approval_expired"
    assert h.effects() == []


def test_an_approval_rule_needs_a_store_to_keep_requests(backend: Any) -> None:
    from toolguard.policies import Policy
    from toolguard.steps.controls import Controls

    with pytest.raises(GuardMisconfigured, match="approval"):
        Controls.build(Policy.from_dict(POLICY), store=None, async_store=None)


# --- LangGraph -----------------------------------------------------------------------------


def transfer_tool() -> StructuredTool:
    def transfer(lead_id: str, amount: int, memo: str = "") -> str:
        """Move money."""
        ctx = current()
        ctx.tx.execute(EFFECT, ("transfer", lead_id, amount, ctx.intent.call_id, None))
        return f"sent {amount}"

    async def atransfer(lead_id: str, amount: int, memo: str = "") -> str:
        ctx = current()
        await ctx.atx.execute(EFFECT, ("transfer", lead_id, amount, ctx.intent.call_id, None))
        return f"sent {amount}"

    return StructuredTool.from_function(func=transfer, coroutine=atransfer)


def graph_of(h: Any, *, asynchronous: bool = False) -> Any:
    model = scripted(calls_message(("transfer", BIG, "call-1")), AIMessage("done"),
                     AIMessage("done"))
    calls = GuardedToolCalls(h.guard, agent="payments")
    return tool_graph(model, [transfer_tool()], wrap=calls.wrap_tool_call,
                      awrap=calls.awrap_tool_call, checkpointer=InMemorySaver())


def start(h: Any, thread: str) -> tuple[Any, dict[str, Any], Any]:
    graph = graph_of(h)
    config = {"configurable": {"thread_id": thread}}
    out = graph.invoke({"messages": [("user", "pay the rent")]}, config)
    (pending,) = out["__interrupt__"]
    return graph, config, pending.value


def test_a_graph_interrupts_with_the_request_and_resumes_on_approval(harness: Any) -> None:
    h = harness(POLICY)
    graph, config, request = start(h, "g-approve")
    assert request["type"] == "toolguard_approval" and request["tool_call_id"] == "call-1"
    assert request["args"]["memo"] == "[redacted]" and request["keys"] == ["lead:l1"]
    assert request["description"].startswith("large transfer")
    assert h.effects() == []
    assert h.decisions("call-1") == [("rejected", "approval_required")]  # not "unknown"
    out = graph.invoke(Command(resume={"type": "approve", "by": "alice"}), config)
    assert tool_messages(out["messages"])["call-1"].content == "sent 5000"
    assert [row[2] for row in h.effects()] == [5000]
    # one row for the request (across the interrupt and the resume), one for the applied call
    assert h.decisions("call-1") == [("rejected", "approval_required"), ("accepted", "applied")]
    (operator,) = h.audit(decision="operator")
    assert (operator.reason, operator.args["by"]) == ("approved", "alice")
    assert {row.policy_version for row in h.audit()} == {h.guard.policy.digest}
    assert h.intent_status(h.audit(intent_id="call-1")[-1].idempotency_key) == "applied"


@pytest.mark.parametrize(("answer", "content", "amounts"), [
    ({"type": "edit", "edited_action": {"args": {"amount": 900}}, "by": "alice"}, "sent 900",
     [900]),
    ({"type": "edit", "args": {"amount": -5}}, "invalid_arguments", []),
    ({"type": "reject", "message": "not today", "by": "bob"}, "approval_denied", []),
    ({"type": "maybe"}, "invalid_resume", []),
    ({"type": "approve", "by": "x" * 5000}, "invalid_resume", []),              # hostile: huge
    # over the input limits: refused before the edit is stored as a decision
    ({"type": "edit", "args": {"amount": "9" * 5000}}, "invalid_resume", []),
    (["approve"], "invalid_resume", []),
])
def test_a_resume_edits_or_rejects(harness: Any, answer: Any, content: str,
                                   amounts: list[int]) -> None:
    h = harness(POLICY)
    graph, config, _ = start(h, "g-answer")
    out = graph.invoke(Command(resume=answer), config)
    assert content in str(tool_messages(out["messages"])["call-1"].content)
    assert [row[2] for row in h.effects()] == amounts
    rows = h.decisions("call-1")
    assert rows[0] == ("rejected", "approval_required") and len(rows) == 2
    assert ("unknown", "interrupted") not in rows


def test_an_approval_is_not_replayed_onto_changed_arguments(harness: Any) -> None:
    h = harness(POLICY)
    graph, config, request = start(h, "g-tamper")
    state = graph.get_state(config)
    asked = state.values["messages"][-1]
    tampered = asked.model_copy(update={"tool_calls": [{**asked.tool_calls[0], "args": {
        **BIG, "amount": 50000}}]})
    graph.update_state(config, {"messages": [tampered]}, as_node="agent")
    out = graph.invoke(Command(resume={"type": "approve", "approval_id": request["approval_id"]}),
                       config)
    assert "approval_mismatch" in str(tool_messages(out["messages"])["call-1"].content)
    assert h.effects() == []


def test_an_answer_after_the_expiry_is_refused(harness: Any) -> None:
    clock = Clock()
    h = harness(POLICY, approval_clock=clock)
    graph, config, _ = start(h, "g-late")
    clock.now += timedelta(minutes=11)
    out = graph.invoke(Command(resume="approve"), config)
    assert "approval_expired" in str(tool_messages(out["messages"])["call-1"].content)
    assert h.effects() == [] and h.audit(decision="operator") == []


def test_the_async_graph_interrupts_and_resumes(harness: Any) -> None:
    h = harness(POLICY)

    async def main() -> Any:
        async with h.async_edges():
            graph = graph_of(h)
            config = {"configurable": {"thread_id": "g-async"}}
            first = await graph.ainvoke({"messages": [("user", "pay")]}, config)
            assert first["__interrupt__"][0].value["type"] == "toolguard_approval"
            return await graph.ainvoke(Command(resume="approve"), config)

    out = asyncio.run(main())
    assert tool_messages(out["messages"])["call-1"].content == "sent 5000"
    assert Counter(h.decisions("call-1")) == {("rejected", "approval_required"): 1,
                                              ("accepted", "applied"): 1}


def test_a_wrapped_tool_in_a_graph_asks_the_same_way(harness: Any) -> None:
    """``guard_tool(...)`` in a plain ToolNode: interrupt, then an edit runs the edited call."""
    from toolguard.adapters import guard_tool

    h = harness(POLICY)
    tool = guard_tool(h.guard, transfer_tool(), agent="payments")
    model = scripted(calls_message(("transfer", BIG, "call-1")), AIMessage("done"))
    graph = tool_graph(model, [tool], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "g-tool"}}
    first = graph.invoke({"messages": [("user", "pay")]}, config)
    assert first["__interrupt__"][0].value["tool_call_id"] == "call-1"
    out = graph.invoke(Command(resume={"type": "edit", "args": {"amount": 700}}), config)
    assert tool_messages(out["messages"])["call-1"].content == "sent 700"
    assert [row[2] for row in h.effects()] == [700]
    assert h.decisions("call-1") == [("rejected", "approval_required"), ("accepted", "applied")]
    # outside a graph the same tool cannot pause: the caller is told what to approve
    with pytest.raises(Exception, match="approval_required"):
        tool.invoke({**BIG, "amount": 2000})


@pytest.mark.parametrize("asynchronous", [False, True])
def test_parallel_calls_of_one_node_are_each_decided_by_their_own_answer(
        harness: Any, asynchronous: bool) -> None:
    """Three calls in one ToolNode, two need approval: answers name their request's id.

    LangGraph hands resume values out in the order the calls reach ``interrupt()``,
    which parallel calls do in any order; an answer reaching the wrong call decides
    the request it names, never the call it reached.
    """
    h = harness(POLICY)
    message = calls_message(("transfer", {**BIG, "lead_id": "a"}, "c-a"),
                            ("transfer", {**BIG, "lead_id": "b", "amount": 6000}, "c-b"),
                            ("transfer", {**BIG, "lead_id": "c", "amount": 10}, "c-c"))
    calls = GuardedToolCalls(h.guard, agent="payments")
    graph = tool_graph(scripted(message, AIMessage("done")), [transfer_tool()],
                       wrap=calls.wrap_tool_call, awrap=calls.awrap_tool_call,
                       checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"g-parallel-{asynchronous}"}}
    verdicts = {"c-a": "approve", "c-b": "reject"}

    async def drive() -> Any:
        async with h.async_edges():
            out = await graph.ainvoke({"messages": [("user", "pay")]}, config)
            while out.get("__interrupt__"):
                out = await graph.ainvoke(Command(resume=answers(out)), config)
            return out

    def answers(out: Any) -> dict[str, Any]:
        return {i.id: {"type": verdicts[i.value["tool_call_id"]],
                       "approval_id": i.value["approval_id"], "by": "alice"}
                for i in out["__interrupt__"]}

    if asynchronous:
        out = asyncio.run(drive())
    else:
        out = graph.invoke({"messages": [("user", "pay")]}, config)
        while out.get("__interrupt__"):
            out = graph.invoke(Command(resume=answers(out)), config)
    contents = {k: str(v.content) for k, v in tool_messages(out["messages"]).items()}
    assert contents["c-a"] == "sent 5000" and contents["c-c"] == "sent 10"
    assert "approval_denied" in contents["c-b"]
    assert sorted(row[1] for row in h.effects()) == ["a", "c"]  # each applied once
    # a node re-runs every call on each resume: applied calls are replayed from their record,
    # and each request is audited once, when it was made
    pending = ("rejected", "approval_required")
    for call_id, final in (("c-a", ("accepted", "applied")), ("c-b", ("rejected",
                                                                      "approval_denied"))):
        rows = h.decisions(call_id)
        assert rows.count(pending) == 1 and final in rows, rows
        # on the async path a sibling's interrupt cancels the calls still running (asyncio
        # gather): their outcome is unknown until their key is seen again, never applied twice
        allowed = {final, ("replayed", "duplicate"), *([("unknown", "cancelled")]
                                                       if asynchronous else [])}
        assert set(rows) - {pending} <= allowed, rows
    assert ("unknown", "interrupted") not in h.decisions("c-c")
    assert sorted(r.reason for r in h.audit(decision="operator")) == ["approved", "denied"]
