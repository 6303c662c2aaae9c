"""A holder stopped (SIGSTOP) inside its fenced transaction, and the next holder.

Two processes: the first takes the lock (a real lock backend, SQLite, with a
short TTL), enters its fenced write, writes, and is stopped inside the tool
body, its transaction open; the second acquires once the first one's TTL ran
out and writes the same key. Then the first is continued and tries to commit.

PostgreSQL: the second holder ends the stopped one's transaction
(``toolguard_fence``: every token the blocker published is below its own) and
commits while the first is still stopped; the first one's commit then fails
with a typed error, audited once, its intent not applied; the ledger is exact.
Without the permission to end the blocker the second one keeps waiting (fail
safe) until it gets the permission.

SQLite: nothing can end another process's write transaction; a stopped holder
blocks every writer of the file. What holds: the blocked writer gives up after
its busy timeout with a typed error, and the late commit is refused by the
lease check, so the ledger stays exact; the next writer proceeds once the
stopped one is continued.

The time from the stop to the second holder's commit is measured and shown in
the fault table; it is not asserted (timing belongs in benchmarks/): what is
asserted is that the second holder commits while the first is still stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pg_server import ON_CI, PgServer, pg_available
from store.envs import create_ledger, deposit, ledger_state, rows

from fault.harness import spawn, timed
from fault.report import record
from fault.workload import Cell
from toolguard.errors import BackendUnavailable, LockLost, ToolGuardError
from toolguard.locks import connect, connect_async
from toolguard.store import GuardedStore, IntentRecord, open_async_store, open_store

pytestmark = pytest.mark.fault

TTL_MS = 800
#: Hang guards (a blocked call is reported, not waited for forever); never timing claims.
STUCK_S = 30.0


@dataclass(frozen=True)
class Spec:
    """What the first (stopped) holder does; picklable for the spawned process."""

    store_url: str
    lock_url: str
    key: str
    workdir: str
    store_options: dict[str, Any] = field(default_factory=dict)
    path: str = "sync"          # sync | async
    lease: bool = True          # store.fenced(lease, ...) or store.fenced(lease.tokens, ...)
    sql_after_wake: bool = False

    @property
    def ready(self) -> Path:
        return Path(self.workdir) / "ready.json"

    @property
    def go(self) -> Path:
        return Path(self.workdir) / "go"

    @property
    def result(self) -> Path:
        return Path(self.workdir) / "result.json"


def _intent(name: str, key: str) -> IntentRecord:
    return IntentRecord(tool="deposit", idempotency_key=name, args_hash="h", intent_id=name,
                        agent=name, keys=(key,))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _report(spec: Spec, error: BaseException | None) -> None:
    if error is None:
        _write_json(spec.result, {"outcome": "accepted"})
        return
    _write_json(spec.result, {"outcome": type(error).__name__,
                              "reason": getattr(error, "reason", None),
                              "typed": isinstance(error, ToolGuardError),
                              "message": str(error)[:500]})


def _inside(spec: Spec, tx: Any, token: int) -> None:
    """In the tool body, after the write: tell the test, then wait for it (stopped meanwhile)."""
    backend_pid = tx.connection.info.backend_pid if hasattr(tx.connection, "info") else None
    _write_json(spec.ready, {"pid": os.getpid(), "token": token, "backend_pid": backend_pid})


def run_first_holder(spec: Spec) -> None:
    """Entry point of the spawned first holder."""
    if spec.path == "async":
        asyncio.run(_run_first_holder_async(spec))
        return
    store = open_store(spec.store_url, **spec.store_options)
    locks = connect(spec.lock_url, ttl_ms=TTL_MS)
    error: BaseException | None = None
    try:
        with locks.acquire([spec.key]) as lease:
            try:
                with store.fenced(lease if spec.lease else lease.tokens,
                                  _intent("first", spec.key)) as tx:
                    deposit(tx, "a", 5, "first")
                    _inside(spec, tx, lease.tokens[spec.key])
                    while not spec.go.exists():  # the SIGSTOP lands here
                        time.sleep(0.01)
                    if spec.sql_after_wake:
                        tx.execute("SELECT 1")
            except Exception as caught:
                error = caught
    finally:
        _report(spec, error)
        locks.close()
        store.close()


async def _run_first_holder_async(spec: Spec) -> None:
    store = open_async_store(spec.store_url, **spec.store_options)
    locks = connect_async(spec.lock_url, ttl_ms=TTL_MS)
    error: BaseException | None = None
    try:
        lease = await locks.acquire([spec.key])
        try:
            async with store.fenced(lease if spec.lease else lease.tokens,
                                    _intent("first", spec.key)) as tx:
                cursor = await tx.execute("SELECT balance, version FROM ledger_account "
                                          "WHERE id = 'a'")
                balance, version = await cursor.fetchone()
                await tx.execute("UPDATE ledger_account SET balance = %s, version = %s "
                                 "WHERE id = 'a'", (balance + 5, version + 1))
                await tx.execute("INSERT INTO ledger_log (account, version, token, delta, "
                                 "intent_id) VALUES ('a', %s, %s, 5, 'first')",
                                 (version + 1, lease.tokens[spec.key]))
                _inside(spec, tx, lease.tokens[spec.key])
                while not spec.go.exists():
                    await asyncio.sleep(0.01)
                if spec.sql_after_wake:
                    await tx.execute("SELECT 1")
        except Exception as caught:
            error = caught
        finally:
            await lease.arelease()
    finally:
        _report(spec, error)
        await locks.aclose()
        await store.close()


class StoppedHolder:
    """The first holder's process: started, stopped inside its transaction, continued."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.process = spawn.Process(target=run_first_holder, args=(spec,), name="first-holder")
        self.process.start()
        deadline = time.monotonic() + 60  # spawn imports take a while on a loaded machine
        while not spec.ready.exists():
            assert self.process.is_alive(), "the first holder died before its write"
            assert time.monotonic() < deadline, "the first holder never got inside"
            time.sleep(0.01)
        self.info = json.loads(spec.ready.read_text())
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGSTOP)
        self.stopped_at = time.monotonic()

    def is_stopped(self) -> bool:
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    def resume(self) -> dict[str, Any]:
        self.spec.go.touch()
        if self.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
        self.process.join(STUCK_S)
        assert self.process.exitcode == 0, self.process.exitcode
        return dict(json.loads(self.spec.result.read_text()))

    def cleanup(self) -> None:
        if self.process.is_alive():
            self.spec.go.touch()
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid or 0, signal.SIGCONT)
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()


@contextlib.contextmanager
def stopped_holder(spec: Spec) -> Iterator[StoppedHolder]:
    holder = StoppedHolder(spec)
    try:
        yield holder
    finally:
        holder.cleanup()


def next_holder(store: GuardedStore, lock_url: str, key: str) -> tuple[object, int]:
    """The second holder: acquire (waits for the first one's TTL), write, commit."""
    locks = connect(lock_url, ttl_ms=10_000)
    try:
        with locks.acquire([key], timeout_s=STUCK_S) as lease:
            with store.fenced(lease, _intent("second", key)) as tx:
                deposit(tx, "a", 7, "second")
            return "accepted", lease.tokens[key]
    finally:
        locks.close()


def audit_of(store: GuardedStore, name: str) -> list[tuple[str, str]]:
    return [(e.decision, e.reason) for e in store.query_audit(intent_id=name, limit=None)]


def intent_status(store: GuardedStore, name: str) -> list[tuple[Any, ...]]:
    return rows(store, "SELECT status FROM toolguard_intent WHERE idempotency_key = %s", (name,))


def _check_exact(store: GuardedStore, key: str, second_token: int) -> None:
    balances, log = ledger_state(store)
    assert balances["a"] == (7, 1)
    assert [(delta, intent) for _, _, delta, intent in log["a"]] == [(7, "second")]
    assert store.high_water(key) == second_token
    assert audit_of(store, "second") == [("accepted", "applied")]
    assert intent_status(store, "second") == [("applied",)]


# --- PostgreSQL --------------------------------------------------------------------------------------


@pytest.fixture
def pg_server() -> Iterator[PgServer]:
    """A private PostgreSQL: the test reads its server log and creates roles in it."""
    problem = pg_available()
    if problem is not None:  # skip only locally, as everywhere in the suite
        if ON_CI:
            pytest.fail(f"{problem}; CI must provide it", pytrace=False)
        pytest.skip(problem)
    server = PgServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def pg_store(pg_server: PgServer, unique: str) -> Iterator[tuple[str, dict[str, Any]]]:
    options = {"schema": f"tg_paused_{unique}"}
    store = open_store(pg_server.url, install=True, **options)
    try:
        create_ledger(store, ["a"])
    finally:
        store.close()
    yield pg_server.url, options


CASES = {
    # first holder: path, lease or tokens, SQL after waking; the key fenced before or new
    "sync lease, new key": ("sync", True, False, "new"),
    "sync lease, SQL after waking": ("sync", True, True, "existing"),
    "async lease, existing key": ("async", True, True, "existing"),
    "sync tokens only": ("sync", False, False, "existing"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_next_holder_ends_a_stopped_holder_transaction(pg_store: tuple[str, dict[str, Any]],
                                                       pg_server: PgServer,
                                                       tmp_path: Path, case: str) -> None:
    path, with_lease, sql_after_wake, key_state = CASES[case]
    url, options = pg_store
    lock_url = f"sqlite:///{tmp_path}/locks.db"
    key = "acct:a"
    store = open_store(url, **options)
    try:
        if key_state == "existing":
            with store.fenced({key: 1}):
                pass
        spec = Spec(url, lock_url, key, str(tmp_path), options, path=path, lease=with_lease,
                    sql_after_wake=sql_after_wake)
        with stopped_holder(spec) as first:
            took, outcome = timed(lambda: next_holder(store, lock_url, key), STUCK_S)
            assert took is not None, "the next holder was still blocked by the stopped one"
            assert first.is_stopped(), "the first holder must still be stopped"
            assert isinstance(outcome, tuple) and outcome[0] == "accepted", outcome
            proceeded_s = time.monotonic() - first.stopped_at
            result = first.resume()
        _, second_token = outcome
        assert second_token > first.info["token"]
        assert result["typed"], result
        first_audit = audit_of(store, "first")
        if with_lease:  # the lease check before the commit (or the lost connection it explains)
            assert (result["outcome"], result["reason"]) == (LockLost.__name__, "lease_lost")
            assert first_audit == [("rejected", "lease_lost")]
            assert intent_status(store, "first") == [("failed",)]
        else:  # tokens alone: the connection broke, the outcome is unknown to the client
            assert result["outcome"] == BackendUnavailable.__name__, result
            assert first_audit == [("failed", "backend_unavailable")]
            assert intent_status(store, "first") == [("unknown",)]
        _check_exact(store, key, second_token)
        log = pg_server.logfile.read_text()
        assert f"ended the transaction of pid {first.info['backend_pid']}" in log
    finally:
        store.close()
    record(f"postgresql: holder SIGSTOPped in its transaction ({case})", {
        "ledger_exact": Cell(True, "only the next holder's write landed"),
        "rejections_audited": Cell(True, f"late commit: {result['outcome']}, audited once"),
        "progress": Cell(True, f"next holder committed {proceeded_s:.2f} s after the stop "
                               f"(TTL {TTL_MS / 1000:.1f} s; bound TTL + 1 s) while the first "
                               f"was still stopped"),
    })


@pytest.mark.timeout(120)
def test_without_permission_the_next_holder_waits_then_proceeds(pg_server: PgServer,
                                                                 unique: str,
                                                                 tmp_path: Path) -> None:
    """Two roles, neither allowed to signal the other: the waiter keeps waiting (fail safe),
    says so in the server log, and ends the blocker once it is granted pg_signal_backend."""
    admin = psycopg.connect(pg_server.url, autocommit=True)
    schema = f"tg_perm_{unique}"
    roles = (f"app_a_{unique}", f"app_b_{unique}")
    try:
        for role in roles:
            admin.execute(f'CREATE ROLE "{role}" LOGIN')
        admin.execute(f'CREATE SCHEMA "{schema}" AUTHORIZATION "{roles[0]}"')
        admin.execute(f'GRANT CREATE ON DATABASE postgres TO "{roles[0]}"')
        base = pg_server.url.replace("postgres@", "{}@")
        url_a, url_b = base.format(roles[0]), base.format(roles[1])
        setup = open_store(url_a, schema=schema, install=True)
        try:
            create_ledger(setup, ["a"])
            with setup.fenced({"acct:a": 1}):
                pass
        finally:
            setup.close()
        admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{roles[1]}"')
        admin.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA "{schema}" TO "{roles[1]}"')
        admin.execute(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA "{schema}" TO "{roles[1]}"')
        lock_url = f"sqlite:///{tmp_path}/locks.db"
        store_b = open_store(url_b, schema=schema)
        spec = Spec(url_a, lock_url, "acct:a", str(tmp_path), {"schema": schema})
        try:
            with stopped_holder(spec) as first:
                blocked = f"not permitted to end pid {first.info['backend_pid']}"
                box: list[object] = []
                waiter = _thread(lambda: box.append(next_holder(store_b, lock_url, "acct:a")))
                assert _wait_for(lambda: blocked in pg_server.logfile.read_text()), \
                    "the waiter never judged the blocker"
                assert waiter.is_alive() and not box  # still waiting: fail safe
                alive = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                      (first.info["backend_pid"],)).fetchone()
                assert alive == (1,)
                admin.execute(f'GRANT pg_signal_backend TO "{roles[1]}"')
                waiter.join(STUCK_S)
                assert box and isinstance(box[0], tuple) and box[0][0] == "accepted", box
                assert first.is_stopped()
                result = first.resume()
            assert (result["outcome"], result["reason"]) == (LockLost.__name__, "lease_lost")
            _check_exact(store_b, "acct:a", box[0][1])  # type: ignore[index]
            assert audit_of(store_b, "first") == [("rejected", "lease_lost")]
        finally:
            store_b.close()
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        for role in roles:
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        admin.close()


def _thread(fn: Any) -> Any:
    import threading

    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _wait_for(condition: Any, limit_s: float = STUCK_S) -> bool:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- SQLite ------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_sqlite_a_stopped_holder_blocks_writers_but_cannot_commit_late(tmp_path: Path) -> None:
    store_url = f"sqlite:///{tmp_path}/store.db"
    lock_url = f"sqlite:///{tmp_path}/locks.db"  # a file of its own: the lock still changes hands
    key = "acct:a"
    setup = open_store(store_url, install=True)
    create_ledger(setup, ["a"])
    setup.close()
    store = open_store(store_url, busy_timeout_ms=1_000)
    try:
        with stopped_holder(Spec(store_url, lock_url, key, str(tmp_path))) as first:
            # The lock changes hands after the TTL, but the store's write lock does not: the
            # blocked writer gives up after its busy timeout, with a typed error.
            took, outcome = timed(lambda: next_holder(store, lock_url, key), STUCK_S)
            assert took is not None, "the blocked writer did not give up after its busy timeout"
            assert isinstance(outcome, BackendUnavailable) and "locked" in str(outcome), outcome
            assert first.is_stopped()
            # Continued, the stopped holder's commit is refused: its lease is gone.
            result = first.resume()
        assert (result["outcome"], result["reason"]) == (LockLost.__name__, "lease_lost")
        assert audit_of(store, "first") == [("rejected", "lease_lost")]
        assert intent_status(store, "first") == [("failed",)]
        # The file is free again: the next holder proceeds.
        status, second_token = next_holder(store, lock_url, key)
        assert status == "accepted"
        _check_exact(store, key, second_token)
    finally:
        store.close()
    record("sqlite: holder SIGSTOPped in its transaction", {
        "ledger_exact": Cell(True, "the late commit was refused by the lease check"),
        "rejections_audited": Cell(True, "late commit audited once (lease_lost); the blocked "
                                         "writer's failure could not be written while the "
                                         "file was locked"),
        "progress": Cell(None, "not bounded on SQLite: writers wait for the stopped holder "
                               "(busy timeout, then BackendUnavailable)"),
    })
