"""What a call draws on its quotas (pure): scopes, costs, refusals."""

from __future__ import annotations

import pytest

from quotas.envs import facts, rule
from toolguard.controls.quotas import IN_FLIGHT_RETRY_S, charges, refusal, scope_name
from toolguard.errors import BudgetExceeded, InFlightLimited, InvalidArguments, RateLimited


def test_one_charge_per_quota_and_scope_value_sorted() -> None:
    pay = rule([{"calls": 5, "window": "1m", "per": "agent"},
                {"in_flight": 2, "per": ["key", "agent"]},
                {"budget": 100, "arg": "amount", "window": "1d", "per": "workflow"}],
               locks=("acct:{id}", "acct:{to}"))
    call = facts(amount=7, keys=("acct:~i1", "acct:~i2"))
    found = charges(pay, call)
    assert [c.scope for c in found] == sorted(c.scope for c in found)
    by_kind = {kind: [c for c in found if c.kind == kind] for kind in ("rate", "in_flight", "budget")}
    assert [c.scope for c in by_kind["rate"]] == ["pay/rate/60s/agent|agent=agent-a"]
    assert [c.where for c in by_kind["in_flight"]] == ["agent=agent-a, key=acct:~i1",
                                                       "agent=agent-a, key=acct:~i2"]
    assert [(c.cost, c.limit, c.ttl_ms) for c in by_kind["budget"]] == [(7.0, 100.0, 86_400_000)]
    # rate and budget entries are the intent's; in-flight slots are this attempt's
    assert {c.entry for c in found if c.kind != "in_flight"} == {f"i:{call.idempotency_key}"}
    assert {c.entry for c in found if c.kind == "in_flight"} == {f"a:{call.attempt}"}


def test_scopes_cannot_collide() -> None:
    """Two different (counter, values) never share a scope name, whatever the text."""
    names = {
        scope_name("a", [("agent", "b|agent=c")]),
        scope_name("a|agent=b", [("agent", "c")]),
        scope_name("a", [("agent", "b"), ("key", "c")]),
        scope_name("a", [("agent", None)]),
        scope_name("a", [("agent", "~")]),
        scope_name("a", [("agent", "%7E")]),
        scope_name("a", [("agent", "")]),
    }
    assert len(names) == 7


def test_named_quotas_share_a_counter_across_tools() -> None:
    quota = [{"name": "pay", "calls": 5, "window": "1m", "per": "agent"}]
    first = charges(rule(quota, name="transfer"), facts(tool="transfer"))
    second = charges(rule(quota, name="refund"), facts(tool="refund"))
    assert first[0].scope == second[0].scope == "pay|agent=agent-a"
    unnamed = [{"calls": 5, "window": "1m", "per": "agent"}]
    assert (charges(rule(unnamed, name="transfer"), facts())[0].scope
            != charges(rule(unnamed, name="refund"), facts())[0].scope)


def test_budget_amounts() -> None:
    items = rule([{"budget": 100, "arg": "items[*].price", "window": "1h"}])
    call = facts(args={"id": 1, "items": [{"price": 2}, {"price": 3.5}, {"price": None}, {}]})
    assert [c.cost for c in charges(items, call)] == [5.5]
    amount = rule([{"budget": 100, "arg": "amount", "window": "1h"}])
    assert charges(amount, facts(args={"id": 1})) == ()  # nothing drawn: no round trip
    assert charges(amount, facts(amount=0)) == ()
    for bad in (-1, "5", True, float("nan"), [1]):
        with pytest.raises(InvalidArguments, match=r"args\.amount"):
            charges(amount, facts(amount=bad))


def test_calls_without_agent_or_workflow_count_apart_from_named_ones() -> None:
    per = rule([{"calls": 5, "window": "1m", "per": ["agent", "workflow"]}])
    anonymous = charges(per, facts(agent=None, workflow=None))[0]
    assert anonymous.scope.endswith("|agent=~|workflow=~") and "(none)" in anonymous.where
    assert anonymous.scope != charges(per, facts(agent="~", workflow="~"))[0].scope


def test_refusals_say_what_and_when() -> None:
    quotas = rule([{"calls": 5, "window": "1m", "per": "agent"}, {"in_flight": 1, "lease": "5m"},
                   {"budget": 100, "arg": "amount", "window": "1d"}])
    call = facts(amount=20)
    budget, flight, rate = charges(quotas, call)
    error = refusal(rate, 12.5, call)
    assert isinstance(error, RateLimited) and error.reason == "rate_limited"
    assert error.retry_after_s == 12.5 and error.scope == "agent=agent-a"
    assert "allows 5 calls per 60s (agent=agent-a); retry in 12.5s" in error.message
    slot = refusal(flight, 300.0, call)
    assert isinstance(slot, InFlightLimited) and slot.reason == "in_flight_limited"
    assert slot.retry_after_s == IN_FLIGHT_RETRY_S  # a slot frees when a call ends, not at the lease
    never = refusal(budget, None, call)
    assert isinstance(never, BudgetExceeded) and never.retry_after_s is None
    assert "would draw 20 of amount" in never.message and "can never fit" in never.message


def test_hostile_budget_amounts_never_reach_a_backend() -> None:
    """Amounts past float's range are over any budget; hostile types and signs are refused."""
    amount = rule([{"calls": 5, "window": "1m"}, {"budget": 100, "arg": "amount", "window": "1h"}])
    items = rule([{"budget": 100, "arg": "items[*].price", "window": "1h"}])
    huge = [facts(amount=10**400),
            facts(args={"id": 1, "items": [{"price": 1e308}, {"price": 1e308}]}),
            facts(amount=101)]
    for call in huge:
        with pytest.raises(BudgetExceeded) as caught:
            charges(amount if "amount" in call.args else items, call)
        assert caught.value.retry_after_s is None and "can never fit" in caught.value.message
    for bad in (-(10**400), -0.5, float("inf"), float("-inf"), "1e3", {"amount": 1}):
        with pytest.raises(InvalidArguments, match=r"args\.amount"):
            charges(amount, facts(amount=bad))
    assert charges(amount, facts(amount=-0.0))[0].kind == "rate"  # nothing drawn from the budget
    assert sorted(c.cost for c in charges(amount, facts(amount=10**15 // 10**14))) == [1.0, 10.0]


def test_a_named_counter_survives_a_change_of_its_window_and_an_unnamed_one_does_not() -> None:
    """What docs/policies.md tells a user reloading a policy: only a name keeps the counter."""
    before = charges(rule([{"name": "spend", "budget": 100, "arg": "amount", "window": "1d"}]),
                     facts(amount=5))[0]
    after = charges(rule([{"name": "spend", "budget": 100, "arg": "amount", "window": "23h"}]),
                    facts(amount=5))[0]
    assert before.scope == after.scope
    unnamed = [charges(rule([{"budget": 100, "arg": "amount", "window": w}]), facts(amount=5))[0]
               for w in ("1d", "23h")]
    assert unnamed[0].scope != unnamed[1].scope
