"""PostgreSQL: a holder paused inside its fenced transaction no longer blocks the next holder.

The paused holder is a thread whose fenced transaction is left open (its
connection idle in transaction, as a stopped process leaves it); the next
holder is another thread on another connection. ``toolguard_fence`` ends the
blocker only when every token it published is below the waiter's token for
the key, so a live holder, a holder of the same lease, or a transaction that
is not a toolguard fence is never cut. The real thing (SIGSTOP, a lock
server, two processes) is in ``tests/fault/test_paused_in_transaction.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from store.envs import StoreEnv, create_ledger, deposit, ledger_state, rows
from toolguard.errors import BackendUnavailable, LockLost, StaleFencingToken
from toolguard.locks import heartbeat
from toolguard.store import GuardedStore, IntentRecord

#: How long a test keeps a holder open so that a waiter had several chances (steps of 100,
#: 200, 400 ms...) to end it wrongly. Not a bound on anything: nothing below is timed.
SEVERAL_STEPS_S = 0.9
#: How long the test waits for a thread before calling it stuck (a hang guard, not a timing).
STUCK_S = 20


@pytest.fixture
def pg_env(postgres_url: str, redis_url: str, unique: str) -> Iterator[StoreEnv]:
    env = StoreEnv("postgresql", postgres_url, redis_url, f"tgstale:{unique}",
                   {"schema": f"tg_stale_{unique}"})
    try:
        yield env
    finally:
        env.drop()


@pytest.fixture(params=["existing", "new"])
def ledger(pg_env: StoreEnv, request: pytest.FixtureRequest) -> Iterator[GuardedStore]:
    """Keys fenced before (the blocker holds the row: found through its xmax) or never (the
    blocker creates the row, which nobody else can see yet: found through its announcement)."""
    store = pg_env.open(install=True)
    create_ledger(store, ["a"])
    if request.param == "existing":
        with store.fenced({"k": 1, "j": 1, pg_env.key("acct:a"): 1}):
            pass
    try:
        yield store
    finally:
        store.close()


def intent(name: str) -> IntentRecord:
    return IntentRecord(tool="deposit", idempotency_key=name, args_hash="h", intent_id=name,
                        agent=name)


_OPEN: list[Holder] = []


@pytest.fixture(autouse=True)
def _resume_holders() -> Iterator[None]:
    """A failed test must not leave a holder waiting (and its pool connection taken)."""
    yield
    while _OPEN:
        _OPEN.pop()._resume.set()


class Holder:
    """A fenced write in a thread that stops inside its transaction until ``resume()``."""

    def __init__(self, store: GuardedStore, lease: Any, name: str, delta: int,
                 inside: Callable[[], None] = lambda: None) -> None:
        _OPEN.append(self)
        self.entered = threading.Event()
        self._resume = threading.Event()
        self.outcome: object = None
        self.pid: int | None = None

        def run() -> None:
            try:
                with store.fenced(lease, intent(name)) as tx:
                    deposit(tx, "a", delta, name)
                    self.pid = tx.connection.info.backend_pid
                    inside()
                    self.entered.set()
                    assert self._resume.wait(STUCK_S)
                self.outcome = "accepted"
            except Exception as error:
                self.outcome = error

        self.thread = threading.Thread(target=run, name=f"holder-{name}")
        self.thread.start()
        assert self.entered.wait(STUCK_S), "the holder never got inside its transaction"

    def resume(self) -> object:
        self._resume.set()
        self.thread.join(STUCK_S)
        assert not self.thread.is_alive()
        return self.outcome


def write(store: GuardedStore, lease: Any, name: str, delta: int) -> object:
    try:
        with store.fenced(lease, intent(name)) as tx:
            deposit(tx, "a", delta, name)
        return "accepted"
    except Exception as error:
        return error


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    return thread, box


def backend_alive(store: GuardedStore, pid: int | None) -> bool:
    return rows(store, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)) == [(1,)]


def backend_ends(store: GuardedStore, pid: int | None) -> bool:
    """The backend exits (its row locks were released before: it may linger a moment)."""
    deadline = time.monotonic() + STUCK_S
    while backend_alive(store, pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def audit_of(store: GuardedStore, name: str) -> list[tuple[str, str]]:
    return [(e.decision, e.reason) for e in store.query_audit(intent_id=name, limit=None)]


def status_of(store: GuardedStore, name: str) -> list[tuple[Any, ...]]:
    return rows(store, "SELECT status FROM toolguard_intent WHERE idempotency_key = %s", (name,))


def test_a_newer_token_ends_the_paused_holder(ledger: GuardedStore) -> None:
    paused = Holder(ledger, {"k": 10}, "paused", 5)
    # The next holder proceeds while the paused one is still inside its transaction.
    assert write(ledger, {"k": 11}, "next", 7) == "accepted"
    assert backend_ends(ledger, paused.pid)
    outcome = paused.resume()
    # tokens alone: a typed error, the outcome unknown to the client (the connection broke)
    assert isinstance(outcome, BackendUnavailable), outcome
    assert ledger_state(ledger)[0]["a"] == (7, 1)
    assert ledger.high_water("k") == 11
    assert audit_of(ledger, "paused") == [("failed", "backend_unavailable")]
    assert status_of(ledger, "paused") == [("unknown",)]
    assert audit_of(ledger, "next") == [("accepted", "applied")]


def test_a_paused_lease_holder_is_ended_and_its_commit_refused(pg_env: StoreEnv,
                                                               ledger: GuardedStore) -> None:
    key = pg_env.key("acct:a")
    with pg_env.locks(ttl_ms=300, timeout_s=10) as locks:
        first = locks.acquire([key])
        paused = Holder(ledger, first, "paused", 5, inside=lambda: heartbeat().remove(first))
        with locks.acquire([key], ttl_ms=10_000) as second:  # after the first one's TTL
            assert second.tokens[key] > first.tokens[key]
            assert write(ledger, second, "next", 7) == "accepted"
        outcome = paused.resume()
        first.release()
    assert isinstance(outcome, LockLost), outcome
    assert ledger_state(ledger)[0]["a"] == (7, 1)
    assert audit_of(ledger, "paused") == [("rejected", "lease_lost")]
    assert status_of(ledger, "paused") == [("failed",)]


def test_a_live_holder_is_never_cut(ledger: GuardedStore) -> None:
    """Older and equal tokens wait for the holder, however long it takes; only then do they
    meet the fence."""
    live = Holder(ledger, {"k": 10}, "live", 5)
    older, older_box = in_thread(lambda: write(ledger, {"k": 9}, "older", 100))
    same, same_box = in_thread(lambda: write(ledger, {"k": 10}, "same-lease", 1))
    time.sleep(SEVERAL_STEPS_S)  # the waiters look at the holder several times meanwhile
    assert backend_alive(ledger, live.pid)
    assert live.resume() == "accepted"
    older.join(STUCK_S)
    same.join(STUCK_S)
    assert isinstance(older_box[0], StaleFencingToken)
    assert same_box == ["accepted"]
    assert ledger_state(ledger)[0]["a"] == (6, 2)


def test_a_multi_key_blocker_with_a_newer_token_elsewhere_is_kept(ledger: GuardedStore) -> None:
    """The rule compares every token the blocker published: one at or above the waiter's keeps
    it (tokens of different keys are not comparable, so this errs on the side of waiting)."""
    holder = Holder(ledger, {"j": 1000, "k": 10}, "multi", 5)
    waiter, box = in_thread(lambda: write(ledger, {"k": 11}, "waiter", 7))
    time.sleep(SEVERAL_STEPS_S)
    assert backend_alive(ledger, holder.pid)
    assert holder.resume() == "accepted"
    waiter.join(STUCK_S)
    assert box == ["accepted"]
    assert ledger_state(ledger)[0]["a"] == (12, 2)


def test_a_row_lock_that_is_not_a_fence_is_never_ended(ledger: GuardedStore, pg_env: StoreEnv) -> None:
    """A transaction that locked a high-water row itself published no token: it is waited for."""
    with ledger.fenced({"k": 1}):
        pass
    other = psycopg.connect(pg_env.url, autocommit=True)
    try:
        other.execute(f"SET search_path TO {pg_env.schema}")
        other.execute("BEGIN")
        other.execute("SELECT token FROM toolguard_high_water WHERE key = 'k' FOR UPDATE")
        waiter, box = in_thread(lambda: write(ledger, {"k": 11}, "waiter", 7))
        time.sleep(SEVERAL_STEPS_S)
        assert other.execute("SELECT 1").fetchone() == (1,)  # still connected
        other.execute("COMMIT")
        waiter.join(STUCK_S)
        assert box == ["accepted"]
    finally:
        other.close()


def test_the_sessions_lock_timeout_still_bounds_the_wait(ledger: GuardedStore,
                                                        pg_env: StoreEnv) -> None:
    live = Holder(ledger, {"k": 10}, "live", 5)
    conn = psycopg.connect(pg_env.url, autocommit=True)
    try:
        conn.execute(f"SET search_path TO {pg_env.schema}")
        conn.execute("SET lock_timeout = '300ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable), conn.transaction():
            conn.execute("SELECT toolguard_fence('k', 9)")
    finally:
        conn.close()
    assert live.resume() == "accepted"


def test_old_client_statements_still_fence(ledger: GuardedStore, pg_env: StoreEnv) -> None:
    """A version-1/2 client (BEGIN; toolguard_enter; toolguard_apply; COMMIT) on this schema,
    ended as a stale blocker too."""
    conn = psycopg.connect(pg_env.url, autocommit=True)
    try:
        conn.execute(f"SET search_path TO {pg_env.schema}")
        conn.execute("BEGIN")
        conn.execute("SELECT * FROM toolguard_enter(ARRAY['k'], ARRAY[10]::bigint[], 'old', "
                     "'deposit', NULL, NULL, 'h')")
        conn.execute("SELECT toolguard_apply('old', %s::jsonb, '{}')", ('{"ok": 1}',))
        # paused before its COMMIT: a newer holder ends it
        assert write(ledger, {"k": 11}, "next", 7) == "accepted"
        with pytest.raises(psycopg.OperationalError):
            conn.execute("COMMIT")
    finally:
        conn.close()
    assert status_of(ledger, "old") == []
    assert ledger.high_water("k") == 11


def test_a_deadlock_between_two_step_waits_is_still_detected(ledger: GuardedStore,
                                                             pg_env: StoreEnv) -> None:
    """Two transactions that fence keys in opposite orders (one key each, then the other's:
    possible for callers of toolguard_fence itself), equal tokens so neither may end the other:
    the steps grow past deadlock_timeout, so PostgreSQL's deadlock check still runs."""
    with ledger.fenced({"a": 1, "b": 1}):
        pass
    first, second = (psycopg.connect(pg_env.url, autocommit=True) for _ in range(2))
    try:
        for conn, key in ((first, "a"), (second, "b")):
            conn.execute(f"SET search_path TO {pg_env.schema}")
            conn.execute("BEGIN")
            conn.execute("SELECT toolguard_fence(%s, 10)", (key,))
        outcomes: dict[str, object] = {}

        def cross(name: str, conn: psycopg.Connection[Any], key: str) -> None:
            try:
                conn.execute("SELECT toolguard_fence(%s, 10)", (key,))
                outcomes[name] = "fenced"
            except psycopg.Error as error:
                outcomes[name] = error.sqlstate
                conn.execute("ROLLBACK")  # lets the other one through

        threads = [threading.Thread(target=cross, args=("first", first, "b")),
                   threading.Thread(target=cross, args=("second", second, "a"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(STUCK_S)
        stuck = any(t.is_alive() for t in threads)
        if stuck:  # end the statements, so that the connections can close
            first.cancel_safe()
            second.cancel_safe()
            for thread in threads:
                thread.join(STUCK_S)
        assert not stuck, "an undetected deadlock"
        assert sorted(map(str, outcomes.values())) == ["40P01", "fenced"]
    finally:
        first.close()
        second.close()
