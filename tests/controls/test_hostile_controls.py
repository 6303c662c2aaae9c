"""The production controls under attack: hostile resume values, ids, amounts and names.

Each case is bad input a model, a confused host or an operator's typo can bring:
it must be refused with a clear reason and audited once, never crash the graph,
never approve or count anything it should not.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import pytest
from guard.tools import tool_messages
from langgraph.types import Command
from pydantic import create_model
from typer.testing import CliRunner

from controls.calls import call, policy
from controls.guarded import EFFECT, intent, write
from controls.test_guard_approvals import BIG as BIG_CALL
from controls.test_guard_approvals import POLICY, start
from toolguard.cli import app
from toolguard.controls.approvals import ApprovalBook, InvalidResume, approval_reason, parse_resume
from toolguard.controls.pause import PauseBoard
from toolguard.errors import (
    ApprovalRequired,
    ConfigurationError,
    PolicyProblems,
    UnknownApproval,
)
from toolguard.store import open_store
from toolguard.store.base import AuditEntry


@pytest.mark.parametrize(("answer", "content"), [
    ({"type": "approve", "approval_id": 5}, "invalid_resume"),
    ({"type": "approve", "approval_id": {"id": "ap_x"}}, "invalid_resume"),
    ({"type": "approve", "approval_id": "ap_\x00"}, "invalid_resume"),
    ({"type": "approve", "approval_id": "ap_" + "f" * 5000}, "invalid_resume"),
    ({"type": "edit", "args": {"amount": float("nan")}}, "invalid"),
    ({"type": "edit", "edited_action": {"name": "wipe_everything", "args": {"amount": 1}}},
     "invalid_resume"),
    (7, "invalid_resume"),
    ({"type": "edit", "args": [1, 2]}, "invalid_resume"),
    ({"type": "edit", "args": {"bogus": 1}}, "invalid_arguments"),  # validated as any call
    ({"type": "edit", "args": {"amount": {"nested": {"deep": 1}}}}, "invalid_arguments"),
    ({"type": "approve", "by": "al\x00ice"}, "invalid_resume"),
    ({"type": "reject", "message": "no \ud800"}, "invalid_resume"),
    ({"decision": 1}, "invalid_resume"),
    ({"type": "approve", "extra": {"nested": [1, 2]}}, "invalid_resume"),
])
def test_a_hostile_resume_is_refused_and_audited_once(harness: Any, answer: Any,
                                                      content: str) -> None:
    h = harness(POLICY)
    graph, config, _ = start(h, "g-hostile")
    out = graph.invoke(Command(resume=answer), config)
    message = tool_messages(out["messages"])["call-1"]
    assert content in str(message.content), message.content
    assert h.effects() == []
    rows = h.decisions("call-1")
    assert rows[0] == ("rejected", "approval_required") and len(rows) == 2, rows
    assert rows[1][0] == "rejected", rows


@pytest.mark.parametrize("odd", ["", " ", "ap_\x00", "ap_" + "f" * 5000, "ap_' OR '1'='1",
                                 "ap_\ud800", "../ap_1"])
def test_odd_approval_ids_name_no_request(store: Any, odd: str) -> None:
    """The CLI and the plain-caller API: an id no request can have is unknown, and reaches no SQL."""
    book = ApprovalBook(store)
    facts = call(policy(), "wipe", {})
    with pytest.raises(ApprovalRequired) as asked:
        book.check(policy().tools["wipe"], facts)
    assert book.get(odd) is None
    with pytest.raises(UnknownApproval) as unknown:
        book.decide(odd, "approve", by="alice")
    assert unknown.value.reason == "unknown_approval"
    assert [r.id for r in book.pending()] == [asked.value.approval_id]  # nothing was decided
    assert store.query_audit(decision="operator") == []


def test_the_cli_refuses_odd_ids_as_usage_errors(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path}/store.db"
    open_store(url, install=True).close()
    runner = CliRunner()
    for odd in ("ap_\x00", "ap_" + "f" * 5000, ""):
        for command in ("approve", "deny"):
            result = runner.invoke(app, [command, odd, "--url", url])
            assert result.exit_code == 2, (command, odd, result.output)
            assert "no approval request" in result.output


def test_a_value_the_condition_cannot_judge_still_needs_approval() -> None:
    """Without a registered schema the model's value may have any type: fail closed."""
    rule = policy().tools["transfer"]
    for odd in ("5000", True, [5000], {"value": 5000}, float("nan")):
        why = approval_reason(rule, {"from_id": "a1", "to_id": "b2", "amount": odd})
        assert why is not None and "amount is not" in why, (odd, why)
    assert approval_reason(rule, {"from_id": "a1", "to_id": "b2", "amount": 5}) is None
    assert approval_reason(rule, {"from_id": "a1", "to_id": "b2", "amount": None}) is None


def test_a_schemaless_call_cannot_dodge_its_approval_with_a_string(harness: Any) -> None:
    rules = {"version": 1, "tools": {"transfer": {
        "locks": ["lead:{lead_id}"], "approval": {"when": {"amount": {"gt": 1000}}}}}}
    h = harness(rules)
    sneaky = intent("transfer", {"lead_id": "l1", "amount": "5000"}, call_id="s1")
    refused = h.guard.run(sneaky, write)
    assert refused.reason == "approval_required", refused.message
    assert "amount is not a number" in refused.message
    assert h.effects() == [] and h.decisions("s1") == [("rejected", "approval_required")]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_quota_never_refuses_a_replay(harness: Any, asynchronous: bool) -> None:
    """A call re-sent after its window ended (a resumed thread, a retried request), when another
    call used up the budget meanwhile: it returns its recorded result, not budget_exceeded."""
    window = 2.0
    h = harness({"version": 1, "tools": {"transfer": {"locks": ["lead:{lead_id}"], "quotas": [
        {"budget": 100, "arg": "amount", "window": f"{window:g}s"}]}}})
    first = intent("transfer", {"lead_id": "l1", "amount": 60}, call_id="a1")
    second = intent("transfer", {"lead_id": "l2", "amount": 60}, call_id="b1")

    async def awrite(ctx: Any) -> dict[str, Any]:
        await ctx.atx.execute(EFFECT, ("transfer", ctx.args["lead_id"], ctx.args["amount"],
                                       ctx.intent.call_id, None))
        return {"ok": ctx.args["lead_id"]}

    async def scenario() -> list[Any]:
        async with h.async_edges() as guard:
            return await steps(lambda call: guard.arun(call, awrite))

    async def steps(run: Any) -> list[Any]:
        out = [await run(first)]
        await asyncio.sleep(window + 0.1)  # the first call's entry left the window
        out += [await run(second), await run(first), await run(first.model_copy(
            update={"args": {"lead_id": "l1", "amount": 70}}))]
        return out

    async def sync_run(call: Any) -> Any:
        return await asyncio.to_thread(h.guard.run, call, write)  # the sync path: off the loop

    applied, other, replay, changed = asyncio.run(scenario() if asynchronous
                                                  else steps(sync_run))
    assert applied.ok and other.ok
    assert (replay.kind, replay.reason) == ("replayed", "duplicate"), replay.message
    # the same key with other arguments is no replay: the quota refuses it as any call
    assert changed.reason == "budget_exceeded", changed.message
    assert len(h.effects()) == 2
    assert h.decisions("a1") == [("accepted", "applied"), ("replayed", "duplicate"),
                                 ("rejected", "budget_exceeded")]


@pytest.mark.parametrize("odd", ["trans\x00fer", "transfer ", " transfer", "\ud800", "",
                                 "x" * 257])
def test_a_pause_name_no_call_can_have_is_a_configuration_error(store: Any, odd: str) -> None:
    board = PauseBoard(store, cache_s=0)
    with pytest.raises(ConfigurationError):
        board.pause("tool", odd, by="alice")
    assert board.records() == () and store.query_audit(decision="operator") == []


def test_pausing_a_name_no_call_ever_had_warns(tmp_path: Any) -> None:
    """A typo in an emergency stops nothing: the operator is told (and the pause still holds)."""
    url = f"sqlite:///{tmp_path}/store.db"
    store = open_store(url, install=True)
    try:
        store.audit(AuditEntry(decision="accepted", reason="applied", tool="transfer",
                               agent="payments"))
        runner = CliRunner()
        typo = runner.invoke(app, ["pause", "trasnfer", "--url", url])
        assert typo.exit_code == 0, typo.output
        assert "no call of a tool or agent named 'trasnfer'" in typo.output
        assert {r.name for r in PauseBoard(store, cache_s=0).records()} == {"trasnfer"}
        for known in (["transfer", "--tool"], ["payments", "--agent"], ["payments"]):
            done = runner.invoke(app, ["pause", *known, "--url", url])
            assert done.exit_code == 0 and "warning" not in done.output, done.output
        assert "warning" not in runner.invoke(app, ["pause", "--all", "--url", url]).output
        # an operator's own pause rows do not make a name known
        again = runner.invoke(app, ["pause", "trasnfer", "--url", url])
        assert "no call of a tool or agent named 'trasnfer'" in again.output
    finally:
        store.close()


def test_hostile_amounts_in_shadow_mode_are_noted_once_and_never_counted(harness: Any) -> None:
    """Shadow mode notes what enforcement would refuse; it never refills or overdraws a budget."""
    h = harness({"version": 1, "defaults": {"mode": "shadow"}, "tools": {"transfer": {
        "locks": ["lead:{lead_id}"],
        "quotas": [{"budget": 100, "arg": "amount", "window": "1h"}],
        "approval": {"when": {"amount": {"gt": 1000}}}}}})
    backend = h.guard.controls.quotas.backend
    scope = "transfer/budget/3600s/tool|tool=transfer"
    cases = {"h-neg": (-50, "invalid_arguments"), "h-huge": (10**400, "approval_required"),
             "h-text": ("5000", "approval_required"), "h-over": (500, "budget_exceeded")}
    for call_id, (amount, reason) in cases.items():
        decision = h.guard.run(intent("transfer", {"lead_id": "l1", "amount": amount},
                                      call_id=call_id), lambda ctx: "done")
        assert decision.ok, (call_id, decision.message)
        assert h.decisions(call_id) == [("shadow", reason), ("accepted", "applied")], call_id
        assert backend.usage(scope) == 0, call_id  # nothing drawn, nothing refilled
    assert h.guard.run(intent("transfer", {"lead_id": "l1", "amount": 100}, call_id="h-ok"),
                       lambda ctx: "done").ok
    assert backend.usage(scope) == 100 and h.decisions("h-ok") == [("accepted", "applied")]
    assert ApprovalBook(h.store).pending() == []


def test_an_edit_no_store_keeps_is_refused_before_it_is_decided(tmp_path: Any) -> None:
    """``toolguard approve ID --args`` and ``decide(..., args=)``: NaN, 10,000 characters, NUL."""
    url = f"sqlite:///{tmp_path}/store.db"
    store = open_store(url, install=True)
    try:
        book = ApprovalBook(store)
        with pytest.raises(ApprovalRequired) as asked:
            book.check(policy().tools["wipe"], call(policy(), "wipe", {}))
        approval_id = asked.value.approval_id
        runner = CliRunner()
        for text in ('{"amount": NaN}', '{"memo": "' + "x" * 10_000 + '"}', '{"a\\u0000b": 1}',
                     '{"memo": "\\ud800"}'):
            result = runner.invoke(app, ["approve", approval_id, "--args", text, "--url", url])
            assert result.exit_code == 2, (text[:40], result.output)
        for args in ({"amount": float("nan")}, {"memo": "a\x00b"}, {"deep": [[[[[[[[[1]]]]]]]]]}):
            with pytest.raises(InvalidResume):
                book.decide(approval_id, "edit", by="alice", args=args)
        assert [r.id for r in book.pending()] == [approval_id]  # still undecided
        assert store.query_audit(decision="operator") == []
    finally:
        store.close()


def test_an_answer_cannot_decide_a_request_of_no_workflow(harness: Any) -> None:
    """Two calls without a thread or run (workflow None) are not one workflow: an answer given
    to one that names the other's request decides nothing, and is refused."""
    from toolguard.call.intent import Intent

    h = harness(POLICY)
    other = Intent(tool="transfer", args=BIG_CALL, agent="scorer", call_id="w-other")
    waiting = h.guard.run(other, write)
    assert waiting.reason == "approval_required"

    def answer(payload: Any) -> Any:
        return {"type": "approve", "approval_id": waiting.approval_id, "by": "mallory"}

    mine = Intent(tool="transfer", args={**BIG_CALL, "lead_id": "l9"}, agent="scorer",
                  call_id="w-mine")
    decision = h.guard.run(mine, write, interrupt=answer)
    assert decision.reason == "invalid_resume", decision.message
    pending = ApprovalBook(h.store).pending()
    assert len(pending) == 2 and all(r.status == "pending" for r in pending)  # nothing decided
    assert h.audit(decision="operator") == [] and h.effects() == []


def test_an_edit_that_moves_the_call_to_another_resource_is_validated_and_locked_again(
        harness: Any) -> None:
    h = harness(POLICY)
    graph, config, request = start(h, "g-move")
    assert request["keys"] == ["lead:l1"]
    out = graph.invoke(Command(resume={"type": "edit", "args": {"lead_id": "l2"}}), config)
    assert tool_messages(out["messages"])["call-1"].content == "sent 5000"
    assert [(row[1], row[2]) for row in h.effects()] == [("l2", 5000)]
    (applied,) = [r for r in h.audit(intent_id="call-1") if r.decision == "accepted"]
    assert applied.keys == ("lead:l2",) and applied.args["lead_id"] == "l2"
    assert h.decisions("call-1") == [("rejected", "approval_required"), ("accepted", "applied")]


def test_an_approval_is_bound_to_the_agent_it_was_asked_for(harness: Any) -> None:
    """A key template can make two agents' calls one intent; a person approved one agent's."""
    rules = {"version": 1, "agents": ["payments", "intruder"], "tools": {"transfer": {
        "locks": ["lead:{lead_id}"], "idempotency_key": "pay:{lead_id}:{amount}",
        "approval": True}}}
    h = harness(rules)
    args = {"lead_id": "l1", "amount": 5000}
    asked = h.guard.run(intent("transfer", args, agent="payments", call_id="p1"), write)
    ApprovalBook(h.store).decide(asked.approval_id, "approve", by="alice")
    other = h.guard.run(intent("transfer", args, agent="intruder", call_id="i1"), write)
    assert other.reason == "approval_mismatch", other.message
    assert h.effects() == []
    assert h.guard.run(intent("transfer", args, agent="payments", call_id="p2"), write).ok


@pytest.mark.parametrize("name", ["x[/]", "[bold red]boom", "lookup[v2]"])
def test_pause_names_are_printed_as_given(tmp_path: Any, name: str) -> None:
    """Brackets in a name are text, not console markup: printing them neither crashes the
    command after the pause was written nor shows another name than the one paused."""
    url = f"sqlite:///{tmp_path}/store.db"
    open_store(url, install=True).close()
    runner = CliRunner()
    for args in (["pause", name, "--tool"], ["pause"], ["resume", name, "--tool"]):
        result = runner.invoke(app, [*args, "--url", url])
        assert result.exit_code == 0, (args, result.output)
        assert f"tool {name!r}" in result.output, (args, result.output)
    assert "Nothing is paused." in runner.invoke(app, ["pause", "--url", url]).output


def test_a_resume_value_with_many_unknown_fields_gets_a_short_refusal() -> None:
    flood = {"type": "approve", **{f"field_{n}": n for n in range(100_000)}}
    with pytest.raises(InvalidResume) as refused:
        parse_resume(flood, approval_id="ap_1")
    assert "and 99995 more" in refused.value.message and len(refused.value.message) < 300


@pytest.mark.parametrize("kind", [Decimal, str, bool, int | str, list[int]])
def test_a_budget_on_an_argument_that_is_not_only_a_number_raises_to_the_developer(
        harness: Any, kind: Any) -> None:
    """Decimal is a number or a string in JSON, a bool is no amount: the guard refuses the
    wiring at register(), before any call could be refused for it."""
    h = harness({"version": 1, "tools": {"transfer": {
        "locks": ["lead:{lead_id}"], "quotas": [{"budget": 100, "arg": "amount", "window": "1h"}]}}})
    schema = create_model("Transfer", lead_id=(str, ...), amount=(kind, ...))
    with pytest.raises(PolicyProblems, match="a budget sums numbers"):
        h.guard.register("transfer", schema)
