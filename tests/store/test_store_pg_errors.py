"""PostgreSQL ending a statement of a fenced transaction: a typed error, audited once.

``statement_timeout`` (and a cancel request), a deadlock, a serialization failure
and ``lock_timeout`` all end the statement and roll its transaction back. The
store raises ``TransactionAborted`` subclasses with their own reason codes, never
the raw psycopg error, and writes exactly one ``failed`` audit row for the attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from store.envs import StoreEnv, create_ledger, deposit, ledger_state, rows
from toolguard.errors import StoreError
from toolguard.store import GuardedStore, IntentRecord, open_store
from toolguard.store.base import was_audited
from toolguard.store.postgres import (
    Deadlock,
    LockNotAvailable,
    SerializationFailure,
    StatementTimeout,
    TransactionAborted,
)

pytestmark = pytest.mark.parametrize("env", ["postgresql"], indirect=True)


def intent(key: str) -> IntentRecord:
    return IntentRecord(tool="deposit", idempotency_key=key, args_hash="h", agent="agent-e",
                        keys=("acct:a",), intent_id=f"call-{key}")


@pytest.fixture
def ledger(store: GuardedStore) -> GuardedStore:
    create_ledger(store, ["a", "b"])
    return store


def audit_of(store: GuardedStore, key: str) -> list[tuple[str, str]]:
    return [(e.decision, e.reason) for e in
            store.query_audit(idempotency_key=key, newest_first=False, limit=None)]


def intent_status(store: GuardedStore, key: str) -> list[tuple[Any, ...]]:
    return rows(store, "SELECT status FROM toolguard_intent WHERE idempotency_key = %s", (key,))


def assert_aborted(store: GuardedStore, error: BaseException, cls: type[TransactionAborted],
                   reason: str, key: str, sqlstate: str) -> None:
    assert type(error) is cls and isinstance(error, StoreError)
    assert (error.reason, error.sqlstate) == (reason, sqlstate)
    assert isinstance(error.__cause__, psycopg.Error)  # the server's error stays reachable
    assert "nothing of it was committed" in str(error)
    assert was_audited(error)
    assert audit_of(store, key) == [("failed", reason)]  # exactly one row
    assert intent_status(store, key) == [("failed",)]
    assert ledger_state(store)[0]["a"] == (0, 0)
    assert store.high_water("acct:a") == 0  # the fence advance was rolled back with it


def test_statement_timeout_is_typed_and_audited_once(ledger: GuardedStore) -> None:
    with pytest.raises(StatementTimeout) as caught, ledger.fenced({"acct:a": 5}, intent("st")) as tx:
        deposit(tx, "a", 5, "slow")
        tx.execute("SET LOCAL statement_timeout = '50ms'")
        tx.execute("SELECT pg_sleep(5)")
    assert_aborted(ledger, caught.value, StatementTimeout, "statement_timeout", "st", "57014")
    with ledger.fenced({"acct:a": 5}, intent("st")) as tx:  # the retry runs again, and applies
        tx.record(deposit(tx, "a", 5, "retry"))
    assert ledger_state(ledger)[0]["a"] == (5, 1)


def test_a_timeout_the_tool_swallowed_still_refuses_the_commit(ledger: GuardedStore) -> None:
    with pytest.raises(StatementTimeout), ledger.fenced({"acct:a": 5}, intent("sw")) as tx:
        tx.execute("SET LOCAL statement_timeout = '50ms'")
        with contextlib.suppress(StatementTimeout):  # the tool carries on as if nothing happened
            tx.execute("SELECT pg_sleep(5)")
        tx.record("pretends it worked")
    assert audit_of(ledger, "sw") == [("failed", "statement_timeout")]


def test_a_cancelled_statement_is_query_canceled(ledger: GuardedStore, env: StoreEnv) -> None:
    pid: list[int] = []

    def cancel_when_sleeping() -> None:
        with psycopg.connect(env.url, autocommit=True) as conn:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if conn.execute("SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
                                "WHERE pid = %s AND query LIKE %s", (pid[0], "%pg_sleep%")
                                ).fetchall():
                    return
                time.sleep(0.01)

    canceller = threading.Thread(target=cancel_when_sleeping)
    with pytest.raises(StatementTimeout) as caught, ledger.fenced({"acct:a": 5}, intent("qc")) as tx:
        pid.append(int(tx.execute("SELECT pg_backend_pid()").fetchone()[0]))
        canceller.start()
        tx.execute("SELECT pg_sleep(10)")
    canceller.join(10)
    assert_aborted(ledger, caught.value, StatementTimeout, "query_canceled", "qc", "57014")


def _deadlocked_pair(ledger: GuardedStore, body: Callable[[Any, str, threading.Barrier], None]
                     ) -> dict[str, BaseException | str]:
    """Two fenced writes on different keys whose bodies ``body(tx, name, barrier)`` collide."""
    barrier = threading.Barrier(2, timeout=10)
    outcomes: dict[str, BaseException | str] = {}

    def run(name: str, key: str) -> None:
        try:
            with ledger.fenced({key: 1}, intent(name)) as tx:
                body(tx, name, barrier)
                tx.record(name)
            outcomes[name] = "accepted"
        except BaseException as error:  # collected, asserted by the caller
            outcomes[name] = error

    threads = [threading.Thread(target=run, args=("first", "acct:a")),
               threading.Thread(target=run, args=("second", "acct:b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    return outcomes


def test_a_deadlock_in_the_tools_sql_is_typed_and_audited_once(ledger: GuardedStore) -> None:
    def cross(tx: Any, name: str, barrier: threading.Barrier) -> None:
        mine, theirs = ("a", "b") if name == "first" else ("b", "a")
        tx.execute("SET LOCAL deadlock_timeout = '50ms'")
        tx.execute("UPDATE ledger_account SET balance = balance + 1 WHERE id = %s", (mine,))
        barrier.wait()
        tx.execute("UPDATE ledger_account SET balance = balance + 1 WHERE id = %s", (theirs,))

    outcomes = _deadlocked_pair(ledger, cross)
    (loser,) = [name for name, outcome in outcomes.items() if outcome != "accepted"]
    (winner,) = set(outcomes) - {loser}
    error = outcomes[loser]
    assert type(error) is Deadlock and error.reason == "deadlock" and error.sqlstate == "40P01"
    assert isinstance(error, TransactionAborted) and was_audited(error)
    assert audit_of(ledger, loser) == [("failed", "deadlock")]
    assert intent_status(ledger, loser) == [("failed",)]
    assert audit_of(ledger, winner) == [("accepted", "applied")]
    assert {a: b for a, (b, _) in ledger_state(ledger)[0].items()} == {"a": 1, "b": 1}


def test_the_sessions_lock_timeout_is_lock_not_available(ledger: GuardedStore,
                                                         env: StoreEnv) -> None:
    with psycopg.connect(env.url, autocommit=True) as other:
        other.execute(f'SET search_path TO "{env.schema}"')
        other.execute("BEGIN")
        other.execute("SELECT 1 FROM ledger_account WHERE id = 'a' FOR UPDATE")
        with pytest.raises(LockNotAvailable) as caught, \
                ledger.fenced({"acct:a": 5}, intent("lt")) as tx:
            tx.execute("SET LOCAL lock_timeout = '50ms'")
            deposit(tx, "a", 5, "blocked")
        other.execute("ROLLBACK")
    assert_aborted(ledger, caught.value, LockNotAvailable, "lock_not_available", "lt", "55P03")


@pytest.fixture
def serializable(env: StoreEnv, ledger: GuardedStore) -> Iterator[GuardedStore]:
    """The same store through connections whose transactions are SERIALIZABLE."""
    url = env.url + ("&" if "?" in env.url else "?") + \
        "options=-c%20default_transaction_isolation%3Dserializable"
    store = open_store(url, schema=env.schema)
    try:
        yield store
    finally:
        store.close()


def test_a_serialization_failure_is_typed_and_audited_once(serializable: GuardedStore) -> None:
    def skew(tx: Any, name: str, barrier: threading.Barrier) -> None:
        # write skew: each reads both balances, then writes its own from the sum
        (total,) = tx.execute("SELECT sum(balance) FROM ledger_account").fetchone()
        barrier.wait()
        mine = "a" if name == "first" else "b"
        tx.execute("UPDATE ledger_account SET balance = %s WHERE id = %s", (total + 1, mine))
        barrier.wait()  # both wrote: the commit of the second to try cannot be serialized

    outcomes = _deadlocked_pair(serializable, skew)
    failed = [o for o in outcomes.values() if o != "accepted"]
    assert len(failed) == 1, outcomes
    (error,) = failed
    assert type(error) is SerializationFailure and error.reason == "serialization_failure"
    (loser,) = [name for name, outcome in outcomes.items() if outcome is error]
    assert audit_of(serializable, loser) == [("failed", "serialization_failure")]


def test_async_statement_timeout_is_typed_and_audited_once(env: StoreEnv,
                                                          ledger: GuardedStore) -> None:
    async def main() -> BaseException:
        store = env.open_async()
        try:
            with pytest.raises(StatementTimeout) as caught:
                async with store.fenced({"acct:a": 5}, intent("ast")) as tx:
                    await tx.execute("SET LOCAL statement_timeout = '50ms'")
                    await tx.execute("SELECT pg_sleep(5)")
            return caught.value
        finally:
            await store.close()

    error = asyncio.run(main())
    assert_aborted(ledger, error, StatementTimeout, "statement_timeout", "ast", "57014")
