"""The low-level path is as safe as ``ToolGuard.run``: ``store.fenced(lease, intent)``.

With a lease, the store checks it before the commit (and at entry), so a
holder whose lease ran out while the tool ran cannot commit; and
``reseed_if_regressed`` gives "acquire now, write later" the same recovery as
``run_fenced`` when the lock server went backwards.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from store.envs import StoreEnv, adeposit, create_ledger, deposit, ledger_state, rows
from toolguard.errors import InvalidFencingToken, LockLost, StaleFencingToken
from toolguard.locks import Lease, heartbeat
from toolguard.store import (
    GuardedStore,
    IntentRecord,
    areseed_if_regressed,
    reseed_if_regressed,
)

TTL_MS = 300


def record(key: str) -> IntentRecord:
    return IntentRecord(tool="deposit", idempotency_key=key, args_hash="h", intent_id=f"call-{key}")


@pytest.fixture
def ledger(store: GuardedStore) -> GuardedStore:
    create_ledger(store, ["a"])
    return store


def expire(lease: Lease) -> None:
    """Stop renewing ``lease`` and wait until it ran out (a GC pause, a slow tool)."""
    heartbeat().remove(lease)
    time.sleep(TTL_MS / 1000 + 0.05)


def status(store: GuardedStore, key: str) -> list[tuple[Any, ...]]:
    return rows(store, "SELECT status FROM toolguard_intent WHERE idempotency_key = %s", (key,))


def test_a_held_lease_commits_and_is_on_the_transaction(env: StoreEnv, ledger: GuardedStore) -> None:
    key = env.key("acct:a")
    with env.locks(ttl_ms=5_000) as locks, locks.acquire([key]) as lease:
        with ledger.fenced(lease, record("held")) as tx:
            assert tx.lease is lease and dict(tx.tokens) == dict(lease.tokens)
            tx.record(deposit(tx, "a", 5, "held"))
        # the mapping form still works
        with ledger.fenced(lease.tokens) as tx:
            assert tx.lease is None
            deposit(tx, "a", 1, "tokens")
    assert ledger_state(ledger)[0]["a"] == (6, 2)
    assert status(ledger, "held") == [("applied",)]


def test_a_lease_lost_inside_the_transaction_cannot_commit(env: StoreEnv,
                                                          ledger: GuardedStore) -> None:
    key = env.key("acct:a")
    with env.locks(ttl_ms=TTL_MS) as locks:
        lease = locks.acquire([key])
        try:
            with pytest.raises(LockLost), ledger.fenced(lease, record("late")) as tx:
                deposit(tx, "a", 5, "late")
                expire(lease)  # nobody else wrote: only the lease check can refuse this commit
        finally:
            lease.release()
    assert ledger_state(ledger)[0]["a"] == (0, 0)
    assert ledger.high_water(key) == 0
    (entry,) = ledger.query_audit(limit=None)
    assert (entry.decision, entry.reason, entry.idempotency_key) == ("rejected", "lease_lost", "late")
    assert status(ledger, "late") == [("failed",)]


@pytest.mark.parametrize("how", ["lost", "released"])
def test_a_lease_gone_before_entry_cannot_commit(env: StoreEnv, ledger: GuardedStore,
                                                 how: str) -> None:
    key = env.key("acct:a")
    with env.locks(ttl_ms=TTL_MS) as locks:
        lease = locks.acquire([key])
        if how == "lost":
            expire(lease)
        lease.release()
        # Nobody wrote since, so the fence lets it in; the lease check refuses the commit.
        with pytest.raises(LockLost), ledger.fenced(lease, record(how)) as tx:
            deposit(tx, "a", 5, how)
    assert ledger.high_water(key) == 0
    assert ledger_state(ledger)[0]["a"] == (0, 0)
    assert [(e.decision, e.reason) for e in ledger.query_audit(limit=None)] == [
        ("rejected", "lease_lost")]


def test_something_else_than_a_lease_or_tokens_is_refused(ledger: GuardedStore) -> None:
    with pytest.raises(InvalidFencingToken), ledger.fenced([("acct:a", 1)]):  # type: ignore[arg-type]
        pytest.fail("must not run")
    assert [e.reason for e in ledger.query_audit()] == ["invalid_fencing_token"]


def test_async_lease_lost_inside_the_transaction_cannot_commit(env: StoreEnv,
                                                              ledger: GuardedStore) -> None:
    key = env.key("acct:a")

    async def scenario() -> None:
        store = env.open_async()
        locks = env.alocks(ttl_ms=TTL_MS)
        try:
            lease = await locks.acquire([key])
            try:
                with pytest.raises(LockLost):
                    async with store.fenced(lease, record("alate")) as tx:
                        assert tx.lease is lease
                        await adeposit(tx, "a", 5, "alate")
                        heartbeat().remove(lease)
                        await asyncio.sleep(TTL_MS / 1000 + 0.05)
            finally:
                await lease.arelease()
            lease = await locks.acquire([key], ttl_ms=5_000)
            try:
                async with store.fenced(lease, record("aok")) as tx:
                    tx.record(await adeposit(tx, "a", 2, "aok"))
            finally:
                await lease.arelease()
        finally:
            await locks.aclose()
            await store.close()

    asyncio.run(scenario())
    assert ledger_state(ledger)[0]["a"] == (2, 1)
    assert [(e.reason, e.idempotency_key) for e in ledger.query_audit(newest_first=False)] == [
        ("lease_lost", "alate"), ("applied", "aok")]


# --- acquire now, write later: the re-seed step on its own ------------------------------------------


def _push_high_water(store: GuardedStore, key: str) -> int:
    """The store accepted a token from a clock an hour ahead: the lock server now lags behind it."""
    future = time.time_ns() // 1000 + 3600 * 1_000_000
    with store.fenced({key: future}):
        pass
    return future


def test_reseed_if_regressed_lets_a_lease_holder_recover(env: StoreEnv, ledger: GuardedStore) -> None:
    key = env.key("acct:a")
    future = _push_high_water(ledger, key)
    with env.locks(ttl_ms=5_000, timeout_s=5) as locks:
        with locks.acquire([key]) as lease:
            with pytest.raises(StaleFencingToken) as caught, \
                    ledger.fenced(lease, record("behind")) as tx:
                deposit(tx, "a", 1, "behind")
            assert reseed_if_regressed(locks, ledger, lease, caught.value)
        # once released, the same refusal no longer proves a regression
        assert not reseed_if_regressed(locks, ledger, lease, caught.value)
        with locks.acquire([key]) as again:
            assert again.tokens[key] > future
            with ledger.fenced(again, record("behind")) as tx:
                tx.record(deposit(tx, "a", 1, "behind"))
        # a lease that was lost is a genuine stale holder: nothing to re-seed, the refusal stands
        lost = locks.acquire([key], ttl_ms=TTL_MS)
        expire(lost)
        stale = StaleFencingToken("x", key=key, token=lost.tokens[key], current=future)
        assert not reseed_if_regressed(locks, ledger, lost, stale)
        lost.release()
    assert ledger_state(ledger)[0]["a"] == (1, 1)
    assert status(ledger, "behind") == [("applied",)]


def test_areseed_if_regressed(env: StoreEnv, ledger: GuardedStore) -> None:
    key = env.key("acct:a")
    future = _push_high_water(ledger, key)

    async def scenario() -> int:
        store = env.open_async()
        locks = env.alocks(ttl_ms=5_000, timeout_s=5)
        try:
            lease = await locks.acquire([key])
            try:
                with pytest.raises(StaleFencingToken) as caught:
                    async with store.fenced(lease) as tx:
                        await adeposit(tx, "a", 1, "abehind")
                assert await areseed_if_regressed(locks, store, lease, caught.value)
            finally:
                await lease.arelease()
            lease = await locks.acquire([key])
            try:
                async with store.fenced(lease) as tx:
                    return await adeposit(tx, "a", 3, "abehind")
            finally:
                await lease.arelease()
        finally:
            await locks.aclose()
            await store.close()

    assert asyncio.run(scenario()) == 3
    assert ledger.high_water(key) > future
