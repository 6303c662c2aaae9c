"""The async stores: the same contract through ``open_async_store``.

Each test runs its own event loop (``asyncio.run``) and opens the async store
inside it: psycopg's async pool belongs to the loop that opened it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from store.envs import StoreEnv, adeposit, create_ledger, ledger_state
from toolguard.errors import (
    BackendUnavailable,
    DuplicateIntent,
    IdempotencyConflict,
    StaleFencingToken,
)
from toolguard.store import (
    AsyncGuardedStore,
    AuditEntry,
    Begun,
    GuardedStore,
    IntentRecord,
    Replay,
    latest_version,
    open_async_store,
)
from toolguard.store.recovery import arun_fenced


def record(key: str = "a-1", args_hash: str = "h") -> IntentRecord:
    return IntentRecord(tool="deposit", idempotency_key=key, args_hash=args_hash, agent="async-agent",
                        keys=("acct:a",), intent_id=f"call-{key}")


def run(env: StoreEnv, scenario: Callable[[AsyncGuardedStore], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        store = env.open_async()
        try:
            assert await store.install() == latest_version(env.kind)
            return await scenario(store)
        finally:
            await store.close()

    return asyncio.run(main())


@pytest.fixture
def ledger(store: GuardedStore) -> GuardedStore:
    create_ledger(store, ["a", "b"])
    return store


def test_async_fenced_write_replay_and_conflict(env: StoreEnv, ledger: GuardedStore) -> None:
    async def scenario(store: AsyncGuardedStore) -> None:
        assert await store.schema_version() == latest_version(store.dialect)
        assert await store.begin_intent(record()) == Begun("a-1", 1, None)
        async with store.fenced({"acct:a": 10}, record()) as tx:
            tx.record(await adeposit(tx, "a", 5, "first"))
        assert await store.begin_intent(record()) == Replay("a-1", 5, 1)
        with pytest.raises(IdempotencyConflict):
            await store.begin_intent(record(args_hash="other"))
        with pytest.raises(DuplicateIntent):
            async with store.fenced({"acct:a": 11}, record()) as tx:
                await adeposit(tx, "a", 5, "again")
        assert await store.high_water("acct:a") == 11  # the replay's fence advance stays
        assert await store.high_waters(["acct:a", "acct:z"]) == {"acct:a": 11}
        assert await store.has_applied("deposit", "acct:a")
        assert not await store.has_applied("deposit", "acct:b")

    run(env, scenario)
    assert ledger_state(ledger)[0]["a"] == (5, 1)
    assert [(e.decision, e.reason) for e in ledger.query_audit(newest_first=False)] == [
        ("accepted", "applied"), ("replayed", "duplicate")]


def test_async_stale_is_rejected_and_audited(env: StoreEnv, ledger: GuardedStore) -> None:
    async def scenario(store: AsyncGuardedStore) -> StaleFencingToken:
        async with store.fenced({"acct:a": 20}) as tx:
            await adeposit(tx, "a", 1, "ok")
        with pytest.raises(StaleFencingToken) as caught:
            async with store.fenced({"acct:a": 19}, record("a-stale")) as tx:
                await adeposit(tx, "a", 100, "stale")
        return caught.value

    error = run(env, scenario)
    assert (error.key, error.token, error.current) == ("acct:a", 19, 20)
    assert ledger_state(ledger)[0]["a"] == (1, 1)
    (rejected,) = ledger.query_audit(reason="stale_fencing_token")
    assert rejected.tokens == {"acct:a": 19} and rejected.idempotency_key == "a-stale"


def test_async_cancelled_write_is_unknown_and_rerun_once(env: StoreEnv,
                                                         ledger: GuardedStore) -> None:
    async def scenario(store: AsyncGuardedStore) -> None:
        await store.begin_intent(record("a-cancel"))
        inside = asyncio.Event()

        async def call() -> None:
            async with store.fenced({"acct:a": 1}, record("a-cancel")) as tx:
                await adeposit(tx, "a", 5, "cancelled")
                inside.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(call())
        await inside.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        again = await store.begin_intent(record("a-cancel"))
        assert again == Begun("a-cancel", 2, "unknown")
        async with store.fenced({"acct:a": 2}, record("a-cancel")) as tx:
            tx.record(await adeposit(tx, "a", 5, "rerun"))
        assert await store.mark_unknown("a-cancel") is False

    run(env, scenario)
    assert ledger_state(ledger)[0]["a"] == (5, 1)
    cancelled = ledger.query_audit(decision="unknown")
    assert [(e.reason, e.idempotency_key) for e in cancelled] == [("cancelled", "a-cancel")]


def test_async_audit_and_query(env: StoreEnv, ledger: GuardedStore) -> None:
    async def scenario(store: AsyncGuardedStore) -> list[AuditEntry]:
        await store.audit(AuditEntry(decision="rejected", reason="unknown_tool", tool="rm_rf",
                                     agent="x", keys=("disk:1",)))
        await store.audit(AuditEntry(decision="rejected", reason="lock_timeout", tool="deposit"))
        return await store.query_audit(key="disk:1")

    (entry,) = run(env, scenario)
    assert (entry.reason, entry.tool, entry.keys) == ("unknown_tool", "rm_rf", ("disk:1",))


def test_arun_fenced_with_async_locks(env: StoreEnv, ledger: GuardedStore) -> None:
    key = env.key("acct:a")

    async def scenario(store: AsyncGuardedStore) -> list[Any]:
        locks = env.alocks(ttl_ms=5_000, timeout_s=10)
        try:
            async def one(i: int) -> Any:
                rec = IntentRecord(tool="deposit", idempotency_key=f"{env.prefix}-{i % 4}",
                                   args_hash="h", keys=(key,))
                return await arun_fenced(locks, store, [key],
                                         lambda tx: adeposit(tx, "a", 1, f"t{i}"), intent=rec)

            return list(await asyncio.gather(*(one(i) for i in range(8))))
        finally:
            await locks.aclose()

    outcomes = run(env, scenario)
    assert sum(not o.replayed for o in outcomes) == 4  # four distinct keys, each applied once
    assert sum(o.replayed for o in outcomes) == 4
    balances, log = ledger_state(ledger)
    assert balances["a"] == (4, 4)
    tokens = [token for _, token, _, _ in log["a"]]
    assert tokens == sorted(tokens)


def test_open_async_store_installs_before_the_first_operation(env: StoreEnv) -> None:
    """``open_async_store(install=True)``, like ``open_store(install=True)``; concurrent first
    calls install once."""
    async def main() -> list[Any]:
        store = open_async_store(env.url, install=True, **env.options)
        try:
            first = await asyncio.gather(store.high_water("k"), store.schema_version(),
                                         store.query_audit())
            async with store.fenced({"k": 3}) as tx:
                await tx.execute("SELECT 1")
            return [*first, await store.high_water("k")]
        finally:
            await store.close()

    assert asyncio.run(main()) == [0, latest_version(env.kind), [], 3]
    installed = env.open()
    try:
        assert installed.schema_version() == latest_version(env.kind)
        assert [e.reason for e in installed.query_audit()] == ["applied"]
    finally:
        installed.close()


def test_open_async_store_install_failure_is_raised_by_the_first_call(unique: str) -> None:
    async def main() -> None:
        store = open_async_store("postgresql://postgres@127.0.0.1:1/nowhere", install=True,
                                 timeout_s=0.5)
        try:
            for _ in range(2):  # each call tries again
                with pytest.raises(BackendUnavailable):
                    await store.high_water("k")
        finally:
            await store.close()

    asyncio.run(main())
