"""Fail closed on a missing row: ``tx.execute(..., expect_rows=n)`` on both stores, sync and async.

A tool's UPDATE that matches no row would otherwise commit as applied: the
seed's "missing row is a silent no-op", one level up.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from store.envs import StoreEnv, create_ledger, ledger_state, rows
from toolguard.errors import ConfigurationError, RecordNotFound, TooManyRows
from toolguard.store import GuardedStore, IntentRecord

UPDATE = "UPDATE ledger_account SET balance = balance + %s WHERE id = %s"


def record(key: str) -> IntentRecord:
    return IntentRecord(tool="deposit", idempotency_key=key, args_hash="h", keys=("acct:a",),
                        intent_id=f"call-{key}")


@pytest.fixture
def ledger(store: GuardedStore) -> GuardedStore:
    create_ledger(store, ["a", "b"])
    return store


def intent_status(store: GuardedStore, key: str) -> list[tuple[Any, ...]]:
    return rows(store, "SELECT status FROM toolguard_intent WHERE idempotency_key = %s", (key,))


def test_update_of_a_missing_row_is_refused_rolled_back_and_audited(ledger: GuardedStore) -> None:
    with pytest.raises(RecordNotFound) as caught, ledger.fenced({"acct:a": 3}, record("m1")) as tx:
        tx.execute(UPDATE, (5, "a"), expect_rows=1)  # applied, then undone by the rollback
        tx.execute(UPDATE, (5, "nobody"), expect_rows=1)
        pytest.fail("execute must raise on a missing row")
    error = caught.value
    assert (error.reason, error.expected, error.actual) == ("not_found", 1, 0)
    assert "UPDATE ledger_account" in str(error)
    assert ledger_state(ledger)[0] == {"a": (0, 0), "b": (0, 0)}
    assert ledger.high_water("acct:a") == 0
    (entry,) = ledger.query_audit(limit=None)
    assert (entry.decision, entry.reason, entry.idempotency_key) == ("failed", "not_found", "m1")
    assert intent_status(ledger, "m1") == [("failed",)]
    # the next attempt of the same intent runs (it was never applied)
    with ledger.fenced({"acct:a": 4}, record("m1")) as tx:
        tx.execute(UPDATE, (5, "a"), expect_rows=1)
        tx.record("ok")
    assert intent_status(ledger, "m1") == [("applied",)]
    assert ledger_state(ledger)[0]["a"] == (5, 0)


def test_a_tool_that_swallows_the_error_still_cannot_commit(ledger: GuardedStore) -> None:
    with pytest.raises(RecordNotFound), ledger.fenced({"acct:a": 1}, record("m2")) as tx:
        tx.execute(UPDATE, (1, "a"))
        with contextlib.suppress(RecordNotFound):
            tx.execute(UPDATE, (1, "nobody"), expect_rows=1)
    assert ledger_state(ledger)[0]["a"] == (0, 0)
    assert [e.reason for e in ledger.query_audit(limit=None)] == ["not_found"]


def test_more_rows_than_expected_is_refused_too(ledger: GuardedStore) -> None:
    with pytest.raises(TooManyRows) as caught, ledger.fenced({"acct:a": 1}) as tx:
        tx.execute("UPDATE ledger_account SET balance = 1", expect_rows=1)
    assert (caught.value.expected, caught.value.actual) == (1, 2)
    assert ledger_state(ledger)[0] == {"a": (0, 0), "b": (0, 0)}
    assert [(e.decision, e.reason) for e in ledger.query_audit()] == [("failed", "too_many_rows")]


def test_rows_returned_are_counted_and_still_readable(ledger: GuardedStore) -> None:
    with ledger.fenced({"acct:a": 1}) as tx:
        cursor = tx.execute("SELECT balance FROM ledger_account WHERE id = %s", ("a",),
                            expect_rows=1)
        assert cursor.fetchone() == (0,) and cursor.fetchone() is None
        returned = tx.execute("UPDATE ledger_account SET version = version + 1 RETURNING id",
                              expect_rows=2)
        assert sorted(row[0] for row in returned.fetchall()) == ["a", "b"]
        deleted = tx.execute("DELETE FROM ledger_account WHERE id = %s", ("nobody",),
                             expect_rows=0)
        assert deleted.rowcount == 0
    with pytest.raises(RecordNotFound), ledger.fenced({"acct:a": 1}) as tx:
        tx.execute("SELECT balance FROM ledger_account WHERE id = %s", ("nobody",), expect_rows=1)
    assert ledger_state(ledger)[0] == {"a": (0, 1), "b": (0, 1)}


@pytest.mark.parametrize("bad", [True, -1, "1", 1.0])
def test_expect_rows_must_be_a_count(ledger: GuardedStore, bad: object) -> None:
    with pytest.raises(ConfigurationError), ledger.fenced({"acct:a": 1}) as tx:
        tx.execute(UPDATE, (1, "a"), expect_rows=bad)  # type: ignore[arg-type]
    assert ledger_state(ledger)[0]["a"] == (0, 0)


def test_async_missing_row_is_refused(env: StoreEnv, ledger: GuardedStore) -> None:
    async def scenario() -> None:
        store = env.open_async()
        try:
            with pytest.raises(RecordNotFound):
                async with store.fenced({"acct:a": 2}, record("am")) as tx:
                    await tx.execute(UPDATE, (7, "a"), expect_rows=1)
                    await tx.execute(UPDATE, (7, "nobody"), expect_rows=1)
            async with store.fenced({"acct:a": 2}) as tx:
                cursor = await tx.execute("SELECT id FROM ledger_account ORDER BY id",
                                          expect_rows=2)
                assert await cursor.fetchall() == [("a",), ("b",)]
                await tx.execute(UPDATE, (7, "b"), expect_rows=1)
            with pytest.raises(TooManyRows):
                async with store.fenced({"acct:a": 2}) as tx:
                    await tx.execute("UPDATE ledger_account SET version = 9 RETURNING id",
                                     expect_rows=1)
        finally:
            await store.close()

    asyncio.run(scenario())
    assert ledger_state(ledger)[0] == {"a": (0, 0), "b": (7, 0)}
    assert [e.reason for e in ledger.query_audit(limit=None, newest_first=False)] == [
        "not_found", "applied", "too_many_rows"]
    assert intent_status(ledger, "am") == [("failed",)]
