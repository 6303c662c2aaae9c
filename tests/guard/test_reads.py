"""Decisions across tool calls: what a caller read is checked when it writes.

Every test runs on both setups (SQLite, and Redis locks + PostgreSQL). The
control tests show the anomaly with the per-call guard alone: each write is
serialized and fenced, and an update is still lost.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from guard.harness import Harness
from guard.reads_world import CHECKED, UNCHECKED, Agent, Bank, decide_to_deposit
from toolguard.errors import PolicyProblems
from toolguard.policies import Policy


def _rows_per_call(h: Harness, agents: list[Agent]) -> dict[str, list[tuple[str, str]]]:
    """Every call's audit rows (decision, reason), by call id."""
    return {d.intent.call_id or "": h.decisions(d.intent.call_id or "")
            for agent in agents for d in agent.decisions}


def test_control_the_per_call_guard_loses_an_update(harness: Any) -> None:
    h: Harness = harness(UNCHECKED)
    bank = Bank(h)
    bank.open({"acct": 100})
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")
    a, b = alice.read("acct"), bob.read("acct")
    assert alice.call("set_balance", account_id="acct", balance=a + 25).ok
    assert bob.call("set_balance", account_id="acct", balance=b + 30).ok
    assert bank.balances("acct") == {"acct": 130}  # alice's +25 is lost


def test_a_write_on_a_stale_read_is_refused_and_decided_again(harness: Any) -> None:
    h: Harness = harness(CHECKED)
    bank = Bank(h)
    bank.open({"acct": 100})
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")
    a, b = alice.read("acct"), bob.read("acct")
    assert alice.call("set_balance", account_id="acct", balance=a + 25).ok
    refused = bob.call("set_balance", account_id="acct", balance=b + 30)
    assert (refused.kind, refused.reason) == ("rejected", "stale_read")
    assert bank.balances("acct") == {"acct": 125}  # nothing of bob's applied
    text = refused.model_text()
    assert "account:acct changed since you read it" in text and "Read it again" in text
    assert "version" not in text and "alice" not in text  # the operator's words stay out
    row = h.audit(intent_id=refused.intent.call_id)
    assert [(r.decision, r.reason) for r in row] == [("rejected", "stale_read")]
    assert "read at version 0, now 1" in (row[0].detail or "")
    assert "alice" in (row[0].detail or "")  # who wrote in between, for the operator
    # the refusal recorded nothing: bob is still stale until it reads again
    assert bob.call("set_balance", account_id="acct", balance=b + 30).reason == "stale_read"
    assert decide_to_deposit(bob, "acct", 30).ok
    assert bank.balances("acct") == {"acct": 155}
    assert all(len(rows) == 1 for rows in _rows_per_call(h, [alice, bob]).values())


def test_requires_read_refuses_a_blind_write(harness: Any) -> None:
    h: Harness = harness(CHECKED)
    bank = Bank(h)
    bank.open({"acct": 100})
    carol = Agent(h, "carol", "t-c")
    blind = carol.call("set_balance", account_id="acct", balance=1)
    assert (blind.kind, blind.reason) == ("rejected", "unread")
    assert "needs a current read of account:acct" in blind.model_text()
    assert bank.balances("acct") == {"acct": 100}
    assert h.decisions(blind.intent.call_id or "") == [("rejected", "unread")]


def test_reads_belong_to_one_agent_in_one_conversation(harness: Any) -> None:
    h: Harness = harness(CHECKED)
    Bank(h).open({"acct": 100})
    alice = Agent(h, "alice", "t-1")
    alice.read("acct")
    other_thread = Agent(h, "alice", "t-2")
    other_agent = Agent(h, "dave", "t-1")
    assert other_thread.call("set_balance", account_id="acct", balance=5).reason == "unread"
    assert other_agent.call("set_balance", account_id="acct", balance=5).reason == "unread"
    assert alice.call("set_balance", account_id="acct", balance=5).ok


def test_an_accepted_write_counts_as_a_read_of_what_it_wrote(harness: Any) -> None:
    h: Harness = harness(CHECKED)
    bank = Bank(h)
    bank.open({"acct": 100})
    alice = Agent(h, "alice", "t-a")
    balance = alice.read("acct")
    assert alice.call("set_balance", account_id="acct", balance=balance + 1).ok
    assert alice.call("set_balance", account_id="acct", balance=balance + 2).ok
    assert bank.balances("acct") == {"acct": 102}


def test_a_replay_returns_its_answer_without_a_new_check(harness: Any) -> None:
    h: Harness = harness(CHECKED)
    Bank(h).open({"acct": 100})
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")
    alice.read("acct")
    first = alice.call("set_balance", "same-call", account_id="acct", balance=110)
    assert first.ok
    assert decide_to_deposit(bob, "acct", 5).ok  # the key moved on since alice's write
    again = alice.call("set_balance", "same-call", account_id="acct", balance=110)
    assert (again.kind, again.reason, again.result) == ("replayed", "duplicate", 110)


def _skew(h: Harness) -> tuple[dict[str, int], list[str]]:
    """Each agent reads both accounts and withdraws from one while their sum stays >= 100."""
    bank = Bank(h)
    bank.open({"x": 60, "y": 60})
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")
    for agent in (alice, bob):
        agent.read("x")
        agent.read("y")
    reasons = []
    for agent, mine, other in ((alice, "x", "y"), (bob, "y", "x")):
        if agent.seen["x"] + agent.seen["y"] - 20 >= 100:  # the model's own check
            reasons.append(agent.call("withdraw", account_id=mine, other_id=other,
                                      amount=20).reason)
    return bank.balances("x", "y"), reasons


def test_control_write_skew_breaks_a_rule_over_two_accounts(harness: Any) -> None:
    balances, reasons = _skew(harness(UNCHECKED))
    assert reasons == ["applied", "applied"] and sum(balances.values()) == 80  # the rule broke


def test_decides_on_stops_write_skew(harness: Any) -> None:
    balances, reasons = _skew(harness(CHECKED))
    assert reasons == ["applied", "stale_read"] and sum(balances.values()) == 100


def test_decides_on_needs_a_read(harness: Any) -> None:
    h: Harness = harness(CHECKED)
    Bank(h).open({"x": 60, "y": 60})
    alice = Agent(h, "alice", "t-a")
    alice.read("x")
    refused = alice.call("withdraw", account_id="x", other_id="y", amount=1)
    assert refused.reason == "unread" and "account:y" in refused.model_text()


def test_shadow_applies_and_audits_the_would_be_refusal(harness: Any) -> None:
    policy = {**CHECKED, "defaults": {"stale_reads": "shadow"}}
    h: Harness = harness(policy)
    bank = Bank(h)
    bank.open({"acct": 100})
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")
    a, b = alice.read("acct"), bob.read("acct")
    assert alice.call("set_balance", account_id="acct", balance=a + 25).ok
    shadowed = bob.call("set_balance", account_id="acct", balance=b + 30)
    assert (shadowed.kind, shadowed.reason) == ("accepted", "applied")
    assert bank.balances("acct") == {"acct": 130}  # applied: shadow measures, never refuses
    assert h.decisions(shadowed.intent.call_id or "") == [("accepted", "applied"),
                                                          ("shadow", "stale_read")]


def test_an_old_read_no_longer_counts(harness: Any) -> None:
    policy = {**CHECKED, "defaults": {"read_ttl_s": 0.2}}
    h: Harness = harness(policy)
    Bank(h).open({"acct": 100})
    alice = Agent(h, "alice", "t-a")
    alice.read("acct")
    time.sleep(0.4)
    assert alice.call("set_balance", account_id="acct", balance=1).reason == "unread"


def test_a_failed_read_records_no_observation(harness: Any) -> None:
    h: Harness = harness(CHECKED)
    Bank(h).open({"acct": 100})
    alice = Agent(h, "alice", "t-a")

    def broken(ctx: Any) -> Any:
        ctx.tx.execute("SELECT score FROM lead WHERE id = %s", (ctx.args["account_id"],))
        raise RuntimeError("the tool failed after reading")

    failed = h.guard.run(alice.intent("get_balance", "r1", account_id="acct"), broken)
    assert failed.kind == "failed"
    assert h.decisions("r1") == [("failed", "error")]
    assert alice.call("set_balance", account_id="acct", balance=1).reason == "unread"


def test_async_path(harness: Any) -> None:
    h: Harness = harness(CHECKED)
    bank = Bank(h)
    bank.open({"acct": 100})
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")

    async def main() -> list[str]:
        async with h.async_edges():
            a = (await alice.acall("get_balance", account_id="acct")).result
            b = (await bob.acall("get_balance", account_id="acct")).result
            first = await alice.acall("set_balance", account_id="acct", balance=a + 25)
            second = await bob.acall("set_balance", account_id="acct", balance=b + 30)
            b = (await bob.acall("get_balance", account_id="acct")).result
            third = await bob.acall("set_balance", account_id="acct", balance=b + 30)
            return [first.reason, second.reason, third.reason]

    assert asyncio.run(main()) == ["applied", "stale_read", "applied"]
    assert bank.balances("acct") == {"acct": 155}
    assert all(len(rows) == 1 for rows in _rows_per_call(h, [alice, bob]).values())


@pytest.mark.parametrize(("tool", "problem"), [
    ({"reads": ["a:{x}"], "locks": ["a:{x}"]}, "either reads (reads:) or writes (locks:)"),
    ({"read_only": True, "requires_read": True}, "requires_read checks a write's reads"),
    ({"read_only": True, "decides_on": ["a:{x}"]}, "decides_on checks a write's reads"),
])
def test_policy_refuses_checks_that_could_never_run(tool: dict[str, Any], problem: str) -> None:
    with pytest.raises(PolicyProblems) as raised:
        Policy.from_dict({"version": 1, "tools": {"t": tool}})
    assert problem in str(raised.value)


def test_read_keys_are_checked_against_the_tool_schema() -> None:
    policy = Policy.from_dict({"version": 1, "tools": {"get": {"reads": ["a:{acount}"]}}})

    def get(account: str) -> int:
        return 0

    with pytest.raises(PolicyProblems, match="acount"):
        policy.check_against({"get": get})


@pytest.mark.parametrize("setup", ["sqlite-store/sqlite-locks", "sqlite-store/etcd-locks",
                                   "postgresql-store/redis-locks",
                                   "postgresql-store/postgres-locks"])
def test_every_lock_backend(case_harness: Any, setup: str) -> None:
    h: Harness = case_harness(setup, CHECKED)
    bank = Bank(h)
    bank.open({"acct": 100})
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")
    a, b = alice.read("acct"), bob.read("acct")
    assert alice.call("set_balance", account_id="acct", balance=a + 25).ok
    assert bob.call("set_balance", account_id="acct", balance=b + 30).reason == "stale_read"
    assert decide_to_deposit(bob, "acct", 30).ok
    assert bank.balances("acct") == {"acct": 155}


def test_guarded_functions_take_the_conversation_from_thread_id(harness: Any) -> None:
    from toolguard.adapters import guarded

    h: Harness = harness(CHECKED)
    bank = Bank(h)
    bank.open({"acct": 100})

    @guarded(h.guard, agent="alice")
    def get_balance(account_id: str) -> int:
        return int(Bank.read_in(account_id))

    @guarded(h.guard, agent="alice")
    def set_balance(account_id: str, balance: int) -> int:
        Bank.write_in(account_id, balance)
        return balance

    seen = get_balance.run({"account_id": "acct"}, call_id="r1", thread_id="t-1").result
    assert set_balance.run({"account_id": "acct", "balance": seen + 1}, call_id="w0",
                           thread_id="t-2").reason == "unread"  # another conversation's read
    assert set_balance.run({"account_id": "acct", "balance": seen + 1}, call_id="w1",
                           thread_id="t-1").ok
    assert bank.balances("acct") == {"acct": 101}


def test_after_a_read_points_at_requires_read() -> None:
    with pytest.raises(PolicyProblems) as raised:
        Policy.from_dict({"version": 1, "tools": {
            "get_balance": {"reads": ["account:{account_id}"]},
            "set_balance": {"locks": ["account:{account_id}"], "after": ["get_balance"]}}})
    assert "requires_read: true" in str(raised.value)
