"""The quota contract on every backend (Redis, PostgreSQL, SQLite), sync and asyncio."""

from __future__ import annotations

import asyncio
import time

import pytest

from quotas.envs import QuotaEnv, facts, rule
from toolguard.controls.quotas import AsyncQuotas, Quotas, charges
from toolguard.errors import BudgetExceeded, InFlightLimited, RateLimited

PAY = [{"calls": 3, "window": "1m", "per": "agent"},
       {"budget": 100, "arg": "amount", "window": "1h", "per": "key"},
       {"in_flight": 2, "per": "tool", "lease": "1m"}]


def usage(backend, scope_of, tool_rule) -> dict[str, float]:
    return {c.kind: backend.usage(c.scope) for c in charges(tool_rule, scope_of)}


def test_all_or_nothing_and_what_each_refusal_says(quota_env: QuotaEnv) -> None:
    backend, closing = quota_env.open()
    try:
        pay = rule(PAY)
        quotas = Quotas(backend)
        first = quotas.admit(pay, facts(amount=60))
        assert usage(backend, facts(), pay) == {"rate": 1, "budget": 60, "in_flight": 1}
        with pytest.raises(BudgetExceeded) as caught:
            quotas.admit(pay, facts(amount=50))
        assert 3500 < caught.value.retry_after_s <= 3600  # when the 60 leaves the window
        # nothing of the refused call was counted: not its rate, not its slot
        assert usage(backend, facts(), pay) == {"rate": 1, "budget": 60, "in_flight": 1}
        second = quotas.admit(pay, facts(amount=40))
        with pytest.raises(InFlightLimited) as slot:
            quotas.admit(pay, facts(amount=0))
        assert 0 < slot.value.retry_after_s <= 1
        first.finish(applied=True)  # its slot is free, its budget and rate stay drawn
        assert usage(backend, facts(), pay) == {"rate": 2, "budget": 100, "in_flight": 1}
        third = quotas.admit(pay, facts(amount=0))
        second.finish(applied=True)
        with pytest.raises(RateLimited) as rate:
            quotas.admit(pay, facts(amount=0))
        assert rate.value.reason == "rate_limited" and 50 < rate.value.retry_after_s <= 60
        third.finish(applied=False)
        with pytest.raises(BudgetExceeded) as never:
            quotas.admit(rule([PAY[1]]), facts(amount=101))
        assert never.value.retry_after_s is None
    finally:
        closing.close()


def test_a_retried_intent_is_counted_once_and_refunds_only_its_own(quota_env: QuotaEnv) -> None:
    backend, closing = quota_env.open()
    try:
        pay = rule(PAY[:2])
        quotas = Quotas(backend)
        original = quotas.admit(pay, facts(key="intent-1", amount=70))
        retry = quotas.admit(pay, facts(key="intent-1", amount=70))  # same intent, tried again
        assert usage(backend, facts(), pay) == {"rate": 1, "budget": 70}
        assert retry.held.fresh == (False, False)
        assert retry.finish(applied=False) == 0  # a replay gives back nothing it did not take
        assert usage(backend, facts(), pay) == {"rate": 1, "budget": 70}
        assert original.finish(applied=False) == 1  # the budget comes back, the rate stays
        assert original.finish(applied=False) == 0  # idempotent
        assert usage(backend, facts(), pay) == {"rate": 1, "budget": 0}
    finally:
        closing.close()


def test_windows_slide(quota_env: QuotaEnv) -> None:
    backend, closing = quota_env.open()
    try:
        burst = rule([{"calls": 2, "window": "600ms"}])
        quotas = Quotas(backend)
        quotas.admit(burst, facts())
        time.sleep(0.3)
        quotas.admit(burst, facts())
        with pytest.raises(RateLimited) as caught:
            quotas.admit(burst, facts())
        wait = caught.value.retry_after_s
        assert 0 < wait <= 0.6
        time.sleep(wait + 0.05)  # the first call left the window; the second has not
        quotas.admit(burst, facts())
        with pytest.raises(RateLimited):
            quotas.admit(burst, facts())
    finally:
        closing.close()


def test_in_flight_slots_are_leases(quota_env: QuotaEnv) -> None:
    backend, closing = quota_env.open()
    try:
        slots = rule([{"in_flight": 1, "lease": "700ms"}])
        quotas = Quotas(backend)
        running = quotas.admit(slots, facts())
        for _ in range(3):  # renewed past its first lease: still counted
            time.sleep(0.35)
            assert running.renew()
        with pytest.raises(InFlightLimited):
            quotas.admit(slots, facts())
        time.sleep(0.8)  # not renewed: the slot frees itself (a dead holder's comes back)
        late = quotas.admit(slots, facts())
        assert not running.renew()  # renewed too late: lost, and the slot is taken
        late.finish(applied=True)
        # a live holder that renews late takes its slot again when it is free
        time.sleep(0.8)
        assert not running.renew()
        with pytest.raises(InFlightLimited):  # the late holder is counted again
            quotas.admit(slots, facts())
        assert running.finish(applied=True) == 1
        quotas.admit(slots, facts())
    finally:
        closing.close()


def test_scopes_are_counted_apart(quota_env: QuotaEnv) -> None:
    backend, closing = quota_env.open()
    try:
        per_key = rule([{"calls": 1, "window": "1m", "per": ["agent", "key"]}])
        quotas = Quotas(backend)
        quotas.admit(per_key, facts(agent="a", keys=("acct:~i1",)))
        quotas.admit(per_key, facts(agent="b", keys=("acct:~i1",)))
        quotas.admit(per_key, facts(agent="a", keys=("acct:~i2",)))
        with pytest.raises(RateLimited) as caught:  # one of the call's two keys is used up
            quotas.admit(per_key, facts(agent="a", keys=("acct:~i2", "acct:~i3")))
        assert caught.value.scope == "agent=a, key=acct:~i2"
        quotas.admit(per_key, facts(agent="a", keys=("acct:~i3",)))  # ~i3 was not counted
    finally:
        closing.close()


def test_fractional_budgets_add_up(quota_env: QuotaEnv) -> None:
    backend, closing = quota_env.open()
    try:
        cents = rule([{"budget": 1, "arg": "amount", "window": "1h"}])
        quotas = Quotas(backend)
        admitted = [quotas.admit(cents, facts(amount=0.1)) for _ in range(10)]
        with pytest.raises(BudgetExceeded):
            quotas.admit(cents, facts(amount=0.1))
        for admission in admitted[:5]:
            admission.finish(applied=False)
        assert backend.usage(admitted[0].charges[0].scope) == pytest.approx(0.5)
    finally:
        closing.close()


def test_async_twin(quota_env: QuotaEnv) -> None:
    async def scenario() -> None:
        backend, closing = quota_env.open_async()
        try:
            pay = rule(PAY)
            quotas = AsyncQuotas(backend)
            admitted = await asyncio.gather(*(quotas.admit(pay, facts(amount=10)) for _ in range(2)))
            with pytest.raises(InFlightLimited):
                await quotas.admit(pay, facts(amount=10))
            assert await admitted[0].renew()
            await admitted[0].finish(applied=False)
            third = await quotas.admit(pay, facts(amount=10))
            with pytest.raises(RateLimited):
                await quotas.admit(pay, facts(amount=10))
            await third.finish(applied=True)
            assert [await backend.usage(c.scope) for c in third.charges] == [20, 1, 3]
        finally:
            await closing.aclose()

    asyncio.run(scenario())


def test_an_attempt_that_applied_on_a_shared_entry_keeps_it_drawn(quota_env: QuotaEnv) -> None:
    """Two attempts of one intent at once: the first (which counted the entry) fails and is
    refunded, the second (which found it counted) applies. The budget stays drawn once."""
    backend, closing = quota_env.open()
    try:
        pay = rule(PAY[:2])
        quotas = Quotas(backend)
        first = quotas.admit(pay, facts(key="intent-1", amount=70))
        second = quotas.admit(pay, facts(key="intent-1", amount=70))
        assert second.held.fresh == (False, False)
        first.finish(applied=False)  # refunded: its budget entry is gone
        second.finish(applied=True)  # applied on that entry: it is drawn again
        assert usage(backend, facts(), pay) == {"rate": 1, "budget": 70}
        with pytest.raises(BudgetExceeded):  # 70 + 40 > 100: the applied call is counted
            quotas.admit(pay, facts(amount=40))
    finally:
        closing.close()
