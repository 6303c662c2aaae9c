"""PostgreSQL going away mid-write: nothing half-applied, a clear error, recovery by itself."""

from __future__ import annotations

import threading
import time

import pytest
from pg_server import PgServer

from store.envs import create_ledger, deposit, ledger_state
from toolguard.errors import BackendUnavailable
from toolguard.store import Begun, IntentRecord, Replay, open_store


@pytest.mark.fault
@pytest.mark.timeout(90)
def test_postgres_restart_mid_write(private_postgres: PgServer) -> None:
    store = open_store(private_postgres.url, install=True, timeout_s=2, max_size=4)
    try:
        create_ledger(store, ["a"])
        intent = IntentRecord(tool="deposit", idempotency_key="pg-restart-1", args_hash="h",
                              intent_id="call-1")
        assert store.begin_intent(intent) == Begun("pg-restart-1", 1, None)
        inside = threading.Event()
        stopped = threading.Event()
        errors: list[BaseException] = []

        def write() -> None:
            try:
                with store.fenced({"acct:a": 10}, intent) as tx:
                    deposit(tx, "a", 5, "lost")
                    inside.set()
                    stopped.wait(30)
                    tx.execute("SELECT 1")
            except BaseException as error:  # collected, asserted below
                errors.append(error)

        thread = threading.Thread(target=write)
        thread.start()
        assert inside.wait(10)
        private_postgres.stop("fast")  # terminates the open transaction
        stopped.set()
        thread.join(30)
        assert len(errors) == 1 and isinstance(errors[0], BackendUnavailable), errors

        # while it is down: a clear error, quickly enough
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            store.high_water("acct:a")
        assert time.monotonic() - started < 10

        private_postgres.start()
        # the pool recovers by itself; the interrupted attempt never applied, so it runs again once
        again = store.begin_intent(intent)
        assert again == Begun("pg-restart-1", 2, "pending")
        with store.fenced({"acct:a": 11}, intent) as tx:
            tx.record(deposit(tx, "a", 5, "retry"))
        assert store.begin_intent(intent) == Replay("pg-restart-1", 5, 2)
        balances, log = ledger_state(store)
        assert balances["a"] == (5, 1)
        assert [i for *_, i in log["a"]] == ["retry"]
        assert store.high_water("acct:a") == 11
    finally:
        store.close()
