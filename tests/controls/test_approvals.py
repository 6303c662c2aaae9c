"""Approvals bound to the intent: requests, decisions, binding, expiry, the CLI."""

from __future__ import annotations

import asyncio
import json
import threading
from datetime import UTC, datetime, timedelta

import pytest
from store.envs import StoreEnv
from typer.testing import CliRunner

from controls.calls import call, policy
from toolguard.cli import app
from toolguard.controls.approvals import (
    ApprovalBook,
    AsyncApprovalBook,
    InvalidResume,
    Resume,
    approval_reason,
    parse_resume,
)
from toolguard.errors import (
    ApprovalDenied,
    ApprovalExpired,
    ApprovalMismatch,
    ApprovalRequired,
    UnknownApproval,
)
from toolguard.store import open_store

BIG = {"from_id": "a1", "to_id": "b2", "amount": 5000, "memo": "rent"}


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def test_when_a_call_needs_approval() -> None:
    rules = policy()
    transfer = rules.tools["transfer"]
    assert approval_reason(transfer, {**BIG, "amount": 1000}) is None
    assert approval_reason(transfer, BIG) == "large or unusual transfer (amount > 1000)"
    assert approval_reason(transfer, {**BIG, "amount": 5, "to_id": "offshore"}) == (
        'large or unusual transfer (to_id in ["offshore"])')
    assert approval_reason(transfer, {"from_id": "a1", "to_id": "b2"}) is None  # absent: no match
    assert approval_reason(rules.tools["wipe"], {}) == "every call of this tool needs approval"
    assert approval_reason(rules.tools["lookup"], {}) is None
    both = policy(pay={"read_only": True, "approval": {"when": {"amount": {"gt": 10},
                                                                "currency": {"enum": ["BTC"]}},
                                                       "reason": None}})
    assert approval_reason(both.tools["pay"], {"amount": 11, "currency": "EUR"}) is None  # all of it
    assert approval_reason(both.tools["pay"], {"amount": 11, "currency": "BTC"}) == (
        'amount > 10 and currency in ["BTC"]')
    items = policy(buy={"read_only": True, "approval": {"when": {"items[*].price": {"ge": 100}}}})
    assert approval_reason(items.tools["buy"], {"items": [{"price": 5}, {"price": 150}]}) == (
        "items[1].price >= 100")


def test_request_approve_run(store) -> None:
    rules = policy()
    book = ApprovalBook(store)
    facts = call(rules, "transfer", BIG, key="thread-1//call-7")
    assert book.check(rules.tools["transfer"], call(rules, "transfer", {**BIG, "amount": 5})) is None
    with pytest.raises(ApprovalRequired) as first:
        book.check(rules.tools["transfer"], facts)
    request = first.value.request
    assert first.value.reason == "approval_required" and first.value.approval_id.startswith("ap_")
    assert json.loads(json.dumps(request)) == request  # survives any checkpointer
    assert request["args"] == {**BIG, "memo": "[redacted]"} and request["name"] == "transfer"
    assert request["keys"] == ["account:a1", "account:b2"]
    assert request["description"] == "large or unusual transfer (amount > 1000)"
    assert request["policy_version"] == rules.digest and request["agent"] == "payments"
    with pytest.raises(ApprovalRequired) as again:  # still waiting: the same request, no new one
        book.check(rules.tools["transfer"], facts)
    assert again.value.approval_id == first.value.approval_id
    assert [r.id for r in book.pending()] == [first.value.approval_id]
    book.decide(first.value.approval_id, "approve", by="alice", note="checked")
    approved = book.check(rules.tools["transfer"], facts)
    assert approved is not None and not approved.edited and approved.args(BIG) == BIG
    assert approved.record.decided_by == "alice" and book.pending() == []
    (row,) = store.query_audit(decision="operator")
    assert (row.reason, row.tool, row.agent, row.args["by"]) == ("approved", "transfer", "payments",
                                                                  "alice")
    assert row.idempotency_key == "thread-1//call-7" and "checked" in (row.detail or "")


def test_an_approval_is_bound_to_its_intent(store) -> None:
    rules = policy()
    book = ApprovalBook(store)
    facts = call(rules, "transfer", BIG, key="k-1")
    with pytest.raises(ApprovalRequired) as asked:
        book.check(rules.tools["transfer"], facts)
    book.decide(asked.value.approval_id, "approve", by="alice")
    # the same intent with changed arguments: the approval does not carry over
    changed = call(rules, "transfer", {**BIG, "amount": 9000}, key="k-1")
    with pytest.raises(ApprovalMismatch, match="other arguments"):
        book.check(rules.tools["transfer"], changed)
    # another policy version (a reload changed the rules): ask again
    newer = policy(lookup={"read_only": True, "agents": ["someone"]})
    with pytest.raises(ApprovalMismatch, match="policy"):
        book.check(newer.tools["transfer"], call(newer, "transfer", BIG, key="k-1"))
    # a resume value naming this approval cannot approve another call
    other = call(rules, "transfer", BIG, key="k-2")
    with pytest.raises(ApprovalMismatch):
        book.check(rules.tools["transfer"], other,
                   resume=Resume(decision="approve", approval_id=asked.value.approval_id))
    with pytest.raises(ApprovalMismatch, match="names no approval request"):
        book.check(rules.tools["transfer"], other, resume=Resume(decision="approve",
                                                                  approval_id="ap_nope"))
    assert book.check(rules.tools["transfer"], facts) is not None  # the original still runs


def test_expiry(store) -> None:
    rules = policy()
    clock = Clock()
    book = ApprovalBook(store, clock=clock)
    facts = call(rules, "transfer", BIG)
    with pytest.raises(ApprovalRequired) as asked:
        book.check(rules.tools["transfer"], facts)
    clock.now += timedelta(minutes=10)
    with pytest.raises(ApprovalExpired):  # nobody decided in time
        book.decide(asked.value.approval_id, "approve", by="alice")
    with pytest.raises(ApprovalExpired):
        book.check(rules.tools["transfer"], facts)
    later = call(rules, "transfer", BIG)
    with pytest.raises(ApprovalRequired) as fresh:
        book.check(rules.tools["transfer"], later)
    book.decide(fresh.value.approval_id, "approve", by="alice")
    clock.now += timedelta(minutes=9, seconds=59)
    assert book.check(rules.tools["transfer"], later) is not None
    clock.now += timedelta(seconds=1)
    with pytest.raises(ApprovalExpired):  # approved, but not used in time
        book.check(rules.tools["transfer"], later)


def test_deny_and_edit(store) -> None:
    rules = policy()
    book = ApprovalBook(store)
    denied = call(rules, "transfer", BIG)
    with pytest.raises(ApprovalRequired) as asked:
        book.check(rules.tools["transfer"], denied)
    book.decide(asked.value.approval_id, "reject", by="bob", note="not this month")
    with pytest.raises(ApprovalDenied, match="denied by bob: not this month"):
        book.check(rules.tools["transfer"], denied)
    with pytest.raises(UnknownApproval) as decided:
        book.decide(asked.value.approval_id, "approve", by="mallory")
    assert decided.value.reason == "approval_decided"
    assert book.decide(asked.value.approval_id, "reject", by="bob").status == "denied"  # same again
    edited = call(rules, "transfer", BIG)
    with pytest.raises(ApprovalRequired) as asked:
        book.check(rules.tools["transfer"], edited)
    book.decide(asked.value.approval_id, "edit", by="alice", args={"amount": 900})
    approved = book.check(rules.tools["transfer"], edited)
    assert approved is not None and approved.edited
    assert approved.args(BIG) == {**BIG, "amount": 900}
    rows = store.query_audit(decision="operator", newest_first=False)
    assert [(r.reason, r.args["by"], r.args["edited"]) for r in rows] == [
        ("denied", "bob", None), ("edited", "alice", ["amount"])]
    with pytest.raises(UnknownApproval) as unknown:
        book.decide("ap_missing", "approve")
    assert unknown.value.reason == "unknown_approval"
    with pytest.raises(InvalidResume):
        book.decide(asked.value.approval_id, "approve", args={"amount": 1})


def test_one_request_per_intent_under_concurrency(store) -> None:
    rules = policy()
    book = ApprovalBook(store)
    facts = call(rules, "transfer", BIG)
    ids: list[str] = []
    barrier = threading.Barrier(6)

    def ask() -> None:
        barrier.wait()
        try:
            book.check(rules.tools["transfer"], facts)
        except ApprovalRequired as error:
            ids.append(error.approval_id)

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(ids) == 6 and len(set(ids)) == 1


def test_resume_values() -> None:
    assert parse_resume("approve", approval_id="ap_1") == Resume("approve", "ap_1")
    assert parse_resume({"type": "reject", "message": "no", "by": "bob"}) == Resume(
        "reject", None, None, "bob", "no")
    assert parse_resume({"type": "edit", "edited_action": {"name": "transfer", "args": {"amount": 1}}},
                        approval_id="ap_1").args == {"amount": 1}
    assert parse_resume({"decision": "edit", "args": {"amount": 1}, "approval_id": "ap_1"},
                        approval_id="ap_1").approval_id == "ap_1"
    for bad in ("edit", "yes", 1, None, {"type": "approve", "args": {"a": 1}}, {"type": "edit"},
                {"type": "edit", "args": {}}, {"type": "approve", "by": 7},
                {"type": "approve", "sneaky": True}, {"type": "approve", "note": "x" * 2001},
                {"type": "approve", "approval_id": "ap_2"}):
        with pytest.raises(InvalidResume):
            parse_resume(bad, approval_id="ap_1")


def test_async_twin(store_env: StoreEnv, store) -> None:
    rules = policy()
    facts = call(rules, "wipe", {})

    async def scenario() -> None:
        astore = store_env.open_async()
        try:
            book = AsyncApprovalBook(astore)
            with pytest.raises(ApprovalRequired) as asked:
                await book.check(rules.tools["wipe"], facts)
            assert [r.id for r in await book.pending()] == [asked.value.approval_id]
            resume = parse_resume({"type": "approve", "by": "alice"},
                                  approval_id=asked.value.approval_id)
            approved = await book.check(rules.tools["wipe"], facts, resume=resume)
            assert approved is not None and approved.record.decided_by == "alice"
        finally:
            await astore.close()

    asyncio.run(scenario())
    assert [r.reason for r in store.query_audit(decision="operator")] == ["approved"]


def test_cli_approve_and_deny(tmp_path) -> None:
    url = f"sqlite:///{tmp_path}/store.db"
    store = open_store(url, install=True)
    rules = policy()
    book = ApprovalBook(store)
    runner = CliRunner()
    try:
        first, second = call(rules, "transfer", BIG), call(rules, "wipe", {})
        ids = []
        for facts in (first, second):
            with pytest.raises(ApprovalRequired) as asked:
                book.check(rules.tools[facts.tool], facts)
            ids.append(asked.value.approval_id)
        listed = runner.invoke(app, ["approve", "--url", url])
        assert listed.exit_code == 0, listed.output
        assert ids[0] in listed.stdout and ids[1] in listed.stdout
        assert '"memo": "[redacted]"' in listed.stdout and "amount > 1000" in listed.stdout
        done = runner.invoke(app, ["approve", ids[0], "--by", "alice", "--args", '{"amount": 900}',
                                   "--url", url])
        assert done.exit_code == 0, done.output
        assert "approved with changes" in done.stdout and "decided by alice" in done.stdout
        approved = book.check(rules.tools["transfer"], first)
        assert approved is not None and approved.args(BIG)["amount"] == 900
        denied = runner.invoke(app, ["deny", ids[1], "--by", "bob", "--note", "no", "--url", url])
        assert denied.exit_code == 0 and "denied" in denied.stdout
        with pytest.raises(ApprovalDenied):
            book.check(rules.tools["wipe"], second)
        assert runner.invoke(app, ["approve", ids[1], "--url", url]).exit_code == 1  # decided
        assert runner.invoke(app, ["approve", "ap_nope", "--url", url]).exit_code == 2
        assert runner.invoke(app, ["approve", ids[0], "--args", "[1]", "--url", url]).exit_code == 2
        assert "No call is waiting" in runner.invoke(app, ["approve", "--url", url]).stdout
    finally:
        store.close()
