"""The store's contract, run against PostgreSQL and SQLite alike."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store.envs import StoreEnv, create_ledger, deposit, ledger_state, rows
from toolguard.errors import (
    ConfigurationError,
    DuplicateIntent,
    IdempotencyConflict,
    InvalidFencingToken,
    StaleFencingToken,
    StoreError,
)
from toolguard.locks import connect
from toolguard.store import AuditEntry, Begun, GuardedStore, IntentRecord, Replay, open_store
from toolguard.store.base import was_audited
from toolguard.store.recovery import run_fenced


def intent(key: str | None = "idem-1", *, args_hash: str = "h1", tool: str = "deposit",
           **extra: object) -> IntentRecord:
    return IntentRecord(tool=tool, idempotency_key=key, args_hash=args_hash if key else None,
                        agent="agent-a", workflow="wf-1", keys=("acct:a",),
                        intent_id=f"call-{key}", args={"amount": 5}, **extra)  # type: ignore[arg-type]


@pytest.fixture
def ledger(store: GuardedStore) -> GuardedStore:
    create_ledger(store, ["a", "b"])
    return store


def balance(store: GuardedStore, account: str = "a") -> int:
    return ledger_state(store)[0][account][0]


# --- fencing -------------------------------------------------------------------------------------


def test_accepted_write_commits_records_and_audits(ledger: GuardedStore) -> None:
    record = intent()
    assert ledger.begin_intent(record) == Begun("idem-1", 1, None)
    with ledger.fenced({"acct:a": 100}, record, detail="first") as tx:
        new = deposit(tx, "a", 5, "i1")
        tx.record({"balance": new})
    assert balance(ledger) == 5
    assert ledger.high_water("acct:a") == 100
    (entry,) = ledger.query_audit()
    assert (entry.decision, entry.reason, entry.tool, entry.agent) == (
        "accepted", "applied", "deposit", "agent-a")
    assert entry.keys == ("acct:a",) and entry.tokens == {"acct:a": 100}
    assert (entry.intent_id, entry.idempotency_key, entry.workflow) == ("call-idem-1", "idem-1", "wf-1")
    assert entry.args == {"amount": 5} and entry.detail == "first"
    assert entry.id is not None and entry.at is not None and entry.duration_ms is not None


def test_equal_token_is_accepted_lower_is_rejected(ledger: GuardedStore) -> None:
    for _ in range(2):  # one lease, two writes
        with ledger.fenced({"acct:a": 7}) as tx:
            deposit(tx, "a", 1, "same-lease")
    with pytest.raises(StaleFencingToken) as caught, ledger.fenced({"acct:a": 6}) as tx:
        deposit(tx, "a", 1000, "stale")
    error = caught.value
    assert (error.key, error.token, error.current, error.reason) == ("acct:a", 6, 7,
                                                                     "stale_fencing_token")
    assert balance(ledger) == 2
    assert ledger.high_water("acct:a") == 7


def test_stale_write_is_rolled_back_and_audited_outside(ledger: GuardedStore) -> None:
    with ledger.fenced({"acct:a": 50}) as tx:
        deposit(tx, "a", 1, "ok")
    record = intent("idem-stale")
    ledger.begin_intent(record)
    with pytest.raises(StaleFencingToken), ledger.fenced({"acct:a": 49}, record) as tx:
        pytest.fail("the body must not run under a stale token")
    assert balance(ledger) == 1
    (rejected,) = ledger.query_audit(decision="rejected")
    assert rejected.reason == "stale_fencing_token"
    assert rejected.tokens == {"acct:a": 49} and rejected.idempotency_key == "idem-stale"
    assert "49" in (rejected.detail or "") and "50" in (rejected.detail or "")
    assert rows(ledger, "SELECT status FROM toolguard_intent WHERE idempotency_key = %s",
                ("idem-stale",)) == [("failed",)]


def test_multi_key_fences_all_or_nothing(ledger: GuardedStore) -> None:
    with ledger.fenced({"acct:b": 10, "acct:a": 10}) as tx:
        deposit(tx, "a", 1, "x")
        assert tx.keys == ("acct:a", "acct:b")
    # a is fine (equal), b is stale: nothing advances, nothing is written
    with pytest.raises(StaleFencingToken) as caught, ledger.fenced({"acct:a": 20, "acct:b": 9}):
        pass
    assert caught.value.key == "acct:b"
    assert ledger.high_waters(["acct:a", "acct:b", "acct:c"]) == {"acct:a": 10, "acct:b": 10}


def test_other_errors_roll_back_audit_and_reraise(ledger: GuardedStore) -> None:
    record = intent("idem-err")
    ledger.begin_intent(record)
    with pytest.raises(ZeroDivisionError), ledger.fenced({"acct:a": 3}, record) as tx:
        deposit(tx, "a", 5, "boom")
        _ = 1 / 0
    assert balance(ledger) == 0
    assert ledger.high_water("acct:a") == 0  # the fence advance was rolled back too
    (failed,) = ledger.query_audit()
    assert (failed.decision, failed.reason) == ("failed", "error")
    assert "division" in (failed.detail or "")
    assert rows(ledger, "SELECT status, result FROM toolguard_intent WHERE idempotency_key = %s",
                ("idem-err",))[0][0] == "failed"


@pytest.mark.parametrize("tokens", [{"acct:a": None}, {"acct:a": 0}, {"acct:a": -5},
                                    {"acct:a": True}, {"acct:a": "12"}, {"": 3}, {}])
def test_invalid_tokens_are_errors_and_change_nothing(ledger: GuardedStore, tokens) -> None:
    with pytest.raises(InvalidFencingToken), ledger.fenced(tokens) as tx:
        deposit(tx, "a", 5, "never")
    assert balance(ledger) == 0
    assert ledger.high_water("acct:a") == 0
    (entry,) = ledger.query_audit()
    assert (entry.decision, entry.reason) == ("rejected", "invalid_fencing_token")


def test_result_must_be_json(ledger: GuardedStore) -> None:
    with pytest.raises(StoreError) as caught, ledger.fenced({"acct:a": 1}, intent("j")) as tx:
        deposit(tx, "a", 5, "x")
        tx.result = object()
    assert caught.value.reason == "not_json"
    assert balance(ledger) == 0


def test_tool_must_not_end_the_transaction(ledger: GuardedStore) -> None:
    with pytest.raises(StoreError) as caught, ledger.fenced({"acct:a": 1}) as tx:
        tx.execute("COMMIT")
    assert caught.value.reason == "transaction_ended"


def test_reads_inside_see_the_previous_holder(ledger: GuardedStore) -> None:
    """A second writer on the key blocks on the fence until the first one commits, then reads
    its result. (Equal tokens: one lease, two writes. A newer token would prove the first
    writer's lease gone, and on PostgreSQL it would end the first transaction instead:
    ``test_store_stale_blocker.py``.)"""
    first_in = threading.Event()
    release_first = threading.Event()
    seen: list[int] = []

    def older() -> None:
        with ledger.fenced({"acct:a": 10}) as tx:
            deposit(tx, "a", 1, "older")
            first_in.set()
            release_first.wait(5)

    thread = threading.Thread(target=older)
    thread.start()
    assert first_in.wait(5)
    done = threading.Event()

    def newer() -> None:
        with ledger.fenced({"acct:a": 10}) as tx:
            seen.append(deposit(tx, "a", 10, "newer"))
        done.set()

    second = threading.Thread(target=newer)
    second.start()
    time.sleep(0.2)
    assert not done.is_set()  # waiting on the older holder's fence row / write lock
    release_first.set()
    thread.join(10)
    second.join(10)
    assert seen == [11] and balance(ledger) == 11


# --- idempotency ---------------------------------------------------------------------------------


def test_replay_returns_recorded_result_and_changes_nothing(ledger: GuardedStore) -> None:
    record = intent("idem-r")
    ledger.begin_intent(record)
    with ledger.fenced({"acct:a": 5}, record) as tx:
        tx.result = {"balance": deposit(tx, "a", 5, "r")}
    audit_before = len(ledger.query_audit(limit=None))
    replay = ledger.begin_intent(record)
    assert replay == Replay("idem-r", {"balance": 5}, 1)
    assert balance(ledger) == 5
    assert len(ledger.query_audit(limit=None)) == audit_before
    # even with a fresh lease, the fenced re-check refuses to run it again
    with pytest.raises(DuplicateIntent) as caught, ledger.fenced({"acct:a": 6}, record) as tx:
        deposit(tx, "a", 5, "again")
    assert caught.value.result == {"balance": 5}
    assert balance(ledger) == 5
    assert ledger.high_water("acct:a") == 6  # the replay's tokens were seen: its fence advance stays
    assert ledger.query_audit(limit=1)[0].decision == "replayed"


def test_same_key_other_args_is_a_conflict(ledger: GuardedStore) -> None:
    ledger.begin_intent(intent("idem-c"))
    with pytest.raises(IdempotencyConflict):
        ledger.begin_intent(intent("idem-c", args_hash="other"))
    with pytest.raises(IdempotencyConflict):
        ledger.begin_intent(intent("idem-c", tool="withdraw"))
    with pytest.raises(IdempotencyConflict), ledger.fenced({"acct:a": 1},
                                                          intent("idem-c", args_hash="other")):
        pytest.fail("must not run")
    # the conflicting request did not touch the original's row
    assert rows(ledger, "SELECT status, attempts FROM toolguard_intent WHERE idempotency_key = %s",
                ("idem-c",)) == [("pending", 1)]
    assert balance(ledger) == 0


def _crash_mid_write(env: StoreEnv) -> None:
    """Child process: begin the intent, enter the fenced write, die before the commit."""
    import os

    store = env.open()
    store.begin_intent(intent("idem-crash"))
    with store.fenced({"acct:a": 3}, intent("idem-crash")) as tx:
        deposit(tx, "a", 5, "crash")
        os._exit(17)


def test_pending_attempt_after_a_crash_runs_again_once(env: StoreEnv, ledger: GuardedStore) -> None:
    child = multiprocessing.get_context("spawn").Process(target=_crash_mid_write, args=(env,))
    child.start()
    child.join(60)
    assert child.exitcode == 17
    assert balance(ledger) == 0
    assert rows(ledger, "SELECT status FROM toolguard_intent WHERE idempotency_key = %s",
                ("idem-crash",)) == [("pending",)]
    again = ledger.begin_intent(intent("idem-crash"))
    assert again == Begun("idem-crash", 2, "pending") and again.reconciled
    with ledger.fenced({"acct:a": 4}, intent("idem-crash")) as tx:
        tx.record(deposit(tx, "a", 5, "retry"))
    assert ledger.begin_intent(intent("idem-crash")) == Replay("idem-crash", 5, 2)
    assert balance(ledger) == 5


def test_concurrent_attempts_apply_once(ledger: GuardedStore) -> None:
    """Two live attempts of one intent (both Begun, under one lease): the second finds the
    first's result."""
    record = intent("idem-twice")
    assert isinstance(ledger.begin_intent(record), Begun)
    assert ledger.begin_intent(record) == Begun("idem-twice", 2, "pending")
    inside = threading.Event()
    go_on = threading.Event()
    outcomes: list[object] = []

    def first() -> None:
        with ledger.fenced({"acct:a": 1}, record) as tx:
            tx.record(deposit(tx, "a", 5, "first"))
            inside.set()
            go_on.wait(5)
        outcomes.append("applied")

    def second() -> None:
        try:
            with ledger.fenced({"acct:a": 1}, record) as tx:
                tx.record(deposit(tx, "a", 5, "second"))
            outcomes.append("applied")
        except DuplicateIntent as duplicate:
            outcomes.append(("duplicate", duplicate.result))

    one = threading.Thread(target=first)
    one.start()
    assert inside.wait(5)
    two = threading.Thread(target=second)
    two.start()
    time.sleep(0.2)
    go_on.set()
    one.join(10)
    two.join(10)
    assert sorted(map(str, outcomes)) == sorted(map(str, ["applied", ("duplicate", 5)]))
    assert balance(ledger) == 5


def test_mark_unknown_then_reconcile(ledger: GuardedStore) -> None:
    record = intent("idem-u")
    ledger.begin_intent(record)
    assert ledger.mark_unknown("idem-u") is True
    assert ledger.begin_intent(record) == Begun("idem-u", 2, "unknown")
    with ledger.fenced({"acct:a": 1}, record) as tx:
        tx.record("done")
    assert ledger.mark_unknown("idem-u") is False  # never un-applies
    assert ledger.begin_intent(record) == Replay("idem-u", "done", 2)
    assert ledger.mark_unknown("no-such-key") is False


def test_fenced_without_begin_creates_the_intent(ledger: GuardedStore) -> None:
    record = intent("idem-direct")
    with ledger.fenced({"lock:1": 1}, record) as tx:
        tx.record([1, 2])
    assert ledger.begin_intent(record) == Replay("idem-direct", [1, 2], 1)
    assert ledger.has_applied("deposit", "acct:a")  # the intent's own resource keys
    bare = IntentRecord(tool="note", idempotency_key="idem-bare", args_hash="h")
    with ledger.fenced({"lock:2": 1}, bare):
        pass
    assert ledger.has_applied("note", "lock:2")  # no keys given: the fenced ones


def test_begin_needs_an_idempotency_key(ledger: GuardedStore) -> None:
    with pytest.raises(StoreError):
        ledger.begin_intent(intent(None))
    with pytest.raises(StoreError):
        IntentRecord(tool="x", idempotency_key="k")  # no args_hash


# --- ordering, high water, audit ------------------------------------------------------------------


def test_has_applied(ledger: GuardedStore) -> None:
    assert not ledger.has_applied("attach_log", "ticket:1")
    record = IntentRecord(tool="attach_log", idempotency_key="al-1", args_hash="h",
                          workflow="wf-9", keys=("ticket:1", "log:7"))
    ledger.begin_intent(record)
    assert not ledger.has_applied("attach_log", "ticket:1")  # begun is not applied
    with ledger.fenced({"ticket:1": 1, "log:7": 1}, record):
        pass
    assert ledger.has_applied("attach_log", "ticket:1")
    assert ledger.has_applied("attach_log", "log:7", workflow="wf-9")
    assert not ledger.has_applied("attach_log", "log:7", workflow="wf-other")
    assert not ledger.has_applied("close_ticket", "ticket:1")
    assert not ledger.has_applied("attach_log", "ticket:2")


def test_audit_append_and_query(ledger: GuardedStore) -> None:
    start = datetime.now(UTC) - timedelta(seconds=5)
    written = [
        ledger.audit(AuditEntry(decision="rejected", reason="not_authorized", tool="transfer",
                                agent="rogue", keys=("acct:a",), args={"to": "x"}, detail="nope")),
        ledger.audit(AuditEntry(decision="rejected", reason="lock_timeout", tool="deposit",
                                agent="agent-a", keys=("acct:b",), tokens={})),
        ledger.audit(AuditEntry(decision="rejected", reason="invalid_arguments", tool="deposit",
                                agent="agent-b", intent_id="call-9", idempotency_key="k9",
                                workflow="wf-2", node_attempt=2, duration_ms=1.5)),
    ]
    assert all(e.id is not None and e.at is not None for e in written)
    assert [e.id for e in ledger.query_audit()] == [e.id for e in reversed(written)]
    assert [e.id for e in ledger.query_audit(newest_first=False, limit=2)] == [
        written[0].id, written[1].id]
    assert [e.reason for e in ledger.query_audit(tool="deposit", newest_first=False)] == [
        "lock_timeout", "invalid_arguments"]
    assert [e.agent for e in ledger.query_audit(agent=["rogue", "agent-b"], newest_first=False)] == [
        "rogue", "agent-b"]
    assert [e.reason for e in ledger.query_audit(key="acct:b")] == ["lock_timeout"]
    assert ledger.query_audit(reason="not_authorized")[0].args == {"to": "x"}
    (third,) = ledger.query_audit(idempotency_key="k9")
    assert (third.intent_id, third.workflow, third.node_attempt, third.duration_ms) == (
        "call-9", "wf-2", 2, 1.5)
    assert ledger.query_audit(intent_id="call-9") == [third]
    assert ledger.query_audit(decision="accepted") == []
    assert len(ledger.query_audit(since=start)) == 3
    assert ledger.query_audit(until=start) == []
    assert ledger.query_audit(since=datetime.now(UTC) + timedelta(minutes=1)) == []
    assert [e.id for e in ledger.query_audit(after_id=written[0].id, newest_first=False)] == [
        written[1].id, written[2].id]
    assert ledger.query_audit(decision=[]) == []
    assert third.as_dict()["keys"] == [] and isinstance(third.as_dict()["at"], str)


def test_audit_rejects_naive_datetimes(ledger: GuardedStore) -> None:
    with pytest.raises(StoreError):
        ledger.query_audit(since=datetime.now())


def test_schema_missing_is_a_clear_error(env: StoreEnv) -> None:
    fresh = env.open()
    try:
        assert fresh.schema_version() == 0
        with pytest.raises(StoreError) as caught:
            fresh.begin_intent(intent("x"))
        assert caught.value.reason == "schema_not_installed"
        assert "toolguard db init" in str(caught.value)
    finally:
        fresh.close()


@pytest.mark.parametrize("url", ["mysql://x/y", "no-scheme", "sqlite:///", "postgresql://u@h/db?nosuchoption=1"])
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigurationError):
        open_store(url)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=10))
def test_fence_accepts_exactly_the_tokens_not_below_the_mark(store: GuardedStore,
                                                            tokens: list[int]) -> None:
    key = f"prop:{uuid.uuid4().hex}"
    mark = 0
    for token in tokens:
        try:
            with store.fenced({key: token}):
                pass
            accepted = True
        except StaleFencingToken as error:
            accepted = False
            assert (error.token, error.current) == (token, mark)
        assert accepted == (token >= mark)
        mark = max(mark, token)
        assert store.high_water(key) == mark


def test_failures_are_marked_audited(ledger: GuardedStore) -> None:
    """The guard reads this mark so a rejection gets exactly one audit row."""
    with pytest.raises(StaleFencingToken) as caught, ledger.fenced({"acct:a": 1}):
        raise StaleFencingToken("raised by the tool", key="acct:a", token=1, current=2)
    assert was_audited(caught.value)
    with pytest.raises(ValueError) as other, ledger.fenced({"acct:a": 1}):
        raise ValueError("boom")
    assert was_audited(other.value)
    assert [e.reason for e in ledger.query_audit()] == ["error", "stale_fencing_token"]


def test_embedded_default_shares_one_file_with_the_locks(tmp_path) -> None:
    """With nothing configured, locks and store live in one SQLite file; they must coexist."""
    url = f"sqlite:///{tmp_path}/toolguard.db"
    store = open_store(url, install=True)
    locks = connect(url, ttl_ms=2_000)
    try:
        create_ledger(store, ["a"])
        outcomes = [run_fenced(locks, store, ["acct:a"], lambda tx: deposit(tx, "a", 2, "e"),
                               intent=IntentRecord(tool="deposit", idempotency_key=f"e{i % 3}",
                                                   args_hash="h"))
                    for i in range(6)]
        assert [o.replayed for o in outcomes] == [False, False, False, True, True, True]
        assert balance(store) == 6
    finally:
        locks.close()
        store.close()
