"""The guarded call's fast path: no ``begin_intent`` round trip, and what still holds without it.

``run_fenced`` / ``arun_fenced`` go straight to the fenced transaction, whose
first statement creates and locks the intent row. A replay, a conflict, a
failed or cancelled attempt and its reconciliation must behave as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from store.envs import StoreEnv, adeposit, create_ledger, deposit, ledger_state, rows
from toolguard.errors import IdempotencyConflict, StaleFencingToken, StoreError
from toolguard.locks import LockManager
from toolguard.store import Begun, GuardedStore, IntentRecord, Replay
from toolguard.store.recovery import arun_fenced, run_fenced


def intent(key: str = "fast-1", *, args_hash: str = "h1", keys: tuple[str, ...] = ("acct:a",)
           ) -> IntentRecord:
    return IntentRecord(tool="deposit", idempotency_key=key, args_hash=args_hash, agent="agent-f",
                        workflow="wf-f", keys=keys, intent_id=f"call-{key}", args={"amount": 5})


class Stop(BaseException):
    """Not an Exception: the store records the call's outcome as unknown."""


@pytest.fixture
def ledger(store: GuardedStore) -> GuardedStore:
    create_ledger(store, ["a", "b"])
    return store


@pytest.fixture
def locks(env: StoreEnv) -> Iterator[LockManager]:
    manager = env.locks(ttl_ms=5_000, timeout_s=5)
    try:
        yield manager
    finally:
        manager.close()


@pytest.fixture
def no_begin(ledger: GuardedStore, monkeypatch: pytest.MonkeyPatch) -> GuardedStore:
    """The store, with ``begin_intent`` refusing to be called (it must stay off the path)."""

    def refuse(record: IntentRecord) -> Any:
        pytest.fail(f"run_fenced called begin_intent({record.idempotency_key!r})")

    monkeypatch.setattr(ledger, "begin_intent", refuse)
    return ledger


def status(store: GuardedStore, key: str) -> list[tuple[Any, ...]]:
    return rows(store, "SELECT status, attempts FROM toolguard_intent WHERE idempotency_key = %s",
                (key,))


def decisions(store: GuardedStore, key: str) -> list[tuple[str, str]]:
    return [(e.decision, e.reason) for e in
            store.query_audit(idempotency_key=key, newest_first=False, limit=None)]


def test_apply_replay_and_conflict_without_begin(env: StoreEnv, no_begin: GuardedStore,
                                                 locks: LockManager) -> None:
    store, key = no_begin, env.key("acct:a")
    runs: list[str] = []

    def body(tx: Any) -> int:
        runs.append("ran")
        return deposit(tx, "a", 5, "fast")

    first = run_fenced(locks, store, [key], body, intent=intent())
    assert (first.value, first.replayed) == (5, False)
    again = run_fenced(locks, store, [key], body, intent=intent())
    assert (again.value, again.replayed) == (5, True)
    assert runs == ["ran"]  # the replay ran nothing
    with pytest.raises(IdempotencyConflict):
        run_fenced(locks, store, [key], body, intent=intent(args_hash="other"))
    assert runs == ["ran"]
    assert ledger_state(store)[0]["a"] == (5, 1)
    assert status(store, "fast-1") == [("applied", 1)]
    assert decisions(store, "fast-1") == [("accepted", "applied"), ("replayed", "duplicate"),
                                          ("rejected", "idempotency_conflict")]
    # the replay checked its lease's token: its fence advance stays (the conflict's is rolled back)
    assert store.high_water(key) == again.tokens[key] > first.tokens[key]


def test_failed_attempt_without_begin_is_recorded_then_applied_once(
        env: StoreEnv, no_begin: GuardedStore, locks: LockManager) -> None:
    store, key = no_begin, env.key("acct:a")

    def boom(tx: Any) -> int:
        deposit(tx, "a", 5, "boom")
        raise ValueError("the tool failed")

    with pytest.raises(ValueError, match="the tool failed"):
        run_fenced(locks, store, [key], boom, intent=intent("fast-fail"))
    # the attempt's own intent row was rolled back with it; the failure is recorded anyway
    assert status(store, "fast-fail") == [("failed", 1)]
    assert ledger_state(store)[0]["a"] == (0, 0)
    done = run_fenced(locks, store, [key], lambda tx: deposit(tx, "a", 5, "ok"),
                      intent=intent("fast-fail"))
    assert (done.value, done.replayed) == (5, False)
    assert status(store, "fast-fail") == [("applied", 2)]  # both attempts counted
    assert type(store).begin_intent(store, intent("fast-fail")) == Replay("fast-fail", 5, 2)
    assert decisions(store, "fast-fail") == [("failed", "error"), ("accepted", "applied")]


def test_cancelled_attempt_is_unknown_and_reconciled_once(
        env: StoreEnv, no_begin: GuardedStore, locks: LockManager) -> None:
    store, key = no_begin, env.key("acct:a")

    def cancelled(tx: Any) -> int:
        deposit(tx, "a", 5, "cancelled")
        raise Stop

    with pytest.raises(Stop):
        run_fenced(locks, store, [key], cancelled, intent=intent("fast-cancel"))
    assert status(store, "fast-cancel") == [("unknown", 1)]
    assert ledger_state(store)[0]["a"] == (0, 0)
    # the lease was released: the next attempt gets the lock at once
    done = run_fenced(locks, store, [key], lambda tx: deposit(tx, "a", 5, "rerun"),
                      intent=intent("fast-cancel"), timeout_s=0.5)
    assert (done.value, done.replayed) == (5, False)
    assert status(store, "fast-cancel") == [("applied", 2)]
    assert ledger_state(store)[0]["a"] == (5, 1)
    assert decisions(store, "fast-cancel") == [("unknown", "cancelled"), ("accepted", "applied")]


def test_async_cancelled_attempt_without_begin(env: StoreEnv, ledger: GuardedStore) -> None:
    key = env.key("acct:a")

    async def scenario() -> None:
        store, alocks = env.open_async(), env.alocks(ttl_ms=5_000, timeout_s=5)
        inside = asyncio.Event()

        async def hang(tx: Any) -> int:
            await adeposit(tx, "a", 5, "hung")
            inside.set()
            await asyncio.sleep(30)
            return 0

        async def refuse(record: IntentRecord) -> Any:
            pytest.fail("arun_fenced called begin_intent")

        store.begin_intent = refuse  # type: ignore[method-assign]
        try:
            task = asyncio.create_task(arun_fenced(alocks, store, [key], hang,
                                                   intent=intent("fast-acancel")))
            await asyncio.wait_for(inside.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(status, ledger, "fast-acancel") == [("unknown", 1)]
            done = await arun_fenced(alocks, store, [key],
                                     lambda tx: adeposit(tx, "a", 5, "rerun"),
                                     intent=intent("fast-acancel"), timeout_s=0.5)
            assert (done.value, done.replayed) == (5, False)
            replay = await arun_fenced(alocks, store, [key],
                                       lambda tx: adeposit(tx, "a", 5, "never"),
                                       intent=intent("fast-acancel"))
            assert (replay.value, replay.replayed) == (5, True)
        finally:
            await alocks.aclose()
            await store.close()

    asyncio.run(scenario())
    assert ledger_state(ledger)[0]["a"] == (5, 1)
    assert status(ledger, "fast-acancel") == [("applied", 2)]
    assert decisions(ledger, "fast-acancel") == [("unknown", "cancelled"), ("accepted", "applied"),
                                                 ("replayed", "duplicate")]


def test_mark_unknown_creates_the_missing_row(ledger: GuardedStore) -> None:
    record = intent("fast-u", keys=("acct:a", "acct:b"))
    assert ledger.mark_unknown("fast-u") is False  # no row, no record: nothing to mark
    assert status(ledger, "fast-u") == []
    assert ledger.mark_unknown("fast-u", record) is True
    assert status(ledger, "fast-u") == [("unknown", 1)]
    assert ledger.mark_unknown("fast-u", record) is True  # idempotent
    # another request's record never takes over the row
    assert ledger.mark_unknown("fast-u", intent("fast-u", args_hash="other")) is False
    assert ledger.begin_intent(record) == Begun("fast-u", 2, "unknown")
    with ledger.fenced({"acct:a": 1}, record) as tx:
        tx.record("done")
    assert ledger.mark_unknown("fast-u", record) is False  # never un-applies
    assert status(ledger, "fast-u") == [("applied", 2)]
    assert ledger.has_applied("deposit", "acct:b")  # the record's own resource keys
    with pytest.raises(StoreError):
        ledger.mark_unknown("another-key", record)


def test_stale_request_with_other_args_leaves_the_original_row(ledger: GuardedStore) -> None:
    original = intent("fast-own")
    with ledger.fenced({"acct:a": 10}, original) as tx:
        tx.record(deposit(tx, "a", 5, "own"))
    assert ledger.begin_intent(intent("fast-pending")) == Begun("fast-pending", 1, None)
    # a request reusing the key with other args, and a stale token: the fence rejects it first
    for key in ("fast-own", "fast-pending"):
        with pytest.raises(StaleFencingToken), ledger.fenced({"acct:a": 9},
                                                             intent(key, args_hash="other")):
            pytest.fail("must not run")
    assert status(ledger, "fast-own") == [("applied", 1)]
    assert status(ledger, "fast-pending") == [("pending", 1)]
    assert rows(ledger, "SELECT args_hash FROM toolguard_intent ORDER BY idempotency_key") == [
        ("h1",), ("h1",)]


def test_keys_with_array_syntax_round_trip(ledger: GuardedStore) -> None:
    """Keys travel as array literals: quotes, braces, commas, backslashes, 'NULL' stay intact."""
    odd = ('a"b', "c\\d", "{e,f}", "NULL", " g ", "h'i", "ü:1")
    tokens = {key: 3 for key in odd}
    record = IntentRecord(tool="note", idempotency_key="fast-odd", args_hash="h", keys=odd)
    with ledger.fenced(tokens, record) as tx:
        tx.record(list(odd))
    assert ledger.high_waters(odd) == tokens
    (entry,) = ledger.query_audit(idempotency_key="fast-odd")
    assert entry.keys == tuple(sorted(odd)) and entry.tokens == tokens
    assert all(ledger.has_applied("note", key) for key in odd)
    assert ledger.begin_intent(record) == Replay("fast-odd", list(odd), 1)
    ledger.audit(entry)  # a plain audit row with the same keys
    assert [e.keys for e in ledger.query_audit(idempotency_key="fast-odd")] == [entry.keys] * 2


@pytest.mark.parametrize("env", ["postgresql"], indirect=True)  # one message: PostgreSQL's path
def test_failed_write_never_leaves_its_transaction_open(env: StoreEnv, ledger: GuardedStore,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ROLLBACK (a replay's COMMIT) rides with the failure's audit row; if that cannot be
    written, it goes alone.

    One pooled connection: every later write needs it back clean, its fences released.
    """
    from toolguard.store import postgres_session  # the sessions look it up there

    store = env.open(min_size=1, max_size=1)
    try:
        with store.fenced({"acct:a": 5}, intent("fast-clean")) as tx:
            tx.record(deposit(tx, "a", 1, "first"))
        with pytest.raises(StaleFencingToken), store.fenced({"acct:a": 4}):
            pass
        with pytest.raises(Exception, match="already applied"), \
                store.fenced({"acct:a": 6}, intent("fast-clean")):
            pytest.fail("a replay must not run")

        def broken(*args: Any) -> Any:
            raise RuntimeError("the audit row cannot be built")

        monkeypatch.setattr(postgres_session, "_failure_params", broken)
        with pytest.raises(ZeroDivisionError), store.fenced({"acct:a": 7}) as tx:
            deposit(tx, "a", 100, "rolled back")
            _ = 1 / 0
        monkeypatch.undo()
        with store.connection(timeout=2) as conn:  # the only connection, back and idle
            assert conn.info.transaction_status.name == "IDLE"
        # no failed attempt's fence advance survived; the replay's (6) did
        assert store.high_water("acct:a") == 6
        # a replay whose audit row cannot be built: its COMMIT goes alone, the connection is clean
        monkeypatch.setattr(postgres_session, "_failure_params", broken)
        with pytest.raises(Exception, match="already applied"), \
                store.fenced({"acct:a": 8}, intent("fast-clean")):
            pytest.fail("a replay must not run")
        monkeypatch.undo()
        with store.connection(timeout=2) as conn:
            assert conn.info.transaction_status.name == "IDLE"
        assert store.high_water("acct:a") == 8
        with store.fenced({"acct:a": 8}) as tx:
            deposit(tx, "a", 1, "second")
        assert ledger_state(store)[0]["a"] == (2, 2)
        assert [(e.decision, e.reason) for e in store.query_audit(newest_first=False)] == [
            ("accepted", "applied"), ("rejected", "stale_fencing_token"),
            ("replayed", "duplicate"), ("accepted", "applied")]
    finally:
        store.close()
